"""FSDP1 with `use_orig_params=True`: which part of each original parameter this rank holds.

FSDP1 (`FullyShardedDataParallel`) concatenates the parameters of each wrapped module into one flat
parameter and gives every rank one contiguous slice of it (FULL_SHARD, SHARD_GRAD_OP). With
`use_orig_params=True` the module keeps its own parameters (the same objects, under the names the user
wrote), but outside forward and backward each one is a 1-D view of the elements of it this rank holds,
possibly none, and so is its gradient. FSDP records the layout in the flat parameter's
`_shard_param_infos`: for each original, whether this rank holds any of it and which elements of its
flattened form (`intra_param_start_idx` .. `intra_param_end_idx`). Each element lives on exactly one
rank, so sums of squares, counts and histogram buckets add up over ranks exactly as under FSDP2
(`gradlog.measure.distributed`); only the global shape and numel must come from here, since the
parameter's own are this rank's slice.

Per-slice evidence (rows, columns, elements: dead_frac, partly updated, stopped slices) is taken on
`FlatShard.rows`: the whole rows a rank's slice touches, zero-padded where the slice starts or ends inside
a row, placed at their global rows and combined over ranks with a MAX as FSDP2's shards are
(`gradlog.measure.distributed.global_slices`, `global_rows`).

Duck-typed on FSDP's private attributes (`_handle.flat_param._params`, `_shard_param_infos`, `_shapes`;
tested on torch 2.13): a torch without them is refused by `gradlog.measure.engines`, never measured wrongly.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

#: FSDP1's sharding strategies whose ranks each hold a disjoint slice of every flat parameter
#: set by FSDP1 on every tensor it flattens or views (torch/distributed/fsdp/_common_utils.py, FSDP_FLATTENED)
FSDP1_MARK = "_fsdp_flattened"
SHARDED = ("FULL_SHARD", "SHARD_GRAD_OP")
#: ... and the one where every rank holds all of it (gradients all-reduced, as under DDP)
REPLICATED = ("NO_SHARD",)


@dataclass(frozen=True)
class FlatShard:
    """One original parameter's layout: its global `shape`, and the elements of its flattened form this rank
    holds (`start`, `numel`; numel 0 where it holds none)."""

    shape: tuple[int, ...]
    start: int
    numel: int

    @property
    def global_numel(self) -> int:
        return math.prod(self.shape)

    @property
    def _width(self) -> int:
        """Elements per row (dim 0) of the original; 1 for a 1-D one, whose slices are its elements."""
        return math.prod(self.shape[1:]) if len(self.shape) > 1 else 1

    @property
    def first_row(self) -> int:
        """The first row (element of a 1-D original) this rank holds any of."""
        return self.start // self._width if self._width else 0

    @property
    def view_shape(self) -> tuple[int, ...]:
        """The shape of `rows`: the rows this rank holds any of, whole."""
        w = self._width
        lead = self.start - self.first_row * w
        n = -(-(lead + self.numel) // w) if self.numel and w else 0
        return (n, *self.shape[1:]) if self.shape else ()

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's 1-D part `t` (values, gradient or optimizer state) as the whole rows it touches, zero
        where a row's elements live on another rank (a zero is no evidence of anything: each per-slice vector
        is combined over ranks with a MAX, so the rank holding those elements answers for them). A view
        when the slice starts and ends at row boundaries, else a zero-padded copy of its size."""
        shape = self.view_shape
        if len(self.shape) <= 1 or t.dim() != 1:
            return t
        t = t.detach()
        lead = self.start - self.first_row * self._width
        if lead == 0 and t.numel() == math.prod(shape):
            return t.view(shape)
        out = t.new_zeros(math.prod(shape))
        out[lead : lead + t.numel()] = t
        return out.view(shape)

    def span(self, axis: int) -> tuple[int, int]:
        """(the original's size along `axis`, where `rows`'s first index along it lies)."""
        return int(self.shape[axis]), self.first_row if axis == 0 else 0


