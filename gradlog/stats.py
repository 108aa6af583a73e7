"""Per-tensor statistics computed on the tensors' own device, batched, with no host sync.

Everything here returns device tensors; the caller stacks them and copies to the host once.
Statistics are kept as *partials* (sums of squares, counts, min/max) so that a distributed
reducer can combine shards before the final norms and ratios are taken.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from gradlog.params import local_tensor

#: Columns of `norm_partials`.
SUMSQ, NONZERO, NONFINITE = 0, 1, 2


def stat_dtype(device: torch.device) -> torch.dtype:
    """float64 keeps counts exact past 2**24 elements; MPS has no float64."""
    return torch.float32 if device.type == "mps" else torch.float64


def dense_values(t: torch.Tensor) -> torch.Tensor:
    """The stored values of `t` on this rank: sparse gradients keep only their explicit entries.

    Implicit zeros of a sparse tensor are zeros, so counts still divide by the full numel.
    """
    t = local_tensor(t.detach())
    if t.layout != torch.strided:
        t = t.coalesce().values() if t.is_sparse else t.to_dense()
    return t


def _real(t: torch.Tensor) -> torch.Tensor:
    """Histograms and min/max need an order: complex tensors are described by their magnitude."""
    if t.is_complex():
        return t.abs()
    if not t.is_floating_point():
        return t.double()
    return t


def _groups(xs: Sequence[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[int]]:
    out: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, x in enumerate(xs):
        out.setdefault((x.device, x.dtype), []).append(i)
    return out


def norm_partials(xs: Sequence[torch.Tensor], device: torch.device, counts: bool = True) -> torch.Tensor:
    """[n, 3]: sum of squares, count of non-zero entries (NaN/Inf included), count of NaN/Inf entries.

    With `counts=False` only the sum of squares is computed (the count columns stay 0).

    Three fused `_foreach_norm` calls per (device, dtype) group; the NaN/Inf count is the
    number of non-zeros of `x * 0`, which is NaN exactly where x is not finite.
    """
    dt = stat_dtype(device)
    out = torch.zeros(len(xs), 3, dtype=dt, device=device)
    for (_, dtype), idx in _groups(xs).items():
        group = [xs[i] for i in idx]
        if dtype.is_floating_point or dtype.is_complex:
            norm_dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else None
            l2 = torch._foreach_norm(group, 2, dtype=norm_dtype) if norm_dtype else torch._foreach_norm(group, 2)
            zeros = [torch.zeros((), device=g.device) for g in group]
            nz = torch._foreach_norm(group, 0) if counts else zeros
            nf = torch._foreach_norm(torch._foreach_mul(group, 0), 0) if counts else zeros
        else:  # integer "parameters" cannot be NaN
            l2 = tuple(g.double().norm() for g in group)
            nz = tuple(torch.count_nonzero(g) for g in group)
            nf = tuple(torch.zeros((), device=g.device) for g in group)
        cols = [torch.stack([v.to(device, dt) for v in vals]) for vals in (l2, nz, nf)]
        cols[0] = cols[0] * cols[0]
        out[torch.tensor(idx, device=device)] = torch.stack(cols, dim=1)
    return out


def histogram_partials(xs: Sequence[torch.Tensor], bins: int, device: torch.device) -> torch.Tensor:
    """[n, bins + 5]: bucket counts of the finite values, then min, max, sum, sum of squares, NaN/Inf count.

    Buckets are fixed-width between each tensor's own finite min and max, computed on the device
    without reading anything back: NaN/Inf are replaced by 0 for the range and the moments, then
    taken back out of the bucket that holds 0. A constant tensor puts everything in bucket 0.
    """
    dt = stat_dtype(device)
    rows = []
    for x in xs:
        x = _real(x).reshape(-1)
        if x.element_size() < 4:  # fp16/bf16: bucket and sum in fp32
            x = x.float()
        if x.numel() == 0:
            rows.append(torch.zeros(bins + 5, dtype=dt, device=device))
            continue
        z = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
        nonfinite = x.numel() - torch.isfinite(x).sum()
        lo, hi = torch.aminmax(z)
        width = hi.to(dt) - lo.to(dt)  # in fp32 a range like -3e38..3e38 overflows to inf, and inf * 0 is NaN
        scale = torch.where(width > 0, bins / torch.where(width > 0, width, 1), 0)
        pos = (z - lo).mul_(scale).nan_to_num_(nan=0.0).clamp_(0, bins - 1)
        counts = torch.bincount(pos.to(torch.int64), minlength=bins).to(dt)
        zero_bin = ((0 - lo) * scale).clamp(0, bins - 1).to(torch.int64).reshape(1)
        counts.index_add_(0, zero_bin, -nonfinite.to(dt).reshape(1))
        moments = torch.stack([lo, hi, z.sum(), torch.dot(z, z)]).to(dt)
        rows.append(torch.cat([counts, moments, nonfinite.to(dt).reshape(1)]).to(device))
    if not rows:
        return torch.zeros(0, bins + 5, dtype=dt, device=device)
    return torch.stack(rows)


class Packer:
    """Collects device tensors for one measured step and brings them to the host in ONE copy."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._parts: list[tuple[str, torch.Tensor]] = []

    def add(self, key: str, t: torch.Tensor) -> None:
        self._parts.append((key, t))

    def __bool__(self) -> bool:
        return bool(self._parts)

    def fetch(self) -> dict[str, torch.Tensor]:
        """The single device-to-host transfer of the step."""
        if not self._parts:
            return {}
        dt = stat_dtype(self.device)
        flat = torch.cat([t.detach().reshape(-1).to(self.device, dt) for _, t in self._parts])
        host = flat.cpu()
        out: dict[str, torch.Tensor] = {}
        at = 0
        for key, t in self._parts:
            n = t.numel()
            out[key] = host[at : at + n].reshape(t.shape)
            at += n
        self._parts = []
        return out


