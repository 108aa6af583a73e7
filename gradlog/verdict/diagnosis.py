"""At close: turn the ledger's evidence into one reason per tensor that never learned."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from gradlog.measure.params import Tracked
from gradlog.verdict.ledger import Evidence
from gradlog.verdict.report import NeverUpdated, Reason, Stalled
from gradlog.verdict.rounding import unmoved


def _steps(n: int) -> str:
    return f"{n} measured step{'s' if n != 1 else ''}"


def _layer_key(name: str) -> tuple[str, int] | None:
    """transformer.h.3.attn.c_attn.weight -> ("transformer.h.*.attn.c_attn.weight", 3); None without a layer index."""
    parts = name.split(".")
    for i, p in enumerate(parts):
        if p.isdigit() and 0 < i < len(parts) - 1:
            return ".".join([*parts[:i], "*", *parts[i + 1 :]]), int(p)
    return None


def _frozen_between(rows: list[Tracked]) -> dict[int, str]:
    """Frozen tensors of a layer stack whose same tensor trains in a layer below them.

    Freezing on purpose takes a prefix of the layers (embeddings and the first k blocks), or all of them
    (LoRA, BitFit); a block frozen above a trainable one is a freeze by mistake far more often."""
    trainable: dict[str, int] = {}  # family -> lowest trainable layer
    for r in rows:
        key = _layer_key(r.name)
        if key is not None and r.in_model and r.param.requires_grad:
            trainable[key[0]] = min(trainable.get(key[0], key[1]), key[1])
    out = {}
    for r in rows:
        key = _layer_key(r.name)
        if key is not None and not r.param.requires_grad and trainable.get(key[0], key[1]) < key[1]:
            below = key[0].replace("*", str(trainable[key[0]]), 1)
            out[r.index] = below
    return out


def _frozen(row: Tracked, ev: Evidence, has_optimizer: bool, trains_below: str | None) -> tuple[Reason, str, bool]:
    """Frozen on purpose, or by mistake? A tensor already frozen when gradlog started is frozen on purpose
    even inside an optimizer param group (a model that freezes its fixed sinusoidal position table in
    `__init__`, an optimizer built from `model.parameters()`: harmless, it never gets a gradient). What looks
    like a mistake is a finding (suspect), with the reason it looks so: a tensor trainable when gradlog
    started and frozen since (while in a param group: frozen after training began), or one frozen above
    the same tensor training in a lower layer."""
    group = row.group if has_optimizer else None
    if ev.trainable_at_start:
        where = f", while in optimizer param group {group}" if group is not None else ""
        detail = (
            f"requires_grad was True when gradlog started and is False now{where}: frozen during the run, "
            "before it ever updated (a freeze meant for another layer, or for later in training?)"
        )
        return Reason.FROZEN, detail, True
    if trains_below is not None:
        return (
            Reason.FROZEN,
            (
                f"requires_grad is False, yet {trains_below} in a lower layer trains: a block frozen by mistake? "
                "(freezing on purpose usually takes the first layers, or all of them)"
            ),
            True,
        )
    if group is not None:
        detail = (
            f"requires_grad was already False when gradlog started (frozen on purpose, e.g. a fixed table); it "
            f"sits in optimizer param group {group}, which is harmless: it never gets a gradient"
        )
        return Reason.FROZEN, detail, False
    return Reason.FROZEN, "requires_grad is False", False


def _unchanged_reason(row: Tracked, ev: Evidence, has_optimizer: bool, skipped_steps: int = 0) -> tuple[Reason, str]:
    if not row.param.requires_grad:
        return Reason.FROZEN, "requires_grad is False"
    if not row.in_model and row.group is not None:
        if row.name.startswith("optimizer."):  # never seen in the model
            return Reason.NOT_IN_MODEL, f"in optimizer param group {row.group}, but not in the model passed to gradlog"
        return Reason.NOT_IN_MODEL, (
            f"in optimizer param group {row.group}, but no longer in the model: its module was replaced or deleted "
            "after the optimizer was built (rebuild the optimizer, or add the new module's parameters to it)"
        )
    if has_optimizer and row.group is None:
        detail = "in no optimizer param group (added after the optimizer was built?)"
        if ev.measured and ev.grad_none < ev.measured:
            detail += f"; had a gradient at {ev.measured - ev.grad_none} of {_steps(ev.measured)}"
        return Reason.NOT_IN_OPTIMIZER, detail
    if ev.measured == 0 and skipped_steps:  # a non-fused optimizer's skipped steps fire no hook
        return Reason.NONFINITE_GRAD, (
            f"no optimizer step ran: GradScaler skipped all {skipped_steps} steps (NaN/Inf gradients)"
        )
    if ev.measured == 0:
        return Reason.UNKNOWN, "no measured step saw it (did the optimizer step, or log() run?)"
    if ev.grad_none == ev.measured:
        return (
            Reason.NO_GRAD,
            f"grad None at all {_steps(ev.measured)}: unused in forward, detached, or run under torch.no_grad()",
        )
    if ev.lr_zero == ev.measured:
        return Reason.ZERO_LR, f"lr 0 in param group {row.group} at all {_steps(ev.measured)}"
    none = f"; None at {ev.grad_none}" if ev.grad_none else ""
    if ev.grad_ok == 0 and ev.grad_nonfinite == 0 and ev.skipped == 0 and ev.grad_zero > 0:
        return Reason.ZERO_GRAD, f"grad exactly zero at all {ev.grad_zero} measured steps with a gradient{none}"
    if ev.grad_ok == 0 and (ev.grad_nonfinite or ev.skipped):
        parts = []
        if ev.grad_nonfinite:
            parts.append(f"NaN/Inf grad at {ev.grad_nonfinite} of {_steps(ev.measured)}")
        if ev.skipped:
            parts.append(f"the optimizer skipped all {ev.skipped} measured steps with a gradient")
        return Reason.NONFINITE_GRAD, "; ".join(parts)
    if ev.stalled:
        reason, why = unmoved(ev.dtype)
        return reason, (
            f"finite non-zero grad and lr > 0 at {ev.grad_ok} measured steps, yet the {ev.dtype} value never "
            f"changed: {why}"
        )
    return Reason.UNKNOWN, (
        f"value never changed; grad ok at {ev.grad_ok}, zero at {ev.grad_zero}, NaN/Inf at {ev.grad_nonfinite}, "
        f"None at {ev.grad_none} of {_steps(ev.measured)}"
    )


def _changed_reason(row: Tracked, ev: Evidence) -> tuple[Reason, str] | None:
    """A tensor that moved without ever getting a usable gradient did not learn either."""
    if not row.param.requires_grad or ev.measured == 0 or ev.grad_ok > 0:
        return None
    if ev.grad_nonfinite:
        return Reason.NONFINITE_GRAD, (
            f"NaN/Inf grad at {ev.grad_nonfinite} of {_steps(ev.measured)} and never a finite one; "
            "the value changed (it is likely non-finite now)"
        )
    if ev.grad_zero and not ev.skipped:
        none = f", None at {ev.grad_none}" if ev.grad_none else ""
        return Reason.ZERO_GRAD, (
            f"grad exactly zero at all {ev.grad_zero} measured steps with a gradient{none}; "
            "the value changed only without a gradient (weight decay)"
        )
    return None


def run_hint(
    rows: list[Tracked],
    out: Sequence[NeverUpdated],
    has_optimizer: bool,
    stalled: Sequence[Stalled] = (),
    resumed_at: int | None = None,
) -> str | None:
    """One bug often explains every record at once; the Report says so once. A resumed run (`resumed_at`:
    its first step) passes its merged records: a tensor updated before the resume and not since (stalled
    from that step or earlier, with the reason this segment found) counts as one that never learned, and a
    hint that needs it holds from the resume on (a mistake made in the resumed script), as it then says."""
    trainable = [r for r in rows if r.param.requires_grad and r.in_model]
    quiet = [s for s in stalled if resumed_at is not None and s.since_step <= resumed_at]
    reason = {rec.name: rec.reason for rec in out} | {s.name: s.reason for s in quiet}
    hint = _hint(rows, trainable, {reason.get(r.name) for r in trainable}, has_optimizer)
    if hint is not None and {s.name for s in quiet} & {r.name for r in trainable}:
        return f"from the resume at step {resumed_at} on, {hint}"
    return hint


def _hint(
    rows: list[Tracked], trainable: list[Tracked], reasons: set[Reason | None], has_optimizer: bool
) -> str | None:
    """The one mistake that gives every trainable tensor the same reason (`reasons`: theirs, None for one
    that learned), or None."""
    hint = None
    frozen_in_opt = [r for r in rows if r.in_model and r.group is not None and not r.param.requires_grad]
    if len(trainable) > 1 and reasons == {Reason.NO_GRAD}:
        hint = "every trainable tensor had grad None: is zero_grad() called between backward() and step()?"
    elif len(trainable) > 1 and reasons == {Reason.ZERO_GRAD}:
        hint = (
            "every trainable tensor had an all-zero grad: is zero_grad(set_to_none=False) called between "
            "backward() and step(), are gradients clipped to 0 (max_norm=0), or is the loss constant?"
        )
    elif has_optimizer and trainable and reasons == {Reason.NOT_IN_OPTIMIZER} and frozen_in_opt:
        hint = (
            f"no trainable tensor is in the optimizer, only {len(frozen_in_opt)} frozen ones: was it built before "
            "the adapters were added (get_peft_model) or before the layers were unfrozen? Build it afterwards, from "
            "[p for p in model.parameters() if p.requires_grad]"
        )
    elif has_optimizer and trainable and reasons == {Reason.NOT_IN_OPTIMIZER}:
        orphans = sum(not r.in_model for r in rows)
        hint = "no model tensor is in the optimizer: was it built for another copy of the model (deepcopy, a model"
        hint += " rebuilt or reloaded after the optimizer)?"
        if orphans:
            hint += f" The optimizer holds {orphans} tensors the model does not have."
    return hint


def diagnose(
    rows: list[Tracked],
    evidence: dict[int, Evidence],
    changed: dict[int, bool],
    has_optimizer: bool,
    skipped_steps: int = 0,
    overwritten: Mapping[int, str] | None = None,
    pruned: Mapping[int, str] | None = None,
) -> list[NeverUpdated]:
    """One record per tensor that never learned, in model order. `overwritten`: the details of tensors the
    optimizer updated and something outside it set back (`gradlog.verdict.overwritten`), by tracked index;
    `pruned`: those of tensors that learned and were then zeroed outside it (`overwritten.pruned_whole`)."""
    out = []
    between = _frozen_between(rows)
    for row in rows:
        ev = evidence.get(row.index, Evidence())
        moved = changed.get(row.index)
        found: tuple[Reason, str] | None
        if moved is None:  # no fingerprint: never materialised, or first seen after the last step
            found = Reason.UNKNOWN, "never materialised (lazy or meta parameter), or first seen after the last step"
        elif moved and pruned and row.index in pruned:
            found = Reason.PRUNED, pruned[row.index]
        elif moved and overwritten and row.index in overwritten:
            found = Reason.OVERWRITTEN, overwritten[row.index]
        elif moved:
            found = _changed_reason(row, ev)
        else:
            found = _unchanged_reason(row, ev, has_optimizer, skipped_steps)
        if found is not None:
            reason, detail = found
            suspect = False
            if reason == Reason.FROZEN:
                reason, detail, suspect = _frozen(row, ev, has_optimizer, between.get(row.index))
            out.append(NeverUpdated(row.name, row.shape, row.numel, reason, detail, row.aliases, suspect=suspect))
    return _replaced(out, rows)


def _replaced(records: list[NeverUpdated], rows: Sequence[Tracked]) -> list[NeverUpdated]:
    """A module replaced after the optimizer was built (``model.head = nn.Linear(...)``): its new tensors are in
    no param group and the optimizer still steps the old ones, of the same shapes, which the model no longer
    has. Where the optimizer still holds some of the model's tensors (not one built for another copy of the
    model: `_hint` says that) and a module's tensors out of the optimizer each match such an orphan by shape,
    both records say so, with the fix, instead of "added after the optimizer was built?"."""
    if not any(r.in_model and r.group is not None for r in rows):
        return records
    orphans = [r for r in records if r.reason == Reason.NOT_IN_MODEL]
    by_module: dict[str, list[NeverUpdated]] = {}
    for r in records:
        if r.reason == Reason.NOT_IN_OPTIMIZER:
            by_module.setdefault(r.name.rsplit(".", 1)[0] if "." in r.name else r.name, []).append(r)
    details: dict[str, str] = {}
    for module, new in by_module.items():
        pool = list(orphans)
        old = []
        for r in new:
            match = next((o for o in pool if o.shape == r.shape), None)
            if match is None:
                break
            pool.remove(match)
            old.append(match)
        if len(old) != len(new):
            continue
        orphans = pool
        shapes = ", ".join("x".join(map(str, r.shape)) for r in new)
        olds = ", ".join(o.name for o in old)
        said = (
            f"in no optimizer param group, while the optimizer steps {len(old)} tensor{'s' if len(old) > 1 else ''} "
            f"of the same shape{'s' if len(old) > 1 else ''} ({shapes}) that the model no longer has ({olds}): "
            f"{module} was replaced after the optimizer was built (model.{module} = ...); fix: build the optimizer "
            f"after replacing it, or optimizer.add_param_group({{'params': model.{module}.parameters()}})"
        )
        details |= {r.name: said for r in new} | {o.name: f"{o.detail}; replaced in the model by {module}" for o in old}
    return [dataclasses.replace(r, detail=details[r.name]) if r.name in details else r for r in records]
