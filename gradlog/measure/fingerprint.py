"""A cheap, exact-enough signature of a tensor's values, to tell "never changed" without a copy.

The raw bits are read as integers and combined into two 64-bit sums (plain, and weighted by a
hash of the position), chunk by chunk so the temporary memory stays small. Any real update
changes at least one bit pattern and so, with overwhelming probability, a sum.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gradlog.measure.params import local_tensor

_CHUNK = 1 << 22
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = local_tensor(t.detach())
    if t.is_complex():
        t = torch.view_as_real(t)
    t = t.contiguous().reshape(-1)
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    return t.view(_INT_OF_SIZE[t.element_size()])


@torch.no_grad()
def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """int64[2] on the tensor's device."""
    bits = _bits(t)
    out = torch.zeros(2, dtype=torch.int64, device=bits.device)
    for start in range(0, bits.numel(), _CHUNK):
        chunk = bits[start : start + _CHUNK].to(torch.int64)
        pos = torch.arange(start, start + chunk.numel(), device=bits.device, dtype=torch.int64)
        weight = (pos * 2654435761 + 40503) & 0x7FFFFFFF
        out[0] += chunk.sum()
        out[1] += (chunk * weight).sum()
    return out


def fingerprints(ts: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """Fingerprints of many tensors with one host copy per device."""
    if not ts:
        return []
    per = [fingerprint(t) for t in ts]
    dev = per[0].device
    host = torch.stack([p.to(dev) for p in per]).cpu().tolist()
    return [(int(a), int(b)) for a, b in host]
