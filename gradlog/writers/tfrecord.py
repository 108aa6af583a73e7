"""One append-only event file, the container TensorBoard reads; its records are framed by the run format
(`gradlog.runformat.tfevents.frame`: the same module reads them back).

The CRC must come from the `crc32c` package (C, hardware-accelerated where the CPU has it), because a
pure-Python CRC over every record is what makes the usual writers slow: it is imported here, so that
`TensorBoardWriter()` fails with the install hint without it.
"""

from __future__ import annotations

import itertools
import os
import socket
import time

import crc32c  # noqa: F401  # required by the writer (see above); the framing itself is runformat.tfevents

from gradlog.runformat.names import RUN_MARK
from gradlog.runformat.tfevents import frame as frame
from gradlog.runformat.tfevents import frames as frames

_serial = itertools.count()  # distinguishes event files one process creates in the same second


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