#: id(parameter) -> (weak reference to it, its layout); see `flat_shard`
_SHARDS: dict[int, tuple[Any, FlatShard]] = {}


def is_fsdp1(m: object) -> bool:
    """An FSDP1 `FullyShardedDataParallel` instance (by class, without importing FSDP)."""
    return any(
        cls.__name__ == "FullyShardedDataParallel"
        and (getattr(cls, "__module__", "") or "").startswith("torch.distributed.fsdp")
        for cls in type(m).__mro__
    )


def fsdp1_modules(model: nn.Module) -> Iterator[nn.Module]:
    """Every FSDP1 wrapper in `model`'s tree (the model itself included)."""
    return (m for m in model.modules() if is_fsdp1(m))


def strategy(m: nn.Module) -> str:
    """The FSDP1 wrapper's sharding strategy by name ("FULL_SHARD", "HYBRID_SHARD", ...)."""
    s = getattr(m, "sharding_strategy", None)
    return str(getattr(s, "name", s))


def handle_params(m: nn.Module) -> Iterator[tuple[torch.Tensor, Any, Any]]:
    """(original parameter, its shard info, its global shape) of the flat parameter `m` manages itself."""
    handle = getattr(m, "_handle", None)
    flat = getattr(handle, "flat_param", None)
    if flat is None:  # a wrapper with no parameters of its own
        return
    params, infos, shapes = flat._params, flat._shard_param_infos, flat._shapes
    if params is None:  # not use_orig_params: refused by `gradlog.measure.engines`
        return
    yield from zip(params, infos, shapes)


def register(model: nn.Module) -> set[int]:
    """Record the layout of every parameter an FSDP1 wrapper with `use_orig_params=True` in `model` shards
    (FULL_SHARD, SHARD_GRAD_OP); returns the ids of all parameters such wrappers manage (NO_SHARD's too:
    whole on every rank, measured as under DDP). Cheap, and idempotent: called on every table scan."""
    managed: set[int] = set()
    for m in fsdp1_modules(model):
        if not getattr(m, "_use_orig_params", False):
            continue
        sharded = strategy(m) in SHARDED
        for p, info, shape in handle_params(m):
            managed.add(id(p))
            if not sharded:
                continue
            start = int(info.intra_param_start_idx) if info.in_shard else 0
            numel = int(info.numel_in_shard) if info.in_shard else 0
            _SHARDS[id(p)] = (weakref.ref(p), FlatShard(tuple(int(d) for d in shape), start, numel))
    for pid in [k for k, (ref, _) in _SHARDS.items() if ref() is None]:  # freed since: their ids may be reused
        del _SHARDS[pid]
    return managed


def register_shard(p: torch.Tensor, shard: FlatShard) -> None:
    """Record that `p`, while gradlog reads it, is this rank's 1-D part `shard` of a tensor partitioned by
    another engine (DeepSpeed ZeRO-3, `gradlog.measure.zero`): measured and combined as an FSDP1 slice."""
    _SHARDS[id(p)] = (weakref.ref(p), shard)


def flat_shard(p: torch.Tensor) -> FlatShard | None:
    """`p`'s layout when it is this rank's slice of an FSDP1-sharded parameter, else None."""
    got = _SHARDS.get(id(p))
    if got is None or got[0]() is not p:
        return None
    return got[1]


def slice_view(t: torch.Tensor, of: torch.Tensor) -> torch.Tensor:
    """`t` (the value, gradient or optimizer state of parameter `of`) laid out as whole slices of the tensor:
    an FSDP1 slice's rows (`FlatShard.rows`), anything else as it is."""
    s = flat_shard(of) if _SHARDS else None
    return t if s is None else s.rows(t)


def is_flat_shard(p: torch.Tensor) -> bool:
    return flat_shard(p) is not None


def global_numel(p: torch.Tensor) -> int:
    """The whole tensor's numel: an FSDP1 slice's original's, else the tensor's own (a DTensor's is global)."""
    s = flat_shard(p) if _SHARDS else None
    return s.global_numel if s is not None else p.numel()
