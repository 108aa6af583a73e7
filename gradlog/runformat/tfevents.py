"""TensorBoard event files: TFRecord framing, written (`frame`) and read back by gradlog itself (`records`,
`events`: each file opened once, damage skipped, not fatal).

A TFRecord is: u64 little-endian length, masked CRC32C of those 8 bytes, the payload, masked CRC32C of
the payload. TensorBoard's own reader stops at the first bad record, so one flipped bit loses the rest of
the file; and its directory watcher is quadratic in the number of files. Here, after a record whose
length or data CRC fails, the reader scans forward byte by byte for the next offset where both CRCs
check, resumes there and says how many bytes it skipped. A false resync needs two 32-bit CRCs to match
by chance.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterable, Iterator
from typing import Any, BinaryIO

_crc32c: Any
try:  # C, hardware-accelerated where the CPU has it: a pure-Python CRC over every record is what makes
    import crc32c as _crc32c  # the usual writers slow (gradlog's writer requires it, see writers/tfrecord.py)
except ImportError:
    _crc32c = None

_LENGTH = struct.Struct("<Q")
_U32 = struct.Struct("<I")
_MASK_DELTA = 0xA282EAD8
_HEADER = 12  # length + its CRC
_ZERO4 = b"\0\0\0\0"
_NONZERO = re.compile(rb"[^\x00]")
_SCAN_CHUNK = 1 << 20


def masked_crc(data: bytes | memoryview) -> int:
    """TFRecord's masked CRC32C (rotated right by 15 bits plus a constant): the C `crc32c` package (the
    tensorboard extra), else tensorboard's own."""
    if _crc32c is None:
        from tensorboard.compat.tensorflow_stub import pywrap_tensorflow as stub

        return int(stub.masked_crc32c(bytes(data)))
    crc = int(_crc32c.crc32c(data))
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def frame(payload: bytes) -> bytes:
    """One complete TFRecord (the write side: gradlog's TensorBoard writer)."""
    header = _LENGTH.pack(len(payload))
    return b"".join((header, _U32.pack(masked_crc(header)), payload, _U32.pack(masked_crc(payload))))


def frames(payloads: Iterable[bytes]) -> bytes:
    return b"".join(frame(p) for p in payloads)


def _header_ok(buf: bytes | memoryview, i: int) -> bool:
    return bool(_U32.unpack_from(buf, i + 8)[0] == masked_crc(buf[i : i + 8]))


def _data_ok(f: BinaryIO, offset: int, length: int) -> bytes | None:
    f.seek(offset + _HEADER)
    payload = f.read(length)
    tail = f.read(4)
    if len(payload) == length and len(tail) == 4 and _U32.unpack(tail)[0] == masked_crc(payload):
        return payload
    return None


def _resync(f: BinaryIO, start: int, size: int, max_record: int) -> int | None:
    """The first offset >= `start` holding a whole record whose length and data CRCs both check, or None.

    Only a window of `max_record` bytes (plus framing) is scanned: a record that fits the cap started in
    it. Candidates are found at C speed: a plausible length has four zero high bytes, and a run of zeros
    (a preallocated tail) cannot hold a valid header, so it is jumped over.
    """
    end = min(size, start + max_record + 2 * _HEADER + 4)
    pos = start
    while pos + _HEADER + 4 <= size and pos < end:
        f.seek(pos)
        buf = f.read(min(_SCAN_CHUNK, end - pos) + _HEADER + 4)
        if len(buf) < _HEADER + 4:
            return None
        last = min(len(buf) - _HEADER, end - pos - 1)  # candidate offsets in this buffer: 0..last
        i = 0
        while i <= last:
            k = buf.find(_ZERO4, i + 4)
            if k < 0 or k - 4 > last:
                break
            i = k - 4
            if not any(buf[i : i + _HEADER]):  # all zero: no valid header; jump to the next non-zero byte
                m = _NONZERO.search(buf, i)
                if m is None:
                    break
                i = max(i + 1, m.start() - _HEADER + 1)
                continue
            (length,) = _LENGTH.unpack_from(buf, i)
            offset = pos + i
            if length <= max_record and offset + _HEADER + length + 4 <= size and _header_ok(buf, i):
                if _data_ok(f, offset, length) is not None:
                    return offset
            i += 1
        pos += max(1, last + 1)
    return None


def records(f: BinaryIO, size: int, name: str, skipped: list[str], max_record: int) -> Iterator[tuple[int, bytes]]:
    """`(offset, payload)` of every intact record in an open event file of `size` bytes.

    Damage goes to `skipped`, one line per damaged stretch: where, why, how many bytes were skipped and
    where reading resumed. A torn last record (a writer killed mid-write) ends the file.
    """
    pos = 0
    f.seek(0)
    while pos < size:
        header = f.read(_HEADER)
        if len(header) < _HEADER:
            skipped.append(f"{name}: truncated record header at byte {pos} ({size - pos} bytes not read)")
            return
        why = None
        (length,) = _LENGTH.unpack_from(header)
        if not _header_ok(header, 0):
            why = "corrupt record header"
        elif pos + _HEADER + length + 4 > size:
            skipped.append(f"{name}: truncated last record at byte {pos} ({size - pos} bytes not read)")
            return
        elif length > max_record:
            skipped.append(
                f"{name}: record at byte {pos} holds {length:,} bytes, above the {max_record:,}-byte record cap; "
                "skipped unread"
            )
            pos += _HEADER + length + 4
            f.seek(pos)
            continue
        else:
            payload = f.read(length)
            tail = f.read(4)
            if len(payload) == length and len(tail) == 4 and _U32.unpack(tail)[0] == masked_crc(payload):
                yield pos, payload
                pos += _HEADER + length + 4
                continue
            why = "corrupt record"
        found = _resync(f, pos + 1, size, max_record)
        if found is None:
            skipped.append(
                f"{name}: {why} at byte {pos}; no intact record after it: the remaining {size - pos} bytes were skipped"
            )
            return
        skipped.append(f"{name}: {why} at byte {pos}; skipped {found - pos} bytes, reading resumed at byte {found}")
        pos = found
        f.seek(pos)


def events(f: BinaryIO, size: int, name: str, skipped: list[str], max_record: int) -> Iterator[Any]:
    """Every TensorBoard `Event` in an open event file; records that are not Events are skipped and named."""
    from tensorboard.compat.proto import event_pb2

    event_cls: Any = event_pb2.Event  # generated protobuf class: no type information
    for offset, payload in records(f, size, name, skipped, max_record):
        ev = event_cls()
        try:
            ev.ParseFromString(payload)
        except Exception as exc:  # protobuf's DecodeError (bad wire data, invalid UTF-8, nesting too deep)
            skipped.append(f"{name}: record at byte {offset} ({len(payload)} bytes) is not a TensorBoard Event ({exc})")
            continue
        yield ev


__all__ = ["events", "masked_crc", "records"]
