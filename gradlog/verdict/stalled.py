"""At close: the tensors that learned, then stopped (a scheduler that set lr to 0, a freeze mid-run, NaN).

A tensor is stalled when it had a non-zero update at some measured step and none at any measured step
after that, until the end of the run, over at least `MIN_QUIET_STEPS` measured steps and
`MIN_QUIET_FRACTION` of all measured steps: one quiet step (a routine GradScaler skip, an expert that
got no token once) is not a finding. Where the quiet steps prove nothing by themselves (no gradient, a
zero one: `SILENCE_JUDGED`), the silence must also be evidence (`gradlog.verdict.silence`): a tensor
updated at c of the m measured steps up to its last update, then at none of the n after, is stalled only
when one updated at random at a steady rate would show this with chance C(m, c) / C(m + n, c) below 1e-3
(a branch taken on 10% of steps is quiet for 20 measured steps all the time).
Resolution is the measured step: the tensor stopped somewhere
after its last update and no later than the first quiet measured step, and the detail says so.
The reason comes from what the quiet steps showed (`gradlog.verdict.ledger.Quiet`), most
fundamental first, like the never-updated diagnosis.
"""

from __future__ import annotations

import math

from gradlog.measure.params import Tracked
from gradlog.verdict.ledger import Evidence, Quiet, StepIndex
from gradlog.verdict.precision import early_share, from_start
from gradlog.verdict.report import Reason, Stalled
from gradlog.verdict.rounding import unmoved
from gradlog.verdict.silence import MAX_CHANCE, chance, evidence_words

MIN_QUIET_STEPS = 3
MIN_QUIET_FRACTION = 0.1
#: the reasons a quiet stretch alone gives (no gradient, a zero one, a mix): claimed only when a tensor updated
#: at random at a steady rate would be this quiet with chance below `MAX_CHANCE` (`gradlog.verdict.silence`).
#: The others are proven at every quiet step (lr 0, requires_grad False, out of the optimizer, NaN, rounding).
SILENCE_JUDGED = frozenset({Reason.NO_GRAD, Reason.ZERO_GRAD, Reason.UNKNOWN})


def _steps(n: int) -> str:
    return f"{n} measured step{'s' if n != 1 else ''}"


def _reason(row: Tracked, q: Quiet, since: int, has_optimizer: bool, dtype: str) -> tuple[Reason, str]:
    """Why the quiet stretch that began at `since` was quiet."""
    if not row.param.requires_grad:
        seen = q.frozen_since if q.frozen_since >= 0 else since
        return Reason.FROZEN, f"requires_grad went False (False from step {seen} on)"
    if has_optimizer and row.group is None:
        return Reason.NOT_IN_OPTIMIZER, "no longer in any optimizer param group"
    if q.seen == 0:
        return Reason.UNKNOWN, "not measured since then"
    if q.lr_zero == q.seen:
        return Reason.ZERO_LR, f"lr of param group {row.group} is 0 since step {q.lr_zero_since} (a scheduler?)"
    if q.grad_none == q.seen:
        return Reason.NO_GRAD, (
            f"grad None at all {_steps(q.seen)} since: no longer used in forward, detached, or under torch.no_grad()"
        )
    none = f"; None at {q.grad_none}" if q.grad_none else ""
    if q.grad_ok == 0 and q.grad_nonfinite == 0 and q.skipped == 0 and q.grad_zero:
        return Reason.ZERO_GRAD, (
            f"grad exactly zero at all {_steps(q.grad_zero)} with a gradient since{none} "
            "(dead units, masked, or multiplied by 0)"
        )
    if q.grad_ok == 0 and (q.grad_nonfinite or q.skipped):
        parts = []
        if q.grad_nonfinite:
            first = q.first_nonfinite
            parts.append(f"NaN/Inf grad at {q.grad_nonfinite} of {_steps(q.seen)} since, first at step {first}")
        if q.skipped:
            parts.append(f"the optimizer skipped {_steps(q.skipped)} with a gradient (GradScaler)")
        return Reason.NONFINITE_GRAD, "; ".join(parts)
    if q.grad_ok and q.grad_ok + q.grad_zero + q.grad_none == q.seen:
        reason, why = unmoved(dtype)
        grads = f"finite non-zero grad and lr > 0 at {_steps(q.grad_ok)} since"
        return reason, f"{grads}, yet no {dtype} value changed: {why}"
    return Reason.UNKNOWN, (
        f"since then grad ok yet no update at {q.grad_ok}, zero at {q.grad_zero}, NaN/Inf at {q.grad_nonfinite}, "
        f"None at {q.grad_none}, lr 0 at {q.lr_zero}, skipped at {q.skipped} of {_steps(q.seen)}"
    )


