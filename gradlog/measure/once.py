"""Trouble inside gradlog, said once: a RuntimeWarning pointing at the user's code, and the `gradlog` logger.

One helper for every stage (it lives in `measure`, the stage every other may import): a failing step,
writer or collective must not flood the log, nor go unsaid.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Hashable

log = logging.getLogger("gradlog")
log.addHandler(logging.NullHandler())

__all__ = ["WarnOnce", "warn"]


def warn(msg: str, stacklevel: int = 2) -> None:
    """Warn now (`stacklevel` as for `warnings.warn`, counted from the caller of this function)."""
    warnings.warn(msg, RuntimeWarning, stacklevel=stacklevel + 1)
    log.warning(msg)


class WarnOnce:
    """`warn`, at most once per key."""

    def __init__(self) -> None:
        self.seen: set[Hashable] = set()

    def __call__(self, key: Hashable, msg: str, stacklevel: int = 2) -> bool:
        """Warn `msg` unless `key` was warned about before; True when it warned."""
        if key in self.seen:
            return False
        self.seen.add(key)
        warn(msg, stacklevel + 1)
        return True
