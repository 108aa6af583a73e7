"""Which optimizer's step hooks fire: wrappers step an optimizer they hold, and only its hooks run.

accelerate's `AcceleratedOptimizer` subclasses `torch.optim.Optimizer` without running its
`__init__` (so it has no hook registry, and its `step` is not the hooked one), and steps the inner
optimizer only when gradients are synchronised; Lightning's `LightningOptimizer` is not an
Optimizer at all. Both keep the real optimizer in an attribute.
"""

from __future__ import annotations

from typing import Any

import torch

_HOLDERS = ("optimizer", "_optimizer")


def _hookable(opt: object) -> bool:
    """An Optimizer whose own `__init__` ran: it has the hook registry and a hooked `step`."""
    return isinstance(opt, torch.optim.Optimizer) and "_optimizer_step_pre_hooks" in vars(opt)


def steppable(optimizer: Any) -> torch.optim.Optimizer:
    """The optimizer whose step hooks fire when `optimizer` steps: itself, or the one a wrapper holds.

    A wrapper that is a full Optimizer in its own right (lookahead-style, with its own hooks) is
    kept: its step is the whole update. Raises TypeError naming the object when there is none.
    """
    seen: set[int] = set()
    current = optimizer
    while id(current) not in seen:
        seen.add(id(current))
        if _hookable(current):
            return current  # type: ignore[no-any-return]
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
