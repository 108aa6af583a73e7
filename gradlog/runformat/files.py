"""The one way readers touch the disk: run folders may come from someone else, so nothing in them is trusted.

- `open_regular` opens a file only if, with every symlink resolved, it stays inside the run folder and is
  a regular file (FIFOs, devices, sockets and folders are refused before opening, and the open itself
  is non-blocking and re-checked with `fstat`, so a file swapped for a FIFO in between cannot hang us),
  and only up to a size cap.
- `find_files` walks a folder without following folder symlinks (no loops) and stops with a message
  above a number of candidate files, instead of running for minutes.
- `loads_json` parses JSON with a nesting limit (Python's parser recurses and can exhaust the stack).
- `shown` makes any text from a run safe to print: control and escape characters become `\\x1b`-style
  escapes, lone surrogates become U+FFFD.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, BinaryIO

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
#: JSON values gradlog writes nest 3 levels (a histogram dict of lists); anything far deeper is not ours.
MAX_JSON_DEPTH = 64


class Refused(Exception):
    """A file the run names that gradlog will not open (outside the run folder, not a regular file, too big)."""


@dataclass(frozen=True)
class Limits:
    """Caps on what reading one run may cost. The defaults fit real runs with room to spare.

    `max_file_bytes`: one event file or W&B run file (a 404-tensor x 100-step run with histograms is 111 MB).
    `max_table_bytes`: one W&B table file (a never-updated table of 10,000 tensors is about 1 MB).
    `max_files`: candidate files (`*tfevents*`, `*.wandb`) found when searching a folder.
    `max_entries`: folder entries looked at during that search.
    `max_record_bytes`: one TensorBoard or W&B record (gradlog's are below 1 MB; its W&B rows are split at about
    10 MB); a bigger one is skipped unread.
    """

    max_file_bytes: int = 4 * GIB
    max_table_bytes: int = 64 * MIB
    max_files: int = 20_000
    max_entries: int = 1_000_000
    max_record_bytes: int = 64 * MIB

    def __post_init__(self) -> None:
        for name in ("max_file_bytes", "max_table_bytes", "max_files", "max_entries", "max_record_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Limits({name}={value!r}): must be a positive whole number")
        if self.max_record_bytes >= 1 << 32:
            raise ValueError(f"Limits(max_record_bytes={self.max_record_bytes}): must be below 4 GiB")


#: The command-line flag that raises each cap, named in the messages.
FLAGS = {"max_file_bytes": "--max-file-size", "max_table_bytes": "--max-table-size", "max_files": "--max-files"}

_UNITS = {"": 1, "K": KIB, "M": MIB, "G": GIB, "T": 1 << 40}


def parse_size(text: str) -> int:
    """`'4G'`, `'64M'`, `'512K'`, `'1000'` (bytes; binary units, an optional `B`/`iB`) -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if m is None:
        raise ValueError(f"{text!r} is not a size; write a number of bytes, or e.g. 512K, 64M, 4G")
    value = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if value < 1:
        raise ValueError(f"{text!r} is not a positive size")
    return value


def real_root(path: str) -> str:
    """The folder every opened file must stay inside, symlinks resolved (the user chose this path)."""
    return os.path.realpath(path)


def inside(real: str, root: str) -> bool:
    """Whether the resolved path `real` is `root` or below it."""
    return real == root or real.startswith(root.rstrip(os.sep) + os.sep)


def _kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a named pipe (FIFO)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISDIR(mode):
        return "a folder"
    return "not a regular file"


def _check(st: os.stat_result, path: str, what: str, max_bytes: int, cap: str) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise Refused(f"{path}: {what} is {_kind(st.st_mode)}, not a regular file; not opened")
    if st.st_size > max_bytes:
        flag = FLAGS.get(cap, cap)
        raise Refused(
            f"{path}: {what} is {st.st_size:,} bytes, above the {max_bytes:,}-byte cap; not read "
            f"(raise it with {flag} if you trust this run)"
        )


_OPEN_FLAGS = (
    os.O_RDONLY
    | getattr(os, "O_NONBLOCK", 0)
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_CLOEXEC", 0)
    | getattr(os, "O_NOCTTY", 0)
    | getattr(os, "O_BINARY", 0)
)