#: an lr this many times below the one of the last update is a cut (a knob, a step schedule), not a drift
LR_CUT = 10.0


def _below_precision(ev: Evidence, why: str) -> tuple[Reason, str]:
    """A bf16/fp16 tensor that stopped because its updates round away: a problem where its lr was cut since its
    last update (the knob is named) or its updates rounded away from its first steps; a note where they
    registered while it learned and shrank below the dtype's precision at an unchanged lr (Adam's steps
    shrink as a run converges: the calibration zoo's Lightning bf16-true run, its 4-element head bias)."""
    lr_then, lr_now = ev.last_update_lr, ev.quiet.lr_low
    if lr_then > 0 and lr_now * LR_CUT <= lr_then:
        return Reason.BELOW_PRECISION, f"{why}; its lr fell from {lr_then:.3g} at step {ev.last_update} to {lr_now:.3g}"
    early = early_share(ev)
    mean = ev.frozen_sum / ev.frozen_steps if ev.frozen_steps else 0.0
    if early is None or from_start(early, mean):
        return Reason.BELOW_PRECISION, why
    return Reason.SHRANK_BELOW_PRECISION, (
        f"{why}; at an unchanged lr, its first measured steps lost {early:.0%} of their updates: they registered "
        "while it learned and shrank below the dtype's precision as it converged"
    )


def stalled(
    rows: list[Tracked],
    evidence: dict[int, Evidence],
    steps: StepIndex,
    measured_steps: int,
    has_optimizer: bool,
    exclude: set[str] | frozenset[str] = frozenset(),
) -> list[Stalled]:
    """One record per tensor that stopped learning, in model order; `exclude` names tensors already
    reported as never updated."""
    need = max(MIN_QUIET_STEPS, math.ceil(MIN_QUIET_FRACTION * measured_steps))
    out = []
    for row in rows:
        ev = evidence.get(row.index)
        if ev is None or ev.updated == 0 or row.name in exclude:
            continue
        quiet, since, last = steps.after(ev.last_update)
        if quiet < need:
            continue
        reason, why = _reason(row, ev.quiet, since, has_optimizer, ev.dtype)
        if reason is Reason.BELOW_PRECISION:
            reason, why = _below_precision(ev, why)
        said = ""
        if reason in SILENCE_JUDGED and ev.quiet.seen:  # no per-step signal proves it: the silence must say it
            seen = ev.measured - ev.quiet.seen
            p = chance(seen, ev.quiet.seen, ev.updated)
            if p >= MAX_CHANCE:
                continue  # a tensor updated now and then (a rarely taken branch) is this quiet by chance
            said = f"; {evidence_words(ev.quiet.seen, seen, ev.updated, ev.updated, p, 'a tensor', 'updated')}"
        detail = (
            f"no update at the {_steps(quiet)} from step {since} to {last} (last update at step "
            f"{ev.last_update}; it stopped between steps {ev.last_update} and {since}): {why}{said}"
        )
        out.append(Stalled(row.name, since, ev.last_update, reason, detail))
    return out
