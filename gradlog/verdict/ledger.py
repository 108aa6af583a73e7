"""Per-tensor evidence gathered over the whole run, for the diagnosis at close.

The starting values of every tensor are kept as per-slice fingerprints (`measure/fingerprint.py`):
at most 8 bytes per row and per column, or the raw bits of each element of a 1-D tensor.

Weights set back outside the optimizer (a pruning mask applied to saved weights after every step, a
checkpoint reloaded, `p.data.copy_(init)`): the optimizer's updates are measured, yet the values do not
stay. Two cheap looks find it. At close, a tensor updated at measured steps whose fingerprint equals its
first one is back where it started (`Ledger.back_to_start`, exact). During the run, a screen on numbers
already measured: a tensor's sum of squares before a measured step equal, bit for bit, to the one before
the previous measured step although that step updated it; only then is it fingerprinted, at the next
measured step's pre-hook, and again at the one after, and the two compared (`SetBack`): exact, and no
cost for tensors the screen passes (a max-norm renormalisation keeps the norm, not the values: its
fingerprints differ, and it is let go). A reset that no two consecutive measured steps show (a state saved at
the start reloaded every 10 steps, measured every 5) is screened the same way against the sums of squares before
the first measured step (`Ledger.returns`): back there, bit for bit, after the optimizer moved it, at two or more
later measured steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from gradlog.measure.distributed import is_sharded
from gradlog.measure.fingerprint import Changes, Fingerprint, changes_all, compare, take, take_all
from gradlog.measure.flat_shards import slice_view
from gradlog.measure.meter import Measurement
from gradlog.measure.params import Tracked, is_materialized, local_tensor

#: how far (a share of it) a tensor's sum of squares must have moved from its start before an equal one counts as
#: a return there (`Ledger._returns`): 100x an fp32 sum's rounding
_AWAY = 1e-5


@dataclass(frozen=True)
class NonFinite:
    """Where a gradient first went NaN/Inf: the step to look at first."""

    step: int
    name: str
    count: int


@dataclass
class Quiet:
    """What the measured steps after a tensor's last update showed (reset by each update): the evidence
    for why a tensor stopped learning. Counters and step numbers only."""

    seen: int = 0  # measured steps since the last update at which this tensor was measured
    grad_none: int = 0
    grad_zero: int = 0
    grad_nonfinite: int = 0
    skipped: int = 0
    grad_ok: int = 0  # finite non-zero grad, lr > 0, not skipped, yet no update
    lr_zero: int = 0
    frozen: int = 0  # requires_grad False
    first_nonfinite: int = -1
    lr_zero_since: int = -1  # first step of the current unbroken run of lr 0 (-1: lr not 0 now)
    frozen_since: int = -1  # first step of the current unbroken run of requires_grad False
    lr_low: float = math.inf  # the smallest lr > 0 of its param group since (a schedule or a knob that cut it?)


@dataclass
class Evidence:
    """What the measured steps showed about one tensor."""

    measured: int = 0
    grad_none: int = 0
    grad_zero: int = 0
    grad_nonfinite: int = 0
    grad_ok: int = 0  # finite, not all zero, on a step the optimizer did not skip
    lr_zero: int = 0  # measured steps whose param group had lr 0
    skipped: int = 0  # steps with a gradient that the optimizer skipped
    stalled: int = 0  # finite non-zero grad, lr > 0, not skipped, yet a zero update
    updated: int = 0  # measured steps with a non-zero update
    first_fp: Fingerprint | None = None  # per-slice signatures of the values when first seen
    #: the tensor's in-place version count when `first_fp` was taken (see `_version`; -1: none)
    first_version: int = -1
    trainable_at_start: bool | None = None  # requires_grad when first fingerprinted
    dtype: str = ""
    last_update: int = -1  # optimizer step of the last measured step with a non-zero update
    last_update_lr: float = 0.0  # its param group's lr at that step (0.0: not known)
    quiet: Quiet = field(default_factory=Quiet)  # the measured steps since then
    #: updates rounded away (`Measurement.frozen_frac`): measured steps judged, the sum and the maximum of
    #: the share of elements with a non-zero gradient whose value did not change
    frozen_steps: int = 0
    frozen_sum: float = 0.0
    frozen_max: float = 0.0
    #: the shares of its first `FIRST_SHARES` judged steps (this segment's): did the updates round away from the
    #: start (an lr too small for the dtype) or only once they shrank (a converging run)?
    frozen_first: tuple[float, ...] = ()  # at most FIRST_SHARES: bounded whatever the run's length
    #: weight decay (`Measurement.weight_decay`): measured steps (not skipped) whose group's decay rule is known,
    #: and of them those where lr x weight_decay was at least `WIPES`, the first such step, the largest product
    #: with its lr and weight_decay, and the update ratios measured on those steps (their sum and count)
    decay_steps: int = 0
    wipe_steps: int = 0
    wipe_first: int = -1
    wipe_product: float = 0.0
    wipe_lr: float = 0.0
    wipe_wd: float = 0.0
    wipe_ratio_sum: float = 0.0
    wipe_ratio_n: int = 0


#: how many of a tensor's first judged steps keep their rounded-away share (`Evidence.frozen_first`)
FIRST_SHARES = 3

#: the share of the weights one step's decay takes (lr x weight_decay) from which a step counts as wiping them:
#: half the weights gone each step keeps ~2 steps of what they learned (healthy AdamW: 1e-5 to 1e-3)
WIPES = 0.5


@dataclass
class SetBack:
    """A tensor back at its earlier values before measured steps although the optimizer updated it in
    between: an unbroken streak of such steps, from the pair (`since`, `back_at`), and the proof by
    fingerprints (`held`)."""

    since: int  # the measured step whose update was undone first in this streak
    back_at: int  # the next measured step: its pre-hook values were those before `since` (by the screen)
    measured_before: int  # this tensor's measured steps before `since` (0: the streak began at its first)
    at: int  # its position in the measurements' rows (the same while the parameter table is)
    hits: int = 1  # measured steps of the streak: sum of squares before them equal to the previous one's
    pending: bool = True  # fingerprint it at the next measured step's pre-hook
    ref: Fingerprint | None = None  # its values at the streak's first fingerprinted pre-hook
    ref_step: int = -1
    held: int = 0  # later pre-hook fingerprints equal to `ref`, slice for slice: the values were set back (exact)
    #: a later fingerprint differed from `ref` (the norm matched, the values did not: a renormalisation)
    moved_on: bool = False


class StepIndex:
    """The optimizer-step numbers of the measured steps, kept as arithmetic runs (start, stride, count):
    a few integers for a whole run measured every k steps, whatever its length."""

    def __init__(self) -> None:
        self.runs: list[list[int]] = []

    def add(self, step: int) -> None:
        if self.runs:
            start, stride, count = self.runs[-1]
            last = start + stride * (count - 1)
            if step > last and (count == 1 or step - last == stride):
                self.runs[-1] = [start, step - last, count + 1] if count == 1 else [start, stride, count + 1]
                return
        self.runs.append([step, 1, 1])

    def after(self, step: int) -> tuple[int, int, int]:
        """(how many measured steps came after `step`, the first of them, the last), or (0, -1, -1)."""
        n = 0
        first = last = -1
        for start, stride, count in self.runs:
            end = start + stride * (count - 1)
            if end <= step:
                continue
            skip = 0 if start > step else (step - start) // stride + 1
            if first < 0:
                first = start + stride * skip
            n += count - skip
            last = end
        return n, first, last


class Ledger:
    """Feeds on each `Measurement`; holds only counters and fingerprints, never tensor copies."""

    def __init__(self) -> None:
        self.evidence: dict[int, Evidence] = {}
        self.measured_steps = 0
        self.skipped_steps = 0
        self.first_nonfinite: NonFinite | None = None
        self.steps = StepIndex()
        #: filled by `changed`: per tensor, which rows/columns/elements differ from their first values (host)
        self.slice_changes: dict[int, Changes] = {}
        self._fp_generation: int | None = None  # see `fingerprint_new`
        self._unmaterialized: list[Tracked] = []
        #: tensors whose values were back at the previous measured step's (`SetBack`), by tracked index
        self.set_back: dict[int, SetBack] = {}
        #: filled by `changed`: tensors updated at measured steps whose values equal their first ones (exact)
        self.back_to_start: set[int] = set()
        #: the last measurement's rows, sums of squares before its step, which rows it updated, its step, and
        #: the sums of squares after it of the rows it copied (NaN elsewhere) (`_screen`)
        self._prev: tuple[list[Tracked], torch.Tensor, torch.Tensor, int, torch.Tensor] | None = None
        #: tracked indices newly seen written outside the optimizer (a set-back streak begun, or values changed
        #: between consecutive steps a second time): where the write is, is worth a look (`gradlog.measure.writes`)
        self.to_watch: list[int] = []
        #: tracked indices whose values changed once between two consecutive steps: a one-off write (a checkpoint
        #: restored once) is no pattern to look for; a second one is
        self._written_once: set[int] = set()
        #: per tracked index, the first two consecutive measured steps (k, k + 1) between which its values
        #: changed outside the optimizer: where a set-back of some of its slices happened at the latest
        self.written_between: dict[int, tuple[int, int]] = {}
        #: the reset screen (`_returns`): the rows, their sums of squares before the first measured step of
        #: these rows, which of them the optimizer moved since (or since their last return), and that step
        self._origin: tuple[list[Tracked], torch.Tensor, torch.Tensor, int] | None = None
        #: per tracked index: the measured step whose values it came back to, and the later measured steps
        #: before which its sum of squares was, bit for bit, that step's again after the optimizer had moved it
        #: (a state saved at the start reloaded every epoch, misaligned with `every`: no streak shows it)
        self.returns: dict[int, tuple[int, list[int]]] = {}

    def _ev(self, row: Tracked) -> Evidence:
        ev = self.evidence.get(row.index)
        if ev is None:
            ev = self.evidence[row.index] = Evidence(dtype=str(row.param.dtype).replace("torch.", ""))
        return ev

    def fingerprint_new(self, rows: list[Tracked], generation: int | None = None) -> None:
        """Remember the starting values of tensors seen materialised for the first time.

        `generation`: the table's (`ParamTable.generation`). While it stays the same, only the rows that
        were not materialised last time are looked at again: a frozen backbone's tensors are walked once,
        not on every measured step."""
        if generation is not None and generation == self._fp_generation:
            rows = self._unmaterialized
            if not rows:
                return
        new: list[tuple[Evidence, torch.Tensor]] = []
        waiting: list[Tracked] = []
        for r in rows:
            ev = self._ev(r)
            if ev.first_fp is None:
                p = r.param
                if is_materialized(p):
                    new.append((ev, p))
                else:
                    waiting.append(r)
        self._fp_generation, self._unmaterialized = generation, waiting
        for (ev, p), fp in zip(new, take_all([slice_view(p, p) for _, p in new])):  # many small tensors at once
            ev.first_version = _version(p)
            ev.first_fp = fp
            ev.trainable_at_start = bool(p.requires_grad)

    def release(self, index: int) -> None:
        """A tracked tensor was freed (replaced during training): its fingerprint can never be compared
        again, so it goes; the counters stay (its evidence, a few integers).

        Besides the bytes, this is what keeps RSS flat when a big weight is replaced again and again: a
        small allocation that outlives the freed weight next to it pins glibc's heap above it."""
        ev = self.evidence.get(index)
        if ev is not None:
            ev.first_fp = None
            ev.first_version = -1
        self.slice_changes.pop(index, None)
        self.set_back.pop(index, None)
        self.written_between.pop(index, None)

    @property
    def nbytes(self) -> int:
        """Bytes held for the fingerprints (tests check the per-slice budget)."""
        return sum(ev.first_fp.nbytes for ev in self.evidence.values() if ev.first_fp is not None)

    def observe(self, m: Measurement) -> None:
        self.measured_steps += 1
        self.steps.add(m.index)
        # GradScaler skips that fired no hook are only known through the running total
        self.skipped_steps = m.skipped_total if m.skipped_total is not None else self.skipped_steps + m.skipped
        host = m.lists
        nonzero, nonfinite, upd = host.nonzero, host.nonfinite, host.update
        decays = m.weight_decay
        frozen = m.frozen_frac if not m.skipped else None  # a skipped step changes nothing, by design
        if frozen is not None:
            for row, frac in zip(m.rows, frozen):
                if frac is not None:
                    ev = self._ev(row)
                    ev.frozen_steps += 1
                    ev.frozen_sum += frac
                    ev.frozen_max = max(ev.frozen_max, frac)
                    if len(ev.frozen_first) < FIRST_SHARES:
                        ev.frozen_first = (*ev.frozen_first, frac)
        for i, row in enumerate(m.rows):
            ev = self._ev(row)
            ev.measured += 1
            moved = upd is not None and upd[i] > 0 and not m.skipped
            if moved:
                ev.updated += 1
                ev.last_update = m.index
                ev.last_update_lr = m.lr[i] or 0.0
                if ev.quiet.seen:  # every Quiet counter moves only with `seen`
                    ev.quiet = Quiet()
            q = None if moved or ev.last_update < 0 else ev.quiet
            if q is not None:
                q.seen += 1
                if not row.param.requires_grad:
                    q.frozen += 1
                    q.frozen_since = m.index if q.frozen_since < 0 else q.frozen_since
                else:
                    q.frozen_since = -1
            lr_zero = row.group is not None and m.lr[i] == 0
            if lr_zero:
                ev.lr_zero += 1
            if q is not None:
                q.lr_zero += lr_zero
                q.lr_zero_since = (m.index if q.lr_zero_since < 0 else q.lr_zero_since) if lr_zero else -1
                lr = m.lr[i]
                if lr is not None and lr > 0:
                    q.lr_low = min(q.lr_low, lr)
            if decays is not None and decays[i] is not None and not m.skipped:
                self._decay(ev, m, i)
            if not m.has_grad[i]:
                ev.grad_none += 1
                if q is not None:
                    q.grad_none += 1
                continue
            if nonfinite[i] > 0:
                ev.grad_nonfinite += 1
                if self.first_nonfinite is None and not m.skipped:  # a GradScaler overflow skip is routine
                    self.first_nonfinite = NonFinite(step=m.index, name=row.name, count=int(nonfinite[i]))
                if q is not None:
                    q.grad_nonfinite += 1
                    q.first_nonfinite = m.index if q.first_nonfinite < 0 else q.first_nonfinite
            if m.skipped:
                ev.skipped += 1
                if q is not None:
                    q.skipped += 1
                continue
            if nonfinite[i] > 0:
                continue
            if nonzero[i] == 0:
                ev.grad_zero += 1
                if q is not None:
                    q.grad_zero += 1
                continue
            ev.grad_ok += 1
            lr = m.lr[i]
            if upd is not None and row.group is not None and lr is not None and lr > 0 and upd[i] == 0:
                ev.stalled += 1
                if q is not None:
                    q.grad_ok += 1
        self._screen(m)

    @staticmethod
    def _decay(ev: Evidence, m: Measurement, i: int) -> None:
        """Row i's weight decay at measured step `m` (its group's rule known): a step whose lr x weight_decay
        is at least `WIPES` is counted with its update ratio, where measured."""
        lr, wd = m.lr[i], m.weight_decay[i] if m.weight_decay is not None else None
        if lr is None or wd is None:
            return
        ev.decay_steps += 1
        product = lr * wd
        if not product >= WIPES:  # NaN too
            return
        ev.wipe_steps += 1
        ev.wipe_first = m.index if ev.wipe_first < 0 else ev.wipe_first
        if product > ev.wipe_product:
            ev.wipe_product, ev.wipe_lr, ev.wipe_wd = product, lr, wd
        host = m.lists
        if host.has_ratio(i) and host.ratio is not None and math.isfinite(host.ratio[i]):
            ev.wipe_ratio_sum += host.ratio[i]
            ev.wipe_ratio_n += 1

    def _screen(self, m: Measurement) -> None:
        """The set-back screen (see the module docstring): tensors updated at the previous measured step
        whose sum of squares before this one is bit for bit the one before that step start (or continue) a
        `SetBack` streak; any other step of theirs ends it. Host tensors already read, compared whole: a few
        ops a measured step, and Python work only for the tensors in a streak."""
        before, upd = m.before_sumsq, m.update_sumsq
        if before is None or upd is None or before.device.type != "cpu" or upd.device.type != "cpu":
            self._prev = None
            return
        moved = upd > 0 if not m.skipped else torch.zeros(upd.shape, dtype=torch.bool)
        after = m.weight_sumsq
        copied = torch.isfinite(upd)  # a row fingerprinted, not copied, has an update of +inf ("moved")
        if after.device.type == "cpu" and after.shape == upd.shape:
            after = torch.where(copied, after, torch.full_like(after, math.nan))
        else:
            after = torch.full(upd.shape, math.nan, dtype=upd.dtype)
        self._returns(m, before, moved)
        prev, self._prev = self._prev, (m.rows, before, moved, m.index, after)
        if prev is None:
            return
        rows, was, was_moved, index, was_after = prev
        if rows is not m.rows and rows != m.rows:  # element identity first: a C loop over pointers
            self.set_back.clear()  # the table changed: positions differ, start again
            return
        if m.index == index + 1:  # consecutive steps: the values the step found are those the last one left?
            written = torch.logical_and(torch.logical_and(copied, was_moved), before != was_after)
            written &= ~torch.isnan(was_after)
            for i in written.nonzero().flatten().tolist():
                key = m.rows[i].index
                self.written_between.setdefault(key, (index, m.index))
                if key in self._written_once:
                    self.to_watch.append(key)
                self._written_once.add(key)
        same = torch.logical_and(was_moved, before == was)
        hits = set(same.nonzero().flatten().tolist())
        for tracked in [k for k, sb in self.set_back.items() if sb.at not in hits]:
            del self.set_back[tracked]  # it moved on: the streak ends
        for i in hits:
            row = m.rows[i]
            if row.group is None:
                continue
            sb = self.set_back.get(row.index)
            if sb is None:
                measured = self._ev(row).measured - 2  # before `index` (this step and `index` are counted)
                self.set_back[row.index] = SetBack(index, m.index, max(0, measured), i)
            else:
                sb.hits += 1
                sb.pending = True

    def _returns(self, m: Measurement, before: torch.Tensor, moved: torch.Tensor) -> None:
        """The reset screen: rows whose sum of squares before this measured step is, bit for bit, the one before
        the first measured step of these rows, although at a measured step since the optimizer moved them and
        their sum was away from it by more than `_AWAY` of it (a zero start is left out: a zero-initialised
        tensor pruned back to zero is `pruned`). Whole-tensor ops; Python work only for the rows that came
        back."""
        origin = self._origin
        if origin is None or (origin[0] is not m.rows and origin[0] != m.rows) or origin[1].shape != before.shape:
            self._origin = (m.rows, before.clone(), moved.clone(), m.index)
            return
        _, start, since, at = origin
        back = since & (before == start) & (start > 0)
        for i in back.nonzero().flatten().tolist():
            if m.rows[i].group is not None:
                self.returns.setdefault(m.rows[i].index, (at, []))[1].append(m.index)
        # away from the start by far more than the sum's rounding (updates below it leave the sum as it was, and
        # noise-level ones may flip its last bits and back): the sum itself shows the move, so an equal one later
        # is the values coming back, not updates too small to see
        away = (before - start).abs() > _AWAY * start
        self._origin = (m.rows, start, (since & ~back) | (away & moved), at)

    def check_set_back(self, rows: list[Tracked], step: int) -> None:
        """At measured step `step`'s pre-hook (the weights as the step finds them): fingerprint the tensors
        the screen flagged at the last measured step, and compare with the streak's first such fingerprint."""
        todo = [i for i, sb in self.set_back.items() if sb.pending]
        if not todo:
            return
        by_index = {r.index: r for r in rows}
        for index in todo:
            sb = self.set_back[index]
            sb.pending = False
            row = by_index.get(index)
            if row is None or not is_materialized(row.param) or is_sharded(row.param):
                del self.set_back[index]
                continue
            fp = take(row.param)
            if sb.ref is None or sb.ref.shape != fp.shape:
                sb.ref, sb.ref_step, sb.held = fp, step, 0
            elif bool(compare(sb.ref, fp).any()):
                sb.ref, sb.held, sb.moved_on = fp, 0, True
            else:
                sb.held += 1
                if sb.held == 1:  # proven by fingerprints, not only by the screen's sums (updates below their
                    self.to_watch.append(index)  # rounding keep a sum bit for bit): where is the write?

    def changed(self, rows: list[Tracked], provisional: bool = False) -> dict[int, bool]:
        """Whether each tensor's value differs from its first fingerprint; keeps which slices did in
        `slice_changes`. One host copy of all the flags together.

        `provisional` (the tables written during training): a tensor is fingerprinted again only where
        the evidence cannot answer. Never updated at a measured step and no in-place write since its first
        fingerprint (its version counter, which every in-place op bumps, optimizer steps included): its
        first state stands, all slices unchanged, without reading it, so frozen tensors cost nothing.
        Frozen now but updated once: it changed (the ledger says so), and frozen tensors have no
        partly-updated slices. Writes through `.data` bypass the counter: the final table (always
        fingerprinted) catches them."""
        live: list[Tracked] = []
        diffs: list[Changes] = []
        out: dict[int, bool] = {}
        kept: dict[int, Changes] = {}
        todo: list[tuple[Tracked, Fingerprint, torch.Tensor]] = []
        for r in rows:
            ev = self._ev(r)
            first = ev.first_fp
            p = r.param
            if first is None or not is_materialized(p):
                continue
            if provisional and ev.updated and not p.requires_grad:
                continue  # `out` is set below from `updated`
            if provisional and not ev.updated and ev.first_version >= 0 and _version(p) == ev.first_version:
                kept[r.index] = _unchanged(first)
                out[r.index] = False
                continue
            todo.append((r, first, p))
        now = [slice_view(p, p) for _, _, p in todo]  # an FSDP1 slice as its whole rows, as first fingerprinted
        for (r, _, _), ch in zip(todo, changes_all([f for _, f, _ in todo], now)):
            if ch is None:  # resized in place (resize_, a new vocabulary): it changed
                out[r.index] = True
                continue
            live.append(r)
            diffs.append(ch)
        parts = [t for ch in diffs for t in (ch.rows, ch.cols, ch.elems) if t is not None]
        dev = parts[0].device if parts else None
        host = (
            torch.cat([p if p.device == dev else p.to(dev) for p in parts]).cpu()
            if parts
            else torch.zeros(0, dtype=torch.bool)
        )
        at = 0
        self.slice_changes = kept
        spans: list[int] = []  # per tensor, start and end in `host` of its rows (or elements): "changed" is any of them
        for r, ch in zip(live, diffs):
            got: list[torch.Tensor | None] = []
            span = [at, at]
            for t in (ch.rows, ch.cols, ch.elems):
                if t is None:
                    got.append(None)
                    continue
                if t is not ch.cols:
                    span = [at, at + t.numel()]
                got.append(host[at : at + t.numel()])
                at += t.numel()
            spans += span
            self.slice_changes[r.index] = Changes(*got)
        # changed slices before each start and end, in a few ops for all tensors (not a few per tensor)
        below = torch.cat([torch.zeros(1, dtype=torch.int64), host.to(torch.int64).cumsum(0)])
        counts = below[spans].tolist() if spans else []
        for k, r in enumerate(live):
            out[r.index] = counts[2 * k + 1] > counts[2 * k]
        self.back_to_start = set()
        for r in rows:
            if self._ev(r).updated:
                if out.get(r.index) is False and r.index in self.slice_changes and not is_sharded(r.param):
                    self.back_to_start.add(r.index)  # updated, yet every slice is as it was: set back outside
                out[r.index] = True
        return out


def _version(t: torch.Tensor) -> int:
    """The in-place version counter of a parameter (plus its local shard's under DTensor): metadata, no
    read of the values. Any in-place op on the tensor (an optimizer step included) bumps it, and the
    counters only grow, so their sum moves whenever one does."""
    local = local_tensor(t)
    return int(t._version) + (0 if local is t else int(local._version))


def _unchanged(first: Fingerprint) -> Changes:
    """Host flags saying "no slice changed", shaped like `first`'s slices."""

    def none(sig: torch.Tensor | None) -> torch.Tensor | None:
        return None if sig is None else torch.zeros(sig.shape[0], dtype=torch.bool)

    return Changes(none(first.rows), none(first.cols), none(first.elems))