# --- two-phase histograms, for tensors sharded across ranks -------------------------------------
# A shard cannot pick its own bucket edges: every rank first reports its range (`histogram_ranges`),
# the ranges are reduced to the global one, then each rank buckets its shard with that range
# (`histogram_bucket`) and the bucket counts are summed. `histogram_partials` stays the one-pass
# single-process path.


def histogram_ranges(xs: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """[n, 2]: min and max of each tensor with NaN/Inf read as 0 (as `histogram_partials` does).

    An empty tensor (a rank's empty shard) gives (+inf, -inf), the neutral element of MIN/MAX.
    """
    dt = stat_dtype(device)
    out = torch.empty(len(xs), 2, dtype=dt, device=device)
    out[:, 0] = math.inf
    out[:, 1] = -math.inf
    for i, x in enumerate(xs):
        x = _real(x).reshape(-1)
        if x.numel() == 0:
            continue
        if x.element_size() < 4:
            x = x.float()
        lo, hi = torch.aminmax(torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0))
        out[i, 0] = lo.to(device, dt)
        out[i, 1] = hi.to(device, dt)
    return out


def histogram_bucket(xs: Sequence[torch.Tensor], bins: int, ranges: torch.Tensor, device: torch.device) -> torch.Tensor:
    """[n, bins + 5] like `histogram_partials`, but bucketed over the given (global) `ranges` [n, 2].

    Every column but min/max is a sum over shards; min/max are copied from `ranges`. A range with
    min > max (no element anywhere) is read as [0, 0].
    """
    dt = stat_dtype(device)
    out = torch.zeros(len(xs), bins + 5, dtype=dt, device=device)
    if not len(xs):
        return out
    ranges = ranges.to(device, dt)
    empty = ranges[:, 0] > ranges[:, 1]
    ranges = torch.where(empty.unsqueeze(1), torch.zeros_like(ranges), ranges)
    out[:, bins : bins + 2] = ranges
    for i, x in enumerate(xs):
        x = _real(x).reshape(-1)
        if x.numel() == 0:
            continue
        if x.element_size() < 4:
            x = x.float()
        z = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
        nonfinite = x.numel() - torch.isfinite(x).sum()
        lo = ranges[i, 0].to(z.dtype)  # the value each rank's own min would have had
        width = ranges[i, 1] - ranges[i, 0]
        scale = torch.where(width > 0, bins / torch.where(width > 0, width, 1), 0)
        pos = (z - lo).mul_(scale).nan_to_num_(nan=0.0).clamp_(0, bins - 1)
        counts = torch.bincount(pos.to(torch.int64), minlength=bins).to(dt)
        zero_bin = ((0 - lo) * scale).clamp(0, bins - 1).to(torch.int64).reshape(1)
        counts.index_add_(0, zero_bin, -nonfinite.to(dt).reshape(1))
        out[i, :bins] = counts
        out[i, bins + 2] = z.sum().to(dt)
        out[i, bins + 3] = torch.dot(z, z).to(dt)
        out[i, bins + 4] = nonfinite.to(dt)
    return out
