"""Global statistics for sharded parameters (FSDP2 `fully_shard`, tensor parallel DTensors, and FSDP1 with
`use_orig_params=True`, whose 1-D slices `gradlog.measure.flat_shards` describes).

Each rank holds a shard of every DTensor parameter and gradient. A norm, a count or a histogram of
a shard is not the tensor's: the per-rank partials must be combined. One measured step costs:

- in the optimizer's step pre-hook, ONE ``all_reduce(MAX)`` of a small header (the step index, to
  catch ranks that disagree about which step is measured, and which tensors have a gradient on any
  rank, for the weight snapshot's choice) together with the gradients' histogram ranges (max, and
  -min so that MIN rides along in the MAX);
- in the post-hook, on histogram steps only, ONE ``all_reduce(MAX)`` of the weight/update ranges
  (the weights after the step do not exist before it);
- ONE ``all_reduce(SUM)`` of every sum of squares, count and histogram bucket of the step.

Collectives run only inside the optimizer's step hooks (or inside ``log()`` without an optimizer)
and at ``close()``, which every rank reaches at the same point of its program. DDP needs none of
this (its gradients are already averaged at the optimizer step) and gets no collective at all.

A replicated copy must count once: a rank contributes a tensor's sums only when it is the first
rank along every mesh dimension the tensor is replicated on (plain tensors: rank 0). An FSDP1 slice is
every rank's own (each element lives on one rank).
"""

from __future__ import annotations

import datetime
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from gradlog.measure.flat_shards import flat_shard, is_flat_shard
from gradlog.measure.once import warn
from gradlog.measure.params import Tracked, local_tensor
from gradlog.measure.stats import Key, Part

log = logging.getLogger("gradlog")

#: Seconds a gloo collective of gradlog may wait for the other ranks before it raises.
DEFAULT_TIMEOUT_S = 300.0

_RULE = (
    "every rank must run the same optimizer steps, create its GradLogger at the same step with the same "
    "settings, call log() on the same steps (log() measures when there is no optimizer), and call close() "
    "(or report()) on every rank"
)


class DistributedMismatchError(RuntimeError):
    """Ranks disagree about what is being measured; going on would hang or mix up collectives."""


def is_dtensor(t: object) -> bool:
    """Duck-typed so that torch builds without DTensor still import gradlog."""
    return hasattr(t, "placements") and hasattr(t, "device_mesh") and hasattr(t, "to_local")


def is_sharded(t: torch.Tensor) -> bool:
    """Each rank holds only part of `t`: a DTensor, or an FSDP1 slice (`gradlog.measure.flat_shards`)."""
    return is_dtensor(t) or is_flat_shard(t)


