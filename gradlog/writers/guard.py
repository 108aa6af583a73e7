"""Writer trouble must never kill a training run: warn once per writer and call, then carry on."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from gradlog.measure.histogram import Histogram
from gradlog.writers.base import Writer

log = logging.getLogger("gradlog")
T = TypeVar("T")


class GuardedWriters(Writer):
    """Fans out to several writers; a failing one is warned about once and the others go on.

    With `strict=True` the first error is raised instead (useful in tests and CI).
    """

    def __init__(self, writers: Sequence[Writer], strict: bool = False) -> None:
        self.writers = list(writers)
        self.strict = strict
        self._warned: set[tuple[int, str]] = set()

    def _each(self, what: str, call: Callable[[Writer], object]) -> None:
        for w in self.writers:
            try:
                call(w)
            except Exception as exc:
                if self.strict:
                    raise
                key = (id(w), what)
                if key not in self._warned:
                    self._warned.add(key)
                    msg = (
                        f"gradlog: {type(w).__name__}.{what} failed ({type(exc).__name__}: {exc}); "
                        "training continues, further errors of this kind are not shown"
                    )
                    warnings.warn(msg, RuntimeWarning, stacklevel=4)
                    log.warning(msg)

    def log_scalars(self, scalars: Mapping[str, float], step: int) -> None:
        self._each("log_scalars", lambda w: w.log_scalars(scalars, step))

    def log_histogram(self, tag: str, hist: Histogram, step: int) -> None:
        self._each("log_histogram", lambda w: w.log_histogram(tag, hist, step))

    def log_table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
        self._each("log_table", lambda w: w.log_table(name, columns, rows))

    def log_image(self, tag: str, png: bytes, step: int) -> None:
        self._each("log_image", lambda w: w.log_image(tag, png, step))

    def flush(self) -> None:
        self._each("flush", lambda w: w.flush())

    def close(self) -> None:
        self._each("close", lambda w: w.close())
