"""Which optimizer's step hooks fire: wrappers step an optimizer they hold, and only its hooks run.

accelerate's `AcceleratedOptimizer` subclasses `torch.optim.Optimizer` without running its
`__init__` (so it has no hook registry, and its `step` is not the hooked one), and steps the inner
optimizer only when gradients are synchronised; Lightning's `LightningOptimizer` is not an
Optimizer at all. Both keep the real optimizer in an attribute.

Sharpness-aware minimisation (SAM and its variants, ASAM, GSAM) is a full Optimizer that holds its
`base_optimizer` and shares its param groups (the same list); training loops call its `first_step`
(climb) and `second_step` (restore, then the base's step), never its own `step`, so only the base's
hooks fire on every update.
"""

from __future__ import annotations

from typing import Any

import torch

_HOLDERS = ("optimizer", "_optimizer")
#: where a full Optimizer keeps the one that does its steps (SAM's convention)
_DELEGATE = "base_optimizer"


def _hookable(opt: object) -> bool:
    """An Optimizer whose own `__init__` ran: it has the hook registry and a hooked `step`."""
    return isinstance(opt, torch.optim.Optimizer) and "_optimizer_step_pre_hooks" in vars(opt)


def _delegate(opt: torch.optim.Optimizer) -> torch.optim.Optimizer | None:
    """The `base_optimizer` a full Optimizer steps through, sharing its param groups (SAM), else None."""
    base = vars(opt).get(_DELEGATE)
    if isinstance(base, torch.optim.Optimizer) and _hookable(base) and base.param_groups is opt.param_groups:
        return base
    return None


def steppable(optimizer: Any) -> torch.optim.Optimizer:
    """The optimizer whose step hooks fire when `optimizer` steps: itself, or the one a wrapper holds.

    A wrapper that is a full Optimizer in its own right (lookahead-style, with its own hooks) is
    kept: its step is the whole update; unless it only delegates to the `base_optimizer` whose param
    groups it shares (SAM: its own `step` is rarely called, the base's on every update). Raises
    TypeError naming the object when there is none.
    """
    seen: set[int] = set()
    current = optimizer
    while id(current) not in seen:
        seen.add(id(current))
        if _hookable(current):
            base = _delegate(current)
            if base is None:
                return current  # type: ignore[no-any-return]
            current = base
            continue
        inner = next(
            (vars(current)[a] for a in _HOLDERS if a in getattr(current, "__dict__", {})),
            None,
        )
        if inner is None:
            break
        current = inner
    raise TypeError(
        f"optimizer must be a torch.optim.Optimizer (or a wrapper holding one, such as accelerate's or "
        f"Lightning's), got {type(optimizer).__name__}; with several optimizers, create one GradLogger per optimizer"
    )
