"""The modules that hold the tracked tensors, as the diagnosis needs them: plain data, no module, no tensor.

What a slice is called comes from its owning module (an embedding's rows, a linear layer's units, a
convolution's filters, a fused expert tensor's experts), an embedding's `padding_idx` row is never
updated by design, and per-expert modules are counted by their container's length. The logger holds the
model weakly, and a model garbage-collected while its logger is open (a notebook cell re-run, `del model`)
closes the logger when the modules are already gone: the diagnosis then reads the description kept from
the last time the model was there. So it is built from the model when the parameter table changes
(`ParamTable.rescan`: construction, tensors added or replaced, never on an unchanged measured step) and
again at each diagnosis while the model lives, and it holds strings and numbers only, so that keeping it
never keeps a dropped model alive.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["Owner", "Owners", "describe", "family"]


@dataclass(frozen=True)
class Owner:
    """The module holding one tracked tensor (a shared tensor's first holder, in `model.modules()` order)."""

    #: "embedding", "linear", "conv1d_t" (transformers' Conv1D, weights (in, out)), "conv", or "" for any other
    family: str
    attr: str  # the tensor's attribute on the module: "weight", "bias", ...
    padding_idx: int | None = None  # an embedding's, as the module has it
    expert_class: bool = False  # the module's class name says "expert" (transformers' MixtralExperts)
    #: `torch.nn.utils.prune`'s parameter `<name>_orig` beside its buffer `<name>_mask`: the slices the mask
    #: zeroes whole, per slice kind (0 rows, 1 columns, None elements), as the module had them when described
    pruned: tuple[tuple[int | None, tuple[int, ...]], ...] = ()


@dataclass(frozen=True)
class Owners:
    """Every tracked tensor's owner, by the tensor's row (`Tracked.index`), and the model's expert containers."""

    rows: Mapping[int, Owner] = field(default_factory=dict)
    #: module path -> length, for each `nn.ModuleList` / `nn.ModuleDict` whose last path part names experts
    expert_containers: Mapping[str, int] = field(default_factory=dict)

    def get(self, index: int) -> Owner | None:
        """The owner of row `index` (None: a tensor the model does not hold, only the optimizer)."""
        return self.rows.get(index)


def family(module: nn.Module) -> str:
    """The kind of layer `module` is, as far as the names of its slices go (see `Owner.family`)."""
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        return "embedding"
    if isinstance(module, nn.Linear):
        return "linear"
    if type(module).__name__ == "Conv1D":  # transformers' Conv1D (GPT-2): a linear layer stored (in, out)
        return "conv1d_t"
    if isinstance(module, nn.modules.conv._ConvNd):
        return "conv"
    return ""


def describe(model: nn.Module, rows_by_id: Mapping[int, int]) -> Owners:
    """The owners of `model`'s tensors, for those `rows_by_id` tracks (tensor identity -> row index): one
    walk over the modules, under 1 us per tensor (owners alike are one object)."""
    owners: dict[int, Owner] = {}
    containers: dict[str, int] = {}
    alike: dict[tuple[type, str, object], Owner] = {}
    for path, module in model.named_modules():
        for attr, p in module._parameters.items():
            index = rows_by_id.get(id(p)) if p is not None else None
            if index is None or index in owners:  # not tracked, or a shared tensor's later holder
                continue
            kind = family(module)
            mask = getattr(module, attr[: -len("_orig")] + "_mask", None) if attr.endswith("_orig") else None
            if isinstance(mask, torch.Tensor) and tuple(mask.shape) == tuple(p.shape):  # torch.nn.utils.prune
                owners[index] = Owner(kind, attr, None, False, _masked_slices(mask))
                continue
            pad = module.padding_idx if kind == "embedding" else None  # only an embedding's matters
            key = (type(module), attr, pad)
            if key not in alike:
                expert = "expert" in type(module).__name__.lower()
                alike[key] = Owner(kind, attr, pad if isinstance(pad, int) else None, expert)
            owners[index] = alike[key]
        if "expert" in path.rsplit(".", 1)[-1].lower() and isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            containers[path] = len(module)
    return Owners(owners, containers)


def _masked_slices(mask: torch.Tensor) -> tuple[tuple[int | None, tuple[int, ...]], ...]:
    """The rows and columns (2+ dims) or elements (1-D) that a pruning mask zeroes entirely."""
    zero = (mask == 0).detach().cpu()
    if zero.dim() == 0:
        return ()
    if zero.dim() == 1:
        return ((None, tuple(zero.nonzero().flatten().tolist())),)
    z = zero.reshape(zero.shape[0], zero.shape[1], -1).all(dim=2)
    rows, cols = z.all(dim=1).nonzero().flatten().tolist(), z.all(dim=0).nonzero().flatten().tolist()
    return ((0, tuple(rows)), (1, tuple(cols)))
