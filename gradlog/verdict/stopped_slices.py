"""At close: rows, columns, elements and experts that had a gradient, then none from some step on.

`partly_updated` names the slices that never changed over the whole run; a unit that learned for 30
steps and then died is not among them. The meter keeps, per slice, the last measured step whose
gradient was non-zero there, that step's ordinal among the measured steps its tensor had a gradient at,
and at how many of those it was non-zero (`SliceGrads.last_rows`, `ord_rows`, `hits_rows`: 12 bytes per
row and per column of a tensor with 2+ dims, per element of a 1-D one). A slice is reported as stopped when

- it had a non-zero gradient at some measured step (never: `partly_updated`'s finding),
- the tensor kept getting a non-zero gradient elsewhere on at least `MIN_QUIET_STEPS` (4) measured
  steps after the slice's last one, and `MIN_QUIET_FRACTION` (20%) of all measured steps, and
- that silence is evidence: a slice non-zero at c of the m measured steps (its tensor had a gradient at)
  up to its last one, then silent at the n after, is called stopped only when a slice firing at random at
  any steady rate would show this with chance below `MAX_CHANCE` (1e-3): C(m, c) / C(m + n, c), about
  (1 - p)^n for p = c / (m + n) (`gradlog.verdict.silence`). A ReLU unit that fires on 10% of steps is silent for 4,
  or 20, measured steps all the time; a unit seen on 12 of 20 steps, then on none of 40, is not.

What a measured step sees is that step's gradient only: with ``every=k`` a slice used on unmeasured
steps and never on measured ones looks silent, and the step it stopped is known to the measured step:
after `last_grad_step`, no later than `since_step`. Rows of an `nn.Embedding` are not judged (ids stop
appearing in batches all the time); a run with `MIN_QUIET_STEPS` or fewer measured steps cannot
tell a stopped slice from a quiet one and reports none. A resumed run's slices silent through the whole
new segment (`silent_slices`) are judged by their quiet steps alone: this segment never saw them fire.

Reasons, most specific first:
- `not_routed`: experts (dim 0 of a fused expert tensor, `gradlog.verdict.experts`) whose router rows
  (a 2-D tensor of the same MoE block with one row per expert) stopped at the same step too;
- `dead_units`: the same indices stopped at the same step in two or more tensors of one block (a
  layer's weight rows or columns, its bias, the next layer's input rows or columns): units that no
  longer fire (a ReLU driven negative);
- `zero_grad`: otherwise; the question names what the slice is (an input feature: an input that went
  to zero, dead units upstream).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from gradlog.measure.distributed import Reducer, is_sharded
from gradlog.measure.flat_shards import flat_shard
from gradlog.measure.owners import Owners
from gradlog.measure.params import Tracked, is_materialized, local_tensor
from gradlog.measure.slice_grads import SliceGrads
from gradlog.runformat.cells import DIM_NAMES
from gradlog.verdict.ledger import StepIndex
from gradlog.verdict.records import format_ranges
from gradlog.verdict.report import Reason, StoppedSlice
from gradlog.verdict.silence import MAX_CHANCE, chance_silent, evidence_words
from gradlog.verdict.slices import share_words, slice_kind, words_key

#: a slice is stopped after at least this many quiet measured steps, and this share of all measured steps:
#: a stricter bar than a whole tensor's (`gradlog.verdict.stalled`: 3 and 10%), as a model has many slices
#: and each is noisier: a ReLU unit fed a batch of 5 was quiet 3 steps in a row by chance in a 12-step run
MIN_QUIET_STEPS = 4
MIN_QUIET_FRACTION = 0.2

#: the reasons the verdict weighs by their share of the layer (`gradlog.verdict.policy.DEAD_REASONS`)
_WEIGHED = (Reason.ZERO_GRAD, Reason.DEAD_UNITS, Reason.NOT_ROUTED)

#: at most this many records (groups by stop step) per tensor and dim; later groups fold into the last, which
#: then spans several stop steps: `last_grad_step` is its earliest last step, `since_step` its latest since
MAX_GROUPS = 16

_NOUNS: dict[tuple[str, int | None], tuple[str, str]] = {
    ("linear.weight", 0): ("output units", "units that stopped firing (a ReLU driven negative?)"),
    ("linear.weight", 1): ("input features", "inputs that went to zero (dead units upstream?)"),
    ("linear.bias", None): ("units", "units that stopped firing (a ReLU driven negative?)"),
    ("conv.weight", 0): ("filters", "filters that stopped firing"),
    ("conv.weight", 1): ("input channels", "input channels that went to zero (dead filters upstream?)"),
    ("conv.bias", None): ("filters", "filters that stopped firing"),
    ("experts", 0): ("experts", "no token routed to them any more (a collapsed router?)"),
}


@dataclass
class _Evidence:
    """What a group of slices showed: silent on the last `silent` measured steps their tensor had a gradient
    at (to its last one), non-zero on `lo`..`hi` of the `seen` before (to their last non-zero one, included);
    `chance`: the largest of their `chance_silent`."""

    silent: int
    seen: int
    lo: int
    hi: int
    chance: float

    def merged(self, other: _Evidence) -> _Evidence:
        """Two groups folded into one (`MAX_GROUPS`): the weaker evidence of each."""
        return _Evidence(
            min(self.silent, other.silent),
            min(self.seen, other.seen),
            min(self.lo, other.lo),
            max(self.hi, other.hi),
            max(self.chance, other.chance),
        )

    def words(self) -> str:
        """ "silent for 40 measured steps; active on 60% (12) of the 20 before; chance 9e-08 ..."."""
        return evidence_words(self.silent, self.seen, self.lo, self.hi, self.chance, "a slice")


@dataclass
class _Group:
    row: Tracked
    dim: int | None
    kind: str
    indices: list[int]
    since: int
    last: int
    total: int
    evidence: _Evidence
    folded: bool = False


def _words(kind: str, dim: int | None) -> tuple[str, str]:
    return _NOUNS.get(words_key(kind, dim), (DIM_NAMES[dim], "zero gradient since (masked, or multiplied by 0?)"))


def _block(name: str) -> str:
    """The block two records must share to be paired: the name less its module and attribute."""
    parts = name.split(".")
    return ".".join(parts[:-2])


#: per tensor (`Tracked.index`), per dim (0 rows, 1 columns, None elements): an int64 [3, n] per dim, its rows
#: each slice's last measured step with a non-zero gradient (-1 for none), that step's ordinal among the measured
#: steps the tensor had a gradient at (1-based, 0 for none), and at how many of those it was non-zero
Lasts = dict[int, dict[int | None, torch.Tensor]]
STEP, ORD, HITS = 0, 1, 2


def _dims(row: Tracked) -> tuple[int | None, ...]:
    return (0, 1) if len(row.shape) >= 2 else (None,)  # the whole tensor's (an FSDP1 slice is 1-D)


def _fill(vec: torch.Tensor | None, n: int, value: int, floor: int, device: torch.device) -> torch.Tensor:
    """One evidence vector (`SliceGrads`), made where it was never needed and with its host part folded in:
    max(vector, floor) for a last step or ordinal, vector + floor for a count (`value` < 0: add)."""
    if vec is None:
        return torch.full((n,), max(floor, 0) if value >= 0 else floor, dtype=torch.int64, device=device)
    vec = vec.to(torch.int64)
    return vec + floor if value < 0 else vec.clamp(min=floor)


def last_steps(rows: Sequence[Tracked], grads: SliceGrads) -> Lasts:
    """This process's evidence vectors (its shards' slices under FSDP2/DTensor), the host parts (`all_at`,
    `all_seen`, `all_hits`) folded in, on their device. A plain tensor with no vector (every slice non-zero at
    every step it was looked at) is left out: nothing of it stopped. A sharded one is always in: its ranks
    combine their vectors."""
    out: Lasts = {}
    for row in rows:
        if not row.param.requires_grad or not is_materialized(row.param) or not row.shape:
            continue
        key = row.index
        r, c = grads.last_rows.get(key), grads.last_cols.get(key)
        at = grads.all_at.get(key, -1)
        sharded = is_sharded(row.param)
        if r is None and not (sharded and at >= 0):
            continue
        shard = flat_shard(row.param)  # an FSDP1 slice's evidence is of its whole rows (`FlatShard.rows`)
        local = local_tensor(row.param)
        shape = shard.view_shape if shard is not None else local.shape
        seen, hits = grads.all_seen.get(key, 0), grads.all_hits.get(key, 0)
        found: dict[int | None, torch.Tensor] = {}
        vectors = (
            (r, grads.ord_rows.get(key), grads.hits_rows.get(key)),
            (c, grads.ord_cols.get(key), grads.hits_cols.get(key)),
        )
        for dim, (last, order, count) in zip(_dims(row), vectors):
            n, dev = shape[dim or 0], local.device
            found[dim] = torch.stack(
                [_fill(last, n, 0, at, dev), _fill(order, n, 0, seen, dev), _fill(count, n, -1, hits, dev)]
            )
        out[key] = found
    return out


def global_last_steps(rows: Sequence[Tracked], lasts: Lasts, reducer: Reducer) -> Lasts:
    """Sharded tensors' vectors at their global indices, combined over ranks: a slice's last step and ordinal
    are the latest any rank saw, its count the largest (a lower bound on the steps any shard of it was non-zero:
    the evidence for a stop never grows by combining). One all_reduce(MAX); every rank passes the same items."""
    items: list[tuple[Tracked, int | None, torch.Tensor | None]] = []
    for row in rows:
        if not is_sharded(row.param) or not row.param.requires_grad or not row.shape:
            continue
        mine = lasts.get(row.index, {})
        for dim in _dims(row):
            vec = mine.get(dim)
            for k in (STEP, ORD, HITS):  # + 1: 0 means never, or not here
                items.append((row, dim, None if vec is None else vec[k].to(torch.float64) + 1))
    merged = reducer.global_slices(items, values=True)
    out = dict(lasts)
    for at in range(0, len(items), 3):
        row, dim, _ = items[at]
        parts = merged[at : at + 3]
        if any(v is None for v in parts):
            out.pop(row.index, None)
            continue
        out.setdefault(row.index, {})[dim] = torch.stack([v - 1 for v in parts if v is not None]).to(torch.int64)
    by_index = {r.index: r for r in rows}
    return {k: v for k, v in out.items() if all(d in v for d in _dims(by_index[k]))}  # every dim, or none


def stopped_slices(
    rows: Sequence[Tracked],
    lasts: Lasts,
    steps: StepIndex,
    measured_steps: int,
    owners: Owners,
    exclude: set[str] | frozenset[str] = frozenset(),
    resumed_at: int | None = None,
) -> list[StoppedSlice]:
    """One record per tensor, dim, stop step and reason, in model order; `owners`: the tensors' owning
    modules, which name the slices; `exclude` names tensors already reported whole (never updated,
    stalled); `resumed_at`: the slices stopped at a resume at that step (`silent_slices`), which their
    detail says, judged by quiet steps alone (this segment did not see them fire). One host copy for all
    the evidence vectors."""
    need = max(MIN_QUIET_STEPS, math.ceil(MIN_QUIET_FRACTION * measured_steps))
    if measured_steps <= need:
        return []  # cannot tell: too few measured steps for any slice to be quiet long enough
    keys: list[tuple[Tracked, int | None]] = []
    parts: list[torch.Tensor] = []
    for row in rows:
        vecs = lasts.get(row.index)
        if vecs is None or row.name in exclude:
            continue
        for dim, vec in vecs.items():
            keys.append((row, dim))
            parts.append(vec)
    if not parts:
        return []
    dev = parts[0].device
    flat = torch.cat([p.to(dev, torch.int64) for p in parts], dim=1).cpu()
    groups: list[_Group] = []
    at = 0
    for (row, dim), part in zip(keys, parts):
        n = part.shape[1]
        ev = flat[:, at : at + n]
        at += n
        if n and not (slice_kind(owners.get(row.index), row) == "embedding.weight" and dim == 0):
            groups += _groups(row, dim, slice_kind(owners.get(row.index), row), ev, steps, need, resumed_at)
    return _records(groups, resumed_at)


def _groups(
    row: Tracked, dim: int | None, kind: str, ev: torch.Tensor, steps: StepIndex, need: int, resumed_at: int | None
) -> list[_Group]:
    """One tensor's stopped slices along `dim` (rows of `ev`: see `Lasts`), grouped by their last step.
    (Embedding rows are never judged: ids leave the batches all the time.)"""
    last, order, hits = ev[STEP], ev[ORD], ev[HITS]
    tensor_last, top = int(last.max()), int(order.max())
    cand = (last >= 0) & (last < tensor_last)
    if resumed_at is None:  # the evidence: a steady slice would rarely be this silent
        chance = chance_silent(order, top - order, hits)
        cand &= chance < MAX_CHANCE
    if not bool(cand.any()):
        return []
    quiet_after_tensor = steps.after(tensor_last)[0]
    found: list[_Group] = []
    for v in torch.unique(last[cand]).tolist():  # the distinct last steps, ascending
        quiet, since, _ = steps.after(v)
        if quiet - quiet_after_tensor < need:
            continue
        sel = cand & (last == v)
        idx = sel.nonzero().flatten().tolist()
        seen, silent = int(order[sel].max()), top - int(order[sel].max())
        hit = hits[sel]
        worst = 1.0 if resumed_at is not None else float(chance_silent(order[sel], top - order[sel], hit).max())
        ev_ = _Evidence(silent, seen, int(hit.min()), int(hit.max()), worst)
        if len(found) == MAX_GROUPS:
            g = found[-1]
            g.indices = sorted(g.indices + idx)
            g.since, g.folded = since, True  # v ascends: the latest since; `last` stays the earliest
            g.evidence = g.evidence.merged(ev_)
            continue
        found.append(_Group(row, dim, kind, idx, since, v, ev.shape[1], ev_))
    return found


def silent_slices(
    rows: Sequence[Tracked],
    lasts: Lasts,
    steps: StepIndex,
    measured_steps: int,
    owners: Owners,
    before: int,
    exclude: set[str] | frozenset[str] = frozenset(),
) -> list[StoppedSlice]:
    """A resumed run's slices with no non-zero gradient at any measured step of this segment while the
    rest of their tensor had one, as if they stopped right after `before` (the earlier segments' last
    step): what this segment alone cannot call stopped (it never saw them move). The same rules and reasons
    as `stopped_slices` (quiet long enough, embedding rows left out, dead units paired across tensors)."""
    shifted: Lasts = {}
    for index, vecs in lasts.items():
        # silent slices "stopped" after `before`; every other slice is set to the tensor's last step (no finding)
        shifted[index] = {
            d: torch.where(v[STEP] < 0, torch.full_like(v, before), v.amax(1, keepdim=True).expand_as(v))
            for d, v in vecs.items()
        }
    return stopped_slices(rows, shifted, steps, measured_steps, owners, exclude, resumed_at=before + 1)


def _records(groups: list[_Group], resumed_at: int | None = None) -> list[StoppedSlice]:
    """Reasons from pairing (see the module docstring), then the records."""
    by_key: dict[tuple[str, int, int, tuple[int, ...]], list[_Group]] = {}
    for g in groups:
        by_key.setdefault((_block(g.row.name), g.total, g.since, tuple(g.indices)), []).append(g)
    out: list[StoppedSlice] = []
    for g in groups:
        noun, question = _words(g.kind, g.dim)
        key = (_block(g.row.name), g.total, g.since, tuple(g.indices))
        peers = [p for p in by_key[key] if p is not g]
        reason = Reason.ZERO_GRAD
        extra = ""
        if g.kind == "experts":
            layer = g.row.name.rsplit(".", 1)[0]
            parent = layer.rsplit(".", 1)[0] if "." in layer else ""
            router = [
                p
                for p in groups
                if p.kind != "experts"
                and p.dim == 0
                and p.total == g.total
                and p.row.name.startswith(parent + ".")
                and set(g.indices) <= set(p.indices)
                and p.since <= g.since
            ]
            if router:
                reason = Reason.NOT_ROUTED
                extra = f"; the router's rows for them ({router[0].row.name}) stopped too: no token is routed to them"
        elif g.dim == 0 and (routed := _routed(g, groups)) is not None:
            reason = Reason.NOT_ROUTED
            extra = f"; the same experts stopped in {routed.row.name}: the router no longer picks them"
        elif peers:
            reason = Reason.DEAD_UNITS
            named = ", ".join(f"{p.row.name} {_words(p.kind, p.dim)[0]}" for p in peers[:4])
            extra = f"; the same {len(g.indices)} stopped in {named}: dead units (a ReLU driven negative?)"
        what = (
            f"{noun if len(g.indices) > 1 else noun[:-1]} {format_ranges(g.indices, 8)} ({len(g.indices)} of {g.total})"
        )
        if resumed_at is not None:  # all of them at the resume (`silent_slices`): their last step is not known
            when = (
                f" had a non-zero gradient before the resume at step {resumed_at} and none at any measured step since"
            )
        elif g.folded:
            when = (
                f": last non-zero gradients at different measured steps from step {g.last} on, none at any measured "
                f"step from step {g.since} on at the latest; {g.evidence.words()};"
            )
        else:
            when = (
                f": last non-zero gradient at measured step {g.last}, none at any measured step from step {g.since} "
                f"on; {g.evidence.words()};"
            )
        share = f"; {share_words(len(g.indices), g.total, noun)}" if reason in _WEIGHED else ""
        detail = f"{what}{when} the rest of the tensor kept learning ({question}){extra}{share}"
        last = g.last if resumed_at is None else -1  # at or before the resume: which step is not known
        out.append(
            StoppedSlice(g.row.name, g.dim, len(g.indices), g.total, tuple(g.indices), g.since, last, reason, detail)
        )
    return out


def cut(s: StoppedSlice, indices: set[int]) -> StoppedSlice:
    """`s` cut to `indices` (a resumed run: some of its slices learned again, or were already counted), its
    detail's opening ("<noun> <ranges> (<n> of <total>)", as `_records` writes it) and its count of peers said
    again for them. A detail of another form (an older gradlog's) keeps its text after a new opening."""
    idx = tuple(sorted(indices))
    if idx == s.indices:
        return s
    opening = f"{format_ranges(s.indices, 8)} ({len(s.indices)} of {s.total})"
    at = s.detail.find(" " + opening)
    if at > 0:
        noun, rest = s.detail[:at], s.detail[at + 1 + len(opening) :]
        noun = noun[:-1] if len(idx) == 1 and len(s.indices) > 1 and noun.endswith("s") else noun
    else:
        noun, rest = s.slices, ": " + s.detail
    rest = re.sub(r"; the same \d+ stopped in", f"; the same {len(idx)} stopped in", rest)
    rest = re.sub(r"; [\d.]+% of the layer's ", f"; {100 * len(idx) / max(s.total, 1):.1f}% of the layer's ", rest)
    what = f"{noun} {format_ranges(idx, 8)} ({len(idx)} of {s.total})"
    return replace(s, indices=idx, stopped=len(idx), detail=what + rest)


def _routed(g: _Group, groups: list[_Group]) -> _Group | None:
    """The experts group that the router-like group `g` (one row per expert, in the same MoE block) matches."""
    block = _block(g.row.name)
    for p in groups:
        if p.kind == "experts" and p.total == g.total and p.since >= g.since and set(p.indices) <= set(g.indices):
            layer = p.row.name.rsplit(".", 1)[0]
            if layer.rsplit(".", 1)[0] == block:
                return p
    return None
