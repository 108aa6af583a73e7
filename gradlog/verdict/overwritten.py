"""At close: tensors whose optimizer updates did not stay, because something outside the optimizer set the
values back (`Reason.OVERWRITTEN`).

The evidence is the ledger's (`gradlog.verdict.ledger`, its docstring says how it is found):

- back to the start: updated at measured steps, and every slice of the final values equals the first
  fingerprint's. A never-updated record.
- a `SetBack` streak held to the end: the values before a measured step were those before the previous
  one although that step updated them, at every measured step since the streak began, and two pre-hook
  fingerprints proved it. A streak that began at the tensor's first or second measured step (the second:
  a mask that zeroes some entries once, then holds the rest at their start) is a never-updated record;
  one that began later (the tensor learned, then a checkpoint was reloaded every step) a stalled one.

Set back to exactly zero after it learned (the optimizer's update of one watched step still there before the
next, `SliceMoves.kept`, or a set-back streak that began after it learned) is a pruning during training, not a
restore: AdaLoRA's rank allocation zeroes the singular values it drops, in place, and holds them at zero; a
zero-initialised tensor (AdaLoRA's `lora_E`) so pruned ends where it started. `Reason.PRUNED`, a note.

Healthy runs that change weights outside the optimizer change them to new values every time (weight
clipping, max-norm renormalisation, `torch.nn.utils.prune`'s mask applied in forward to a learning
`weight_orig`, an EMA copy outside the optimizer): no record.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from gradlog.measure.distributed import is_sharded
from gradlog.measure.params import Tracked
from gradlog.verdict.ledger import Evidence, SetBack
from gradlog.verdict.report import Reason, Stalled

#: what to look for, said once per record
_FIX = (
    "look for a write after optimizer.step(): a mask applied to saved weights (weight.data = w0 * mask: "
    "mask the current weights, or use torch.nn.utils.prune), a load_state_dict of an old checkpoint, or "
    "p.data.copy_(...) in the loop"
)


#: the fix where the write is known (`gradlog.measure.writes`: the detail names its line)
_FIX_SITE = (
    "fix: change that write so it keeps the optimizer's updates (mask the current weights, w.data.mul_(mask), "
    "not saved ones; or use torch.nn.utils.prune), or remove it"
)

#: what to look for when some rows (columns, elements) of a tensor are set back, the others learning
_FIX_SLICES = (
    "look for a write to part of the tensor after optimizer.step(): a mask re-applied to saved values "
    "(w.data[mask] = w0[mask], w.data = w0 * mask: mask the current weights instead, or use "
    "torch.nn.utils.prune), or p.data[idx] = ... / p.data[idx].copy_(...) in the loop"
)


def set_back_slices(
    what: str, moved_at: tuple[int, ...], site: str = "", between: tuple[int, int] | None = None
) -> str:
    """The detail of slices (`what`: "output units 3, 7 (2 of 16)") whose values at close are their first
    ones although the optimizer moved them at one of the steps `moved_at` (`gradlog.measure.slice_moves`:
    a tensor's first measured steps, where each slice's update is looked at); `site`: the line that wrote
    the tensor outside the optimizer, where seen (`gradlog.measure.writes`); `between`: two steps between
    which it was so written (the write watch's, or two consecutive measured steps'), where known."""
    steps = ", ".join(str(s) for s in moved_at)
    when = f"at step {steps}" if len(moved_at) == 1 else f"at one or more of steps {steps}"
    at = f" at {site}" if site else ""
    if between is not None:
        gap = f" between steps {between[0]} and {between[1]}"
    else:
        gap = f" after step {moved_at[0]}" if len(moved_at) == 1 else " after those steps"
    return (
        f"{what} never changed, although the optimizer updated them {when} (where gradlog compares each slice "
        f"before and after the step): their values are back where they started, set back outside the optimizer{at}"
        f"{gap}, while the rest of the tensor learned; {_FIX_SITE if site else _FIX_SLICES}"
    )


def set_back_again(what: str, pair: tuple[int, int], site: str = "") -> str:
    """The detail of slices (`what`) that changed since the start, yet the optimizer's move of them at watched
    step k was undone before watched step k' (`pair`): their values before k' were those before k, bit for bit
    (`gradlog.measure.slice_moves`: a mask applied in place after every step, ``w.data.mul_(mask)``, zeroes
    rows the optimizer moves away from zero again); `site`: the line that wrote the tensor, where seen."""
    k, k2 = pair
    at = f" at {site}" if site else ""
    return (
        f"{what} updated by the optimizer at step {k}, yet their values before step {k2} are those before step {k} "
        f"(by their fingerprints): set back outside the optimizer{at} between steps {k} and {k2}, while "
        f"the rest of the tensor learned; {_FIX_SITE_AGAIN if site else _FIX_AGAIN}"
    )


#: what to look for when slices are set back to a value that is not their first one
_FIX_AGAIN = (
    "look for a write to part of the tensor after optimizer.step(): a mask applied after every step "
    "(w.data.mul_(mask) keeps the masked entries at zero while the optimizer keeps moving them: pruned on "
    "purpose, use torch.nn.utils.prune, which masks in forward), or p.data[idx] = ... in the loop"
)
#: the same, where the write's line is known
_FIX_SITE_AGAIN = (
    "fix: remove that write, or if it prunes on purpose use torch.nn.utils.prune (it masks in forward, so "
    "the optimizer no longer moves what the mask zeroes)"
)


def zeroed_after_learning(what: str, site: str = "", between: tuple[int, int] | None = None, them: str = "them") -> str:
    """The detail of slices (`what`, `them`) or a tensor ("the tensor", "it") that learned and were then set to
    exactly zero outside the optimizer, and are zero at close: pruned during training (where the write was
    seen: its line, its steps)."""
    at = f" at {site}" if site else ""
    gap = f" between steps {between[0]} and {between[1]}" if between is not None else ""
    return (
        f"{what} learned (an optimizer update stayed until the next watched step), then something outside the "
        f"optimizer{at} set {them} to exactly zero{gap}, and zero at close: pruned during training (AdaLoRA's "
        f"rank allocation, a magnitude-pruning schedule), by design; if nothing should prune {them}, look for a "
        "mask applied in place after optimizer.step()"
    )


def pruned_whole(
    rows: Sequence[Tracked],
    back_to_start: set[int],
    set_back: Mapping[int, SetBack],
    learned: Collection[int],
    sites: Mapping[int, str] | None = None,
) -> dict[int, str]:
    """The details of tensors back where they started at close (`back_to_start`) that are all zero there and
    learned before (`learned`: an update kept from one watched step to the next, or a set-back streak that
    began after earlier measured steps): pruned whole during training, by tracked index."""
    out: dict[int, str] = {}
    for row in rows:
        if row.index not in back_to_start or is_sharded(row.param):
            continue
        sb = set_back.get(row.index)
        late = sb is not None and sb.measured_before > 1
        if not (late or row.index in learned) or bool(row.param.detach().ne(0).any()):
            continue
        between = (sb.since, sb.back_at) if sb is not None and _held(sb) else None
        out[row.index] = zeroed_after_learning("the tensor", (sites or {}).get(row.index, ""), between, "it")
    return out


def _steps(n: int) -> str:
    return f"{n} measured step{'s' if n != 1 else ''}"


def _updated(ev: Evidence) -> str:
    return f"updated by the optimizer at {ev.updated} of {_steps(ev.measured)}"


def _held(sb: SetBack | None) -> bool:
    """A streak to the end, proven by fingerprints."""
    return sb is not None and sb.held > 0


def overwritten(
    rows: Sequence[Tracked],
    evidence: dict[int, Evidence],
    back_to_start: set[int],
    set_back: dict[int, SetBack],
    earlier: Collection[str] = (),
    own: Mapping[int, Evidence] | None = None,
    sites: Mapping[int, str] | None = None,
    returns: Mapping[int, tuple[int, list[int]]] | None = None,
) -> tuple[dict[int, str], list[Stalled]]:
    """The never-updated details (by tracked index) and the stalled records of tensors set back outside the
    optimizer, in model order. A resumed run: `earlier` names the tensors the earlier segments found set back
    (`gradlog.run.resume.Continuation.set_back_before`), `own` is this segment's evidence (`resumed_set_back`).
    `sites`: where each tensor was written outside the optimizer, where seen (`gradlog.measure.writes`):
    the detail names the line and ends with its fix. `returns`: the ledger's reset screen (`Ledger.returns`);
    a tensor back at its earlier values before two or more later measured steps is set back too, although
    no two consecutive measured steps show it (a reload every 10 steps, measured every 5)."""
    sites = sites or {}
    never: dict[int, str] = {}
    stalled: list[Stalled] = []
    for row in rows:
        ev = evidence.get(row.index)
        if ev is None or not ev.updated or not row.param.requires_grad:
            continue
        sb = set_back.get(row.index)
        held = sb if _held(sb) else None
        when = f" between steps {held.since} and {held.back_at}" if held is not None else ""
        site = sites.get(row.index)
        at = f" at {site}" if site else ""
        fix = _FIX_SITE if site else _FIX
        if row.index in back_to_start:
            never[row.index] = (
                f"{_updated(ev)}, yet its values are back where they started: set back outside the optimizer{at}"
                f"{when or ' (after the last measured step at the latest)'}; {fix}"
            )
        elif held is not None and held.measured_before <= 1:
            never[row.index] = (
                f"{_updated(ev)}, yet set back outside the optimizer{at}{when}, and again before each of the "
                f"{_steps(held.hits)} from {held.back_at} on: its values before them are all the same; {fix}"
            )
        elif held is not None:
            detail = (
                f"updated by the optimizer at every measured step, yet set back outside it{at}{when}, and again "
                f"before each of the {_steps(held.hits)} from {held.back_at} on: its values before them are all the "
                f"same (those before step {held.since}: it learned until then); {fix}"
            )
            stalled.append(Stalled(row.name, held.back_at, held.since, Reason.OVERWRITTEN, detail))
    if earlier and own is not None:
        never.update(resumed_set_back(rows, own, set_back, earlier, never, {s.name for s in stalled}))
    reported = {s.name for s in stalled}
    for row in rows:
        ev = evidence.get(row.index)
        back = (returns or {}).get(row.index)
        if back is None or len(back[1]) < 2 or row.index in never or row.name in reported or ev is None:
            continue
        if not ev.updated or not row.param.requires_grad:
            continue
        site = sites.get(row.index)
        at = f" at {site}" if site else ""
        steps = back[1]
        listed = ", ".join(str(k) for k in steps[:-1]) + f" and {steps[-1]}"
        never[row.index] = (
            f"{_updated(ev)}, yet its values before steps {listed} were those before step {back[0]} again (its sum of "
            "squares, bit for bit, each time after the optimizer had moved it): set back to them outside the "
            f"optimizer{at} again and again (a state saved at the start reloaded every epoch, p.data.copy_(init), "
            f"a reset), so it learns only between the resets; {_FIX_SITE if site else _FIX}"
        )
    return never, stalled


def resumed_set_back(
    rows: Sequence[Tracked],
    own: Mapping[int, Evidence],
    set_back: dict[int, SetBack],
    earlier: Collection[str],
    found: Mapping[int, str],
    stalled: Collection[str],
) -> dict[int, str]:
    """The details of tensors an earlier segment of a resumed run found set back, that this segment updated
    and saw no update of stay: the set-back state spans the resume, so a segment too short to prove it again
    (one measured step, or a streak not yet fingerprinted twice) does not forget it. An update stayed when the
    values before a measured step differed from those before the previous one (the ledger's screen), so a
    streak from this segment's first measured step to its last, or a single measured step, keeps the finding;
    anything else (the bug fixed before the resume) lets it go. `found`, `stalled`: already reported here."""
    out: dict[int, str] = {}
    for row in rows:
        ev = own.get(row.index)
        if row.name not in earlier or row.index in found or row.name in stalled or ev is None or not ev.updated:
            continue
        sb = set_back.get(row.index)
        streak = sb is not None and sb.measured_before == 0 and not sb.moved_on
        if ev.measured > 1 and not streak:
            continue  # an update stayed since the resume: it learns now
        if sb is not None and streak:
            since = (
                f"its values before each of the {_steps(sb.hits + 1)} from step {sb.since} on are the same "
                "(the sums of squares, bit for bit)"
            )
        else:
            since = "too few to see an update stay"
        out[row.index] = (
            f"set back outside the optimizer before the resume (found by an earlier segment of this run), and no "
            f"update stayed since: {_updated(ev)} since the resume, and {since}; {_FIX}"
        )
    return out
