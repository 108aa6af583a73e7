"""Which optimizers shrink the weights by lr x weight_decay each step, and a param group's weight_decay under them.

torch's AdamW (and Adam with `decoupled_weight_decay=True`) multiplies each weight by (1 - lr x weight_decay)
before its Adam step; SGD adds weight_decay x w to the gradient, so its step takes lr x weight_decay x w off
each weight (before momentum). Under both, lr x weight_decay is the share of the weights one step removes:
at 1 a step leaves only its own update. Adam's L2 decay (`weight_decay` without decoupling) goes through
Adam's normalisation, which bounds every element's step by about lr whatever the decay: the product says
nothing there, and neither does any optimizer gradlog does not know (None: nothing is claimed).
"""

from __future__ import annotations

from typing import Any

import torch

#: wrappers that hold the optimizer they step (accelerate's `AcceleratedOptimizer`, Lightning's
#: `LightningOptimizer`) and share its param groups: followed to the optimizer whose rule is known
_INNER = ("optimizer", "_optimizer")


def inner_optimizer(optimizer: Any) -> Any:
    """The optimizer `optimizer` wraps, at any depth (itself where it wraps none)."""
    for _ in range(4):
        inners = (getattr(optimizer, a, None) for a in _INNER)
        inner = next((o for o in inners if o is not None and o is not optimizer and hasattr(o, "param_groups")), None)
        if inner is None:
            break
        optimizer = inner
    return optimizer


def decay_of(optimizer: Any, group: dict[str, Any]) -> float | None:
    """`group`'s weight_decay where `optimizer` shrinks the weights by lr x weight_decay each step (AdamW,
    decoupled Adam, SGD and their subclasses); None under any other rule, or without a number there."""
    opt = inner_optimizer(optimizer)
    if isinstance(opt, torch.optim.AdamW):
        decoupled = True
    elif isinstance(opt, torch.optim.Adam):
        decoupled = bool(group.get("decoupled_weight_decay", False))
    else:
        decoupled = isinstance(opt, torch.optim.SGD)
    wd = group.get("weight_decay")
    if not decoupled or isinstance(wd, bool) or not isinstance(wd, (int, float)):
        return None
    return float(wd)
