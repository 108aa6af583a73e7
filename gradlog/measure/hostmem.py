"""Large fresh host buffers backed by transparent huge pages, where the kernel offers them.

A kept copy of a big 1-D tensor (its exact per-element fingerprint) and the weight snapshot of each
measured step are written into fresh memory, and on Linux fresh memory costs one page fault per
4 KiB page, each zeroing its page: for 200 MB that is ~10x a `sum()` over the same bytes. With
`madvise(MADV_HUGEPAGE)` on the buffer before it is first touched, the kernel maps 2 MiB pages
instead (512x fewer faults): ~3-4x a `sum()`. Kernels with THP "always" do this anyway, "never"
ignores it; elsewhere (no libc, other OS) it is a plain
`torch.empty`, so this only ever changes speed, never a value.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from collections.abc import Callable

import torch

_HUGE = 1 << 21  # 2 MiB, the x86-64 / arm64 (4 KiB base page) huge page
MIN_BYTES = 2 << 20  # below this no 2 MiB page fits inside: not worth a syscall (a plain clone is cheaper)
_MADV_HUGEPAGE = 14  # the same value on every Linux architecture


@functools.lru_cache(maxsize=1)
def _madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def empty_host(n: int, dtype: torch.dtype) -> torch.Tensor:
    """`torch.empty(n, dtype=dtype)` on the CPU, asking for huge pages when it is big enough.

    Only the 2 MiB-aligned middle of the buffer is advised, so no neighbouring allocation is touched;
    a failed `madvise` (old kernel, THP off) is ignored."""
    out = torch.empty(n, dtype=dtype)
    nbytes = n * out.element_size()
    if nbytes < MIN_BYTES:
        return out
    madvise = _madvise()
    if madvise is None:
        return out
    addr = out.data_ptr()
    start = (addr + _HUGE - 1) & ~(_HUGE - 1)
    stop = (addr + nbytes) & ~(_HUGE - 1)
    if stop > start:
        madvise(start, stop - start, _MADV_HUGEPAGE)
    return out


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of a CPU tensor in fresh (huge-page) memory, with `t`'s shape."""
    out = empty_host(t.numel(), t.dtype).view(t.shape)
    return out.copy_(t)