def open_regular(path: str, root: str, *, max_bytes: int, what: str, cap: str = "max_file_bytes") -> BinaryIO:
    """Open `path` for binary reading if it resolves to a regular file inside `root` of at most `max_bytes`.

    `root` must already be resolved (`real_root`). Raises `Refused` (with the reason and the fix) or
    `OSError` (missing, unreadable, a symlink loop).
    """
    real = os.path.realpath(path)
    if not inside(real, root):
        raise Refused(f"{path}: {what} points outside the run folder {root} (to {real}); not opened")
    _check(os.stat(real), path, what, max_bytes, cap)  # stat first: opening a FIFO or device can block
    fd = os.open(real, _OPEN_FLAGS)  # non-blocking and no final symlink: a swap since the stat cannot hang us
    try:
        _check(os.fstat(fd), path, what, max_bytes, cap)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str, root: str, *, max_bytes: int, what: str, cap: str = "max_file_bytes") -> bytes:
    """The whole of a file `open_regular` accepts; a file that grows past the cap while read is refused too."""
    with open_regular(path, root, max_bytes=max_bytes, what=what, cap=cap) as f:
        # read(n) allocates n bytes up front: ask for what fstat says is there, then for any growth in chunks
        parts = [f.read(os.fstat(f.fileno()).st_size + 1)]
        total = len(parts[0])
        while total <= max_bytes:
            more = f.read(min(MIB, max_bytes + 1 - total))
            if not more:
                break
            parts.append(more)
            total += len(more)
        data = b"".join(parts) if len(parts) > 1 else parts[0]
    if len(data) > max_bytes:
        raise Refused(f"{path}: {what} grew above the {max_bytes:,}-byte cap while being read; not read")
    return data


def find_files(root: str, match: Callable[[str], bool], limits: Limits, notes: list[str] | None = None) -> list[str]:
    """Files under the resolved folder `root` whose name `match`es, sorted; folder symlinks are not followed.

    A folder symlink's target, if it is inside `root`, is walked anyway under its own name, so nothing
    inside is missed and nothing is read twice (W&B's `latest-run` link, say). Raises `Refused` above
    `limits.max_files` candidates or `limits.max_entries` entries. Folders that cannot be listed are
    named in `notes`.
    """
    found: list[str] = []
    stack = [root]
    seen: set[tuple[int, int]] = set()
    entries = 0
    while stack:
        folder = stack.pop()
        try:
            st = os.stat(folder)
            if (st.st_dev, st.st_ino) in seen:  # bind mounts can loop without symlinks
                continue
            seen.add((st.st_dev, st.st_ino))
            with os.scandir(folder) as it:
                for entry in it:
                    entries += 1
                    if entries > limits.max_entries:
                        raise Refused(
                            f"{root} holds more than {limits.max_entries:,} files and folders; "
                            "pass the run folder itself (the log dir a GradLogger wrote, or one W&B run dir)"
                        )
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
                    elif match(entry.name):
                        found.append(entry.path)
                        if len(found) > limits.max_files:
                            raise Refused(
                                f"{root} holds more than {limits.max_files:,} event or W&B run files; pass one "
                                f"run folder, or raise the cap with {FLAGS['max_files']} if you mean to read them all"
                            )
        except OSError as exc:
            if notes is not None:
                notes.append(f"{folder}: cannot be listed ({exc.strerror or exc})")
    return sorted(found)


_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')


def loads_json(text: str | bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """`json.loads` that raises `ValueError` instead of recursing past `max_depth` nested arrays/objects.

    Accepts W&B's `NaN` / `Infinity` as Python's parser does. The depth is counted only when the text
    holds more brackets than `max_depth` at all, so ordinary values cost one `count`.
    """
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    if text.count("[") + text.count("{") > max_depth:
        depth = 0
        for m in _STRING.finditer(text):
            tok = m.group()
            if tok in "[{":
                depth += 1
                if depth > max_depth:
                    raise ValueError(f"JSON nested deeper than {max_depth} levels")
            elif tok in "]}":
                depth -= 1
    return json.loads(text)


_SURROGATES = re.compile("[\ud800-\udfff]")


def valid_text(text: str) -> str:
    """`text` with lone surrogates (which no encoder accepts) replaced by U+FFFD."""
    return _SURROGATES.sub("\ufffd", text)


def shown(text: str) -> str:
    """`text` safe for a terminal: non-printable characters (escapes, newlines, bidi controls) as `\\x1b`,
    `\\u202e`-style escapes, lone surrogates as U+FFFD. Printable text is returned unchanged."""
    if text.isprintable():
        return text
    out = []
    for ch in text:
        code = ord(ch)
        if ch.isprintable():
            out.append(ch)
        elif 0xD800 <= code <= 0xDFFF:
            out.append("\ufffd")
        elif code < 0x100:
            out.append(f"\\x{code:02x}")
        elif code < 0x10000:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    return "".join(out)


def shown_lines(text: str) -> str:
    """`shown` on each line of `text`: the line breaks gradlog put there stay, everything else is escaped."""
    return "\n".join(shown(line) for line in text.split("\n"))


__all__ = [
    "FLAGS",
    "MAX_JSON_DEPTH",
    "Limits",
    "Refused",
    "find_files",
    "inside",
    "loads_json",
    "open_regular",
    "parse_size",
    "read_regular",
    "real_root",
    "shown",
    "shown_lines",
    "valid_text",
]