def _dist_ready() -> bool:
    dist = torch.distributed
    return bool(dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


def is_rank_zero() -> bool:
    """Rank 0 of an initialised process group, or a single process: the one that writes."""
    return not _dist_ready() or torch.distributed.get_rank() == 0


def _owner(t: torch.Tensor, rank: int) -> bool:
    """Whether this rank's local part of `t` is counted in a SUM over all ranks."""
    if not is_dtensor(t):  # a plain tensor is the same on every rank (DDP-style replication); an FSDP1 slice is not
        return is_flat_shard(t) or rank == 0
    coord = t.device_mesh.get_coordinate()  # type: ignore[attr-defined]
    if coord is None:  # this rank is outside the tensor's mesh and holds nothing of it
        return False
    for c, placement in zip(coord, t.placements):  # type: ignore[attr-defined]
        if placement.is_partial():
            raise NotImplementedError(
                "gradlog: a gradient with a Partial placement holds unreduced values; measure after the "
                "gradient reduction (redistribute it to Shard or Replicate)"
            )
        if placement.is_replicate() and c != 0:
            return False
    return True


@dataclass
class DistStep:
    """One measured step's pending SUM reduction: named tensors whose first dim is a row subset."""

    reducer: Reducer
    index: int
    owner: torch.Tensor  # [n] 1.0 where this rank's part counts, per row of the step
    device: torch.device
    #: per row, whether this rank's part has a gradient (`Reducer.open`), made global (any rank has one) by the
    #: pre-hook's `exchange_header`, before the snapshot is picked (`Meter._pick`)
    has_grad: list[bool] = field(default_factory=list)
    parts: list[tuple[Key, torch.Tensor, torch.Tensor | None, tuple[int, ...]]] = field(default_factory=list)

    def add(self, key: Key, t: torch.Tensor, rows: Sequence[int] | None = None, keep: tuple[int, ...] = ()) -> None:
        """Queue `t` for the SUM, counted once per tensor (see `_owner`). `rows`: the step rows its first
        dim covers (all if None). `keep`: columns equal on every rank (a global range), not summed."""
        self.parts.append((key, t, self._mask(t, rows), keep))

    def add_flag(self, key: Part, t: torch.Tensor) -> None:
        """Queue a per-rank count that every rank contributes (has a gradient, skipped the step)."""
        self.parts.append((key, t, None, ()))

    def _mask(self, t: torch.Tensor, rows: Sequence[int] | None) -> torch.Tensor:
        owner = self.owner if rows is None else self.owner[torch.tensor(list(rows), dtype=torch.long)]
        return owner.to(t.device, t.dtype).reshape(-1, *([1] * (t.dim() - 1)))

    def reduce(self) -> dict[Key, torch.Tensor]:
        """The step's one all_reduce(SUM); returns the global tensors under the same keys."""
        flats = []
        for _, t, mask, _ in self.parts:
            flats.append((t * mask if mask is not None else t).reshape(-1).to(self.device, torch.float64))
        if not flats:
            return {}
        flat = torch.cat(flats)
        self.reducer.all_reduce(flat, "sum", self.index)
        out: dict[Key, torch.Tensor] = {}
        at = 0
        for key, t, _, keep in self.parts:
            n = t.numel()
            g = flat[at : at + n].reshape(t.shape).to(t.dtype)
            at += n
            if keep:
                cols = list(keep)
                g[..., cols] = t[..., cols]
            out[key] = g
        return out


class Reducer:
    """Makes every statistic of a sharded model global; inactive (no collective) otherwise.

    `layout` is the configuration every rank must share (measure interval, histogram settings);
    it is compared across ranks once per table size, before anything whose size depends on it.
    """

    def __init__(self, layout: Mapping[str, float], timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.layout = {k: float(v) for k, v in layout.items()}
        self.timeout_s = timeout_s
        self._checked_rows: int | None = None
        #: Which call of the program this measurement belongs to, compared across ranks in the header: the
        #: step given to log() (without an optimizer, a rank that skipped a log() call pairs a later step).
        self.call: float | None = None
        self.used = False  # a collective ran at least once: a local report at close would be wrong

    # --- when --------------------------------------------------------------------------------
    def active(self, rows: Sequence[Tracked]) -> bool:
        """Sharded parameters and an initialised process group with more than one rank."""
        return _dist_ready() and any(is_sharded(r.param) for r in rows)

    def open(self, index: int, rows: Sequence[Tracked], device: torch.device, tracked: int | None = None) -> DistStep:
        """`tracked`: every watched tensor, frozen ones too (not measured, but compared at close)."""
        self._check_layout(len(rows) if tracked is None else tracked, device)
        rank = torch.distributed.get_rank()
        owner = torch.tensor([1.0 if _owner(r.param, rank) else 0.0 for r in rows], dtype=torch.float64)
        for r in rows:
            g = r.param.grad
            if g is not None and is_dtensor(g):
                _owner(g, rank)  # raises on Partial gradients
        return DistStep(self, index, owner, device, has_grad=[r.param.grad is not None for r in rows])

    # --- collectives ---------------------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor, op: str, index: int, group: Any = None) -> None:
        """In place, over `group`; raises DistributedMismatchError instead of hanging when a gloo peer never
        joins. `group` None: every rank, for the model's shards (`used`); a group: an engine's gradients made
        whole (DeepSpeed ZeRO-1/2's data-parallel group, gradlog.measure.zero), after which nothing is local."""
        dist = torch.distributed
        self.used = self.used or group is None
        rop = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
        backend = dist.get_backend()
        if backend == "nccl" and t.device.type == "cpu":  # CPU-offloaded parameters under NCCL
            on_gpu = t.cuda()
            dist.all_reduce(on_gpu, op=rop, group=group)
            t.copy_(on_gpu)
            return
        if backend != "gloo":  # NCCL and friends: their own watchdog times out
            dist.all_reduce(t, op=rop, group=group)
            return
        work = dist.all_reduce(t, op=rop, group=group, async_op=True)
        try:
            work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            raise DistributedMismatchError(
                f"gradlog: rank {dist.get_rank()} waited {self.timeout_s:.0f}s in its all_reduce({op.upper()}) "
                f"for measured step {index} and the other ranks never joined ({exc}); {_RULE}"
            ) from exc

    def _check_layout(self, n: int, device: torch.device) -> None:
        if self._checked_rows == n:
            return
        mine = [float(n), *self.layout.values()]
        t = torch.tensor(mine + [-v for v in mine], dtype=torch.float64, device=device)
        self.all_reduce(t, "max", -1)
        hi, lo = t[: len(mine)].tolist(), [-v for v in t[len(mine) :].tolist()]
        if hi != lo:
            names = ["tracked tensors", *self.layout]
            diff = [f"{k} {a:g}..{b:g}" for k, a, b in zip(names, lo, hi) if a != b]
            raise DistributedMismatchError(f"gradlog: ranks disagree ({', '.join(diff)} across ranks); {_RULE}")
        self._checked_rows = n

    def exchange_header(
        self, step: DistStep, histograms: bool, grad_ranges: torch.Tensor | None
    ) -> torch.Tensor | None:
        """The pre-hook's one all_reduce(MAX): the step index (checked equal on every rank), each row's "has a
        gradient" flag (`step.has_grad` becomes True where any rank's part has one: what `Meter._pick` needs to
        copy no tensor without a gradient, the same on every rank) and, when gradient histograms are configured,
        their [n, 2] (min, max) ranges, made global in place.

        The flags and ranges travel on every measured step (neutral values when no histogram is due) so that
        the message size depends only on the checked layout, never on the step index.
        """
        call = float(step.index) if self.call is None else self.call
        head = [float(step.index), -float(step.index), float(histograms), -float(histograms), call, -call]
        flags = torch.tensor(step.has_grad, dtype=torch.float64, device=step.device)
        parts = [torch.tensor(head, dtype=torch.float64, device=step.device), flags]
        if grad_ranges is not None:
            parts += [
                grad_ranges[:, 1].to(step.device, torch.float64),
                -grad_ranges[:, 0].to(step.device, torch.float64),
            ]
        t = torch.cat(parts)
        self.all_reduce(t, "max", step.index)
        n = len(step.has_grad)
        got = t[: 6 + n].tolist()  # a host read of the header and flags, on gloo already on the host
        step.has_grad = [v > 0 for v in got[6:]]
        if got[0] != -got[1] or got[2] != -got[3]:
            raise DistributedMismatchError(
                f"gradlog: ranks measure different optimizer steps (step index {-got[1]:g} to {got[0]:g} across "
                f"ranks); {_RULE}"
            )
        if got[4] != -got[5]:
            raise DistributedMismatchError(
                f"gradlog: ranks measure in log() calls for different steps ({-got[5]:g} to {got[4]:g} across "
                f"ranks): a rank skipped or added a log() call; {_RULE}"
            )
        if grad_ranges is None:
            return None
        at, k = 6 + n, grad_ranges.shape[0]
        return torch.stack([-t[at + k : at + 2 * k], t[at : at + k]], dim=1)

    def global_ranges(self, step: DistStep, ranges: torch.Tensor) -> torch.Tensor:
        """The post-hook's all_reduce(MAX) of [n, 2] (min, max) ranges; histogram steps only."""
        t = torch.cat([ranges[:, 1], -ranges[:, 0]]).to(step.device, torch.float64)
        self.all_reduce(t, "max", step.index)
        n = ranges.shape[0]
        return torch.stack([-t[n:], t[:n]], dim=1)

    def changed(self, rows: Sequence[Tracked], changed: dict[int, bool]) -> dict[int, bool]:
        """At close: a tensor changed if any of its shards did. One all_reduce(MAX)."""
        device = local_tensor(rows[0].param).device if rows else torch.device("cpu")
        self._check_layout(len(rows), device)
        flags = [(-1.0 if changed.get(r.index) is None else float(changed[r.index])) for r in rows]
        t = torch.tensor(flags, dtype=torch.float64, device=device)
        self.all_reduce(t, "max", -1)
        return {r.index: bool(v > 0) for r, v in zip(rows, t.tolist()) if v >= 0}

    def global_slices(
        self, items: Sequence[tuple[Tracked, int | None, torch.Tensor | None]], values: bool = False
    ) -> list[torch.Tensor | None]:
        """At close: per-slice bool vectors of sharded tensors, from local to global. One all_reduce(MAX).

        Each item is (tensor, dim, this rank's vector along `dim` or None); dim None means the
        elements of a 1-D tensor. Every rank passes the same items in the same order (sizes come from
        the global shapes); the result is the global vector, True where any rank had True, or None
        where no rank had one.
        """
        device = torch.device("cpu")
        for row, _, _ in items:
            device = local_tensor(row.param).device
            break
        spans: list[tuple[int, int, int]] = []  # global length, local offset, local length
        size = 0
        for row, dim, vec in items:
            axis = 0 if dim is None else dim
            shape, offset = _local_span(row.param, axis)
            spans.append((shape, offset, 0 if vec is None else vec.numel()))
            size += shape + 1
        flat = torch.zeros(size, dtype=torch.float64)
        at = 0
        for (length, offset, n), (_, _, vec) in zip(spans, items):
            if vec is not None:
                if n:
                    flat[at + offset : at + offset + n] = vec.to(torch.float64)
                flat[at + length] = 1.0  # this rank has a vector for this item
            at += length + 1
        t = flat.to(device)
        self.all_reduce(t, "max", -1)
        host = t.cpu()
        out: list[torch.Tensor | None] = []
        at = 0
        for length, _, _ in spans:
            part = host[at : at + length]
            out.append((part if values else part > 0) if host[at + length] > 0 else None)
            at += length + 1
        return out

    def warn_local(self) -> None:
        """The process group is gone but shards were measured: what is left is rank-local."""
        msg = (
            "gradlog: the process group was destroyed before close(), so the never-updated report can only "
            "see this rank's shards; call gl.close() before torch.distributed.destroy_process_group()"
        )
        warn(msg, stacklevel=3)


def _local_span(t: torch.Tensor, axis: int) -> tuple[int, int]:
    """(global size along `axis`, this rank's offset along it) of a DTensor or an FSDP1 slice's rows (`FlatShard.rows`);
    a plain tensor is whole."""
    shard = flat_shard(t)
    if shard is not None:
        return shard.span(axis)
    size = int(t.shape[axis])
    if not is_dtensor(t):
        return size, 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)  # type: ignore[attr-defined]
    return size, int(offset[axis]) if offset else 0


def global_rows(rows: Sequence[Tracked], local: Mapping[int, torch.Tensor], device: torch.device) -> torch.Tensor:
    """Every sharded tensor's per-row "gradient non-zero" flags at their global rows, concatenated (for
    a SUM over ranks: > 0 where any rank's part of the row is non-zero). Plain tensors take no room."""
    parts = []
    for i, row in enumerate(rows):
        if not is_sharded(row.param) or not row.shape:
            continue
        size, offset = _local_span(row.param, 0)
        v = torch.zeros(size, dtype=torch.float64, device=device)
        mine = local.get(i)
        if mine is not None and mine.numel():
            v[offset : offset + mine.numel()] = mine.to(device, torch.float64)
        parts.append(v)
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64, device=device)


def dead_fractions(
    rows: Sequence[Tracked], dead: torch.Tensor, summed: torch.Tensor, has_grad: Sequence[bool] | None = None
) -> torch.Tensor:
    """Host side: the sharded tensors' dead_frac recomputed from the globally summed row flags, also where this
    rank holds none of the tensor but another rank had its gradient (`has_grad`, global: FSDP1 often leaves rank 0
    an empty slice)."""
    out = dead.clone()
    at = 0
    for i, row in enumerate(rows):
        if not is_sharded(row.param) or not row.shape:
            continue
        n = int(row.shape[0])
        if not out[i].isnan() or (has_grad is not None and has_grad[i]):
            out[i] = float((summed[at : at + n] == 0).sum()) / max(1, n)
        at += n
    return out


def neutral_ranges(n: int, device: torch.device) -> torch.Tensor:
    """[n, 2] (+inf, -inf): contributes nothing to a MIN/MAX."""
    out = torch.empty(n, 2, dtype=torch.float64, device=device)
    out[:, 0] = math.inf
    out[:, 1] = -math.inf
    return out
