"""TFRecord framing and one append-only event file, the container TensorBoard reads.

A record is: little-endian u64 length, masked CRC32C of those 8 bytes, the payload, masked CRC32C of
the payload. The CRC comes from the `crc32c` package (C, hardware-accelerated where the CPU has it),
because a pure-Python CRC over every record is what makes the usual writers slow.
"""

from __future__ import annotations

import itertools
import os
import socket
import struct
import time
from collections.abc import Iterable

import crc32c

from gradlog.runformat.names import RUN_MARK

_MASK_DELTA = 0xA282EAD8
_U32 = 0xFFFFFFFF
_LENGTH = struct.Struct("<Q")
_CRC = struct.Struct("<I")
_serial = itertools.count()  # distinguishes event files one process creates in the same second


def masked_crc(data: bytes) -> int:
    """CRC32C rotated right by 15 bits plus a constant, as TFRecord stores it."""
    crc = crc32c.crc32c(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & _U32


def frame(payload: bytes) -> bytes:
    """One complete TFRecord."""
    header = _LENGTH.pack(len(payload))
    return b"".join((header, _CRC.pack(masked_crc(header)), payload, _CRC.pack(masked_crc(payload))))


def frames(payloads: Iterable[bytes]) -> bytes:
    return b"".join(frame(p) for p in payloads)


class EventFile:
    """A new `events.out.tfevents.*` file, created exclusively: never opened for appending twice.

    Writes go straight to the OS (no user-space buffer), so a record is safe from a `kill -9`
    of this process as soon as `write` returns; `fsync` is only needed against power loss.
    """

    def __init__(self, log_dir: str, run: str = "") -> None:
        os.makedirs(log_dir, exist_ok=True)
        host = socket.gethostname().replace(os.sep, "_") or "localhost"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
        while True:
            name = f"events.out.tfevents.{int(time.time())}.{host}.{os.getpid()}.{next(_serial)}"
            if run:  # which writer (which run) made it: readers tell two runs in one folder apart
                name += f".{RUN_MARK}{run}"
            path = os.path.join(log_dir, name)
            try:
                self.fd: int | None = os.open(path, flags, 0o644)
                break
            except FileExistsError:  # another process with our pid (a container restart): pick the next name
                continue
        self.path = path
        self.size = 0  # bytes of whole records written: where the file ends when no write is torn

    def write(self, data: bytes) -> None:
        """Write all of `data`; `os.write` may write less than asked, so loop."""
        if self.fd is None:
            raise ValueError(f"event file {self.path} is closed")
        view = memoryview(data)
        while view:
            n = os.write(self.fd, view)
            view = view[n:]
        self.size += len(data)

    def rewind(self) -> None:
        """After a failed write: cut the file back to its last whole record, so it can be written again
        (one file per outage, not one per retry). Raises OSError when that is not possible."""
        if self.fd is None:
            raise OSError(f"event file {self.path} is closed")
        os.ftruncate(self.fd, self.size)
        os.lseek(self.fd, self.size, os.SEEK_SET)

    def sync(self) -> None:
        if self.fd is not None:
            os.fsync(self.fd)

    def vanished(self) -> bool:
        """True when the file was deleted under us (its directory removed, say): writes would go nowhere."""
        if self.fd is None:
            return False
        try:
            return os.fstat(self.fd).st_nlink == 0 or not os.path.exists(self.path)
        except OSError:
            return True

    def close(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)
