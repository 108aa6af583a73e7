"""GradScaler bookkeeping: is the gradient the optimizer sees scaled, and which steps were skipped.

Two kinds of optimizer meet a `torch.amp.GradScaler`:

- fused ones (``_step_supports_amp_scaling``, e.g. ``AdamW(fused=True)``) are stepped on every
  iteration with the scale and an inf flag attached (``optimizer.grad_scale``, ``optimizer.found_inf``);
  their step hooks see *scaled* gradients and fire on skipped steps too;
- the others are stepped only after ``scaler.unscale_`` (so their hooks see unscaled gradients) and
  only when no inf/NaN was found: a skipped step fires no hook at all. Such skips are counted from
  the scaler's own history: each skip multiplies the scale by ``backoff_factor`` and zeroes the
  growth tracker, which the next step's pre-hook (or ``close()``) reads on the device, without a sync.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def _describe(obj: Any) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}" if t.__module__ != "builtins" else t.__qualname__


def active_scaler(scaler: Any) -> Any:
    """The scaler gradlog must follow, or None.

    A disabled scaler (``GradScaler(enabled=False)``, or any CUDA GradScaler built without CUDA, which
    disables itself) scales nothing and skips nothing: it is the same as no scaler. Anything with
    GradScaler's interface is accepted (duck typing: wrappers and look-alikes work); the loss scale and
    the skip history are read through ``get_scale`` / ``_scale`` where present.
    """
    if scaler is None:
        return None
    if isinstance(scaler, type):  # its methods are unbound: is_enabled() "missing 1 required argument: 'self'"
        raise TypeError(f"scaler={scaler.__name__}: pass the instance your loop uses, not the class")
    is_enabled = getattr(scaler, "is_enabled", None)
    if not callable(is_enabled) or not callable(getattr(scaler, "get_scale", None)):
        raise TypeError(
            f"scaler must be a GradScaler (torch.amp.GradScaler, torch.cuda.amp.GradScaler, or an object with "
            f"their is_enabled() and get_scale()), got {_describe(scaler)}: {scaler!r:.80}; "
            "pass the scaler whose scaler.step(optimizer) you call, or None"
        )
    return scaler if is_enabled() else None


class AmpState:
    """Scale and skip state of one optimizer, read from the optimizer and (optionally) its GradScaler."""

    def __init__(self, optimizer: torch.optim.Optimizer | None, scaler: Any = None) -> None:
        scaler = active_scaler(scaler)
        self.optimizer = optimizer
        self.scaler = scaler
        self.fused = bool(getattr(optimizer, "_step_supports_amp_scaling", False))
        self._count: torch.Tensor | None = None  # skipped optimizer steps so far, on the device
        self._prev: tuple[torch.Tensor, torch.Tensor] | None = None  # scale, growth tracker at the last step
        self._stepped = False  # a step ran after _prev was taken: its scaler.update() may have grown the scale
        started = getattr(scaler, "_scale", None) is not None and getattr(scaler, "_growth_tracker", None) is not None
        if self._watching_scaler() and started:  # attached mid-run
            self._prev = (scaler._scale.detach().clone(), scaler._growth_tracker.detach().clone())

    def follow(self, optimizer: torch.optim.Optimizer) -> None:
        """Another optimizer's steps are measured from now on (the scaler, if any, is the same one)."""
        self.optimizer = optimizer
        self.fused = bool(getattr(optimizer, "_step_supports_amp_scaling", False))

    def _watching_scaler(self) -> bool:
        sc = self.scaler
        return sc is not None and not self.fused and bool(sc.is_enabled())

    # --- what the optimizer sees --------------------------------------------------------------
    def inv_scale(self) -> torch.Tensor | None:
        """1/scale when the gradients at the step pre-hook are still scaled, else None."""
        opt = self.optimizer
        if opt is not None and hasattr(opt, "grad_scale"):  # GradScaler.step on a fused optimizer
            scale = opt.grad_scale
            return 1.0 / scale.detach().double() if isinstance(scale, torch.Tensor) else None
        sc = self.scaler
        if sc is None or not sc.is_enabled() or getattr(sc, "_scale", None) is None:
            return None
        state = getattr(sc, "_per_optimizer_states", {}).get(id(opt))
        if state is not None and getattr(state.get("stage"), "name", "") == "UNSCALED":
            return None  # scaler.step() (or the user) already called unscale_
        # optimizer.step() called directly, bypassing scaler.step(): the gradients carry the scale
        inv: torch.Tensor = 1.0 / sc._scale.detach().double()
        return inv

    def found_inf(self) -> torch.Tensor | None:
        found = getattr(self.optimizer, "found_inf", None)
        return found.detach() if isinstance(found, torch.Tensor) else None

    # --- skipped steps ------------------------------------------------------------------------
    def _add(self, k: torch.Tensor) -> None:
        k = k.detach().reshape(()).to(torch.float64)
        if self._count is None:
            self._count = k.clone()
            return
        if self._count.device != k.device:  # created before the scaler's scale existed: follow it once
            self._count = self._count.to(k.device)
        self._count = self._count + k

    def _skips_since_prev(self) -> torch.Tensor | None:
        """Scaler updates since the last step that were skips, from the scale's change (device ops only)."""
        sc = self.scaler
        scale, tracker = getattr(sc, "_scale", None), getattr(sc, "_growth_tracker", None)
        backoff = float(getattr(sc, "_backoff_factor", 0.5))
        if scale is None or tracker is None or not 0 < backoff < 1:
            return None
        if self._prev is None:  # nothing seen yet: the scaler started at init_scale with a zero tracker
            prev_scale = torch.full_like(scale, float(getattr(sc, "_init_scale", scale.item())))
            prev_tracker = torch.zeros_like(tracker)
        else:
            prev_scale, prev_tracker = self._prev
        expected = prev_scale.double()
        if self._stepped:  # the successful step's update grows the scale once the tracker reaches the interval
            grows = (prev_tracker + 1) >= int(getattr(sc, "_growth_interval", 2000))
            expected = torch.where(grows, expected * float(getattr(sc, "_growth_factor", 2.0)), expected)
        k = torch.round(torch.log(scale.double() / expected) / math.log(backoff)).clamp(min=0)
        return torch.nan_to_num(k, nan=0.0, posinf=0.0)

    def before_step(self) -> None:
        """Every step's pre-hook: count the skips a non-fused optimizer's hooks never saw."""
        if not self._watching_scaler():
            return
        k = self._skips_since_prev()
        if k is None:
            return
        self._add(k)
        sc = self.scaler
        self._prev = (sc._scale.detach().clone(), sc._growth_tracker.detach().clone())
        self._stepped = True

    def after_step(self) -> None:
        """Every step's post-hook: a fused optimizer tells whether it skipped."""
        found = self.found_inf()
        if found is not None:
            self._add((found.reshape(-1)[:1].sum() != 0).double())

    def count(self) -> torch.Tensor | None:
        """Skipped steps up to this step (device tensor), None while nothing could have been skipped."""
        if self._count is None and self._watching_scaler():
            self._count = torch.zeros((), dtype=torch.float64)
        return self._count

    def final_count(self) -> int | None:
        """At close: including the skips after the last step that ran (read after scaler.update())."""
        total = self.count()
        if total is None:
            return None
        if self._watching_scaler():
            k = self._skips_since_prev()
            if k is not None:
                total = total + k.to(total.device)
        return int(total.item())
