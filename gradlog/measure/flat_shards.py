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

Rows, columns and elements (per-slice evidence) are not mapped back: a rank's slice cuts rows at
arbitrary points. Those tensors are measured per tensor only (`is_flat_shard`), which `register` says
once per process (rank 0): no partly-updated or stopped-slice finding, no dead_frac for them.

Duck-typed on FSDP's private attributes (checked against torch 2.4-2.13): a torch that renames them is
refused by `gradlog.measure.engines`, never measured wrongly.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gradlog.measure.once import warn

#: FSDP1's sharding strategies whose ranks each hold a disjoint slice of every flat parameter
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


#: id(parameter) -> (weak reference to it, its layout); see `flat_shard`
_SHARDS: dict[int, tuple[Any, FlatShard]] = {}
_NOTED: list[bool] = []  # the per-tensor-only note was given (once per process)

NOTE = (
    "gradlog: FSDP1 (use_orig_params=True) gives each rank a 1-D slice of {n} tensors; their per-tensor numbers and "
    "the never-updated / stalled tables are global, but rows, columns and elements are not measured for them (no "
    "partly-updated or stopped-slice findings, no dead_frac): shard with FSDP2 (`fully_shard`) for those"
)


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
    if _SHARDS and not _NOTED:
        _NOTED.append(True)
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
            warn(NOTE.format(n=len(_SHARDS)), stacklevel=4)
    return managed


def flat_shard(p: torch.Tensor) -> FlatShard | None:
    """`p`'s layout when it is this rank's slice of an FSDP1-sharded parameter, else None."""
    got = _SHARDS.get(id(p))
    if got is None or got[0]() is not p:
        return None
    return got[1]


def is_flat_shard(p: torch.Tensor) -> bool:
    return flat_shard(p) is not None


def global_numel(p: torch.Tensor) -> int:
    """The whole tensor's numel: an FSDP1 slice's original's, else the tensor's own (a DTensor's is global)."""
    s = flat_shard(p) if _SHARDS else None
    return s.global_numel if s is not None else p.numel()
