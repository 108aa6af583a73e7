"""The knob behind a record: the learning-rate scheduler that set a param group's lr to 0 (or far below its
start), the other optimizer that holds a tensor left out of the one gradlog watches, and an embedding's
padding_idx that the batches use as a real token.

A record that says "lr of param group 0 is 0 since step 10 (a scheduler?)" leaves the user to guess which
scheduler and which of its arguments; one that says "in no optimizer param group (added after the optimizer was
built?)" when the tensor sits in a second optimizer whose step() is never called points the wrong way. Both are
answered once, at close, from the objects themselves: the schedulers that refer to the optimizer and the
optimizers that hold the tensor (`gc.get_referrers`, a scan of the heap paid only when such a record exists),
with their arguments read from their attributes. Nothing is set on them.
"""

from __future__ import annotations

import dataclasses
import gc
import math
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import torch

from gradlog.measure.trace import PaddingUse, _code_site
from gradlog.verdict.causes import FILTERED
from gradlog.verdict.report import NeverUpdated, PartlyUpdated, Reason, Stalled

R = TypeVar("R", NeverUpdated, Stalled, PartlyUpdated)

#: a scheduler's attributes that are its state, not its arguments
_STATE = frozenset({"last_epoch", "verbose", "optimizer", "base_lrs", "lr_lambdas", "warmup_steps"})
#: an lr this many times below the one the scheduler started from is a knob's doing (as `stalled.LR_CUT`)
LR_FALL = 1e3
#: the reasons whose tensors stop moving when the lr falls: 0, or updates below the value's resolution
_LR_REASONS = frozenset({Reason.ZERO_LR, Reason.TINY_UPDATE, Reason.BELOW_PRECISION})


def schedulers(optimizer: torch.optim.Optimizer) -> list[Any]:
    """The learning-rate schedulers stepping `optimizer` (outermost only: a SequentialLR's parts are said in it)."""
    base = torch.optim.lr_scheduler.LRScheduler
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau
    found = [r for r in _owners(optimizer, "optimizer") if isinstance(r, (base, plateau)) and r.optimizer is optimizer]
    inner = {id(s) for r in found for s in getattr(r, "_schedulers", ())}
    return [r for r in found if id(r) not in inner]


def _owners(value: Any, attribute: str) -> list[Any]:
    """The objects whose `attribute` is `value`: its referrers, or the owners of the instance dicts that refer to
    it (CPython keeps an instance's attributes inline until its `__dict__` is asked for, then in a dict)."""
    out = []
    for r in gc.get_referrers(value):
        if isinstance(r, dict):
            if r.get(attribute) is value:
                out += [o for o in gc.get_referrers(r) if getattr(o, "__dict__", None) is r]
        elif getattr(r, attribute, None) is value:
            out.append(r)
    return out


def describe(scheduler: Any, group: int = 0) -> str:
    """ "LinearLR(start_factor=1.0, end_factor=0.0, total_iters=10)": the class and its arguments as its
    attributes hold them (a LambdaLR's function for `group` by its file and line; a SequentialLR's parts and
    milestones)."""
    args = []
    for key, value in vars(scheduler).items():
        if key.startswith("_") or key in _STATE:
            continue
        if isinstance(value, (bool, int, float, str)) or (
            isinstance(value, (list, tuple)) and all(isinstance(v, (int, float)) for v in value) and len(value) <= 8
        ):
            args.append(f"{key}={value!r}")
    fns = list(getattr(scheduler, "lr_lambdas", None) or [])
    if fns:
        site = _code_site(fns[min(group, len(fns) - 1)])
        args.append(f"lr_lambda at {site.quoted()}" if site else "lr_lambda")
    parts = getattr(scheduler, "_schedulers", None)
    if parts:
        args.append("[" + ", ".join(describe(s, group) for s in parts) + "]")
        args.append(f"milestones={list(getattr(scheduler, '_milestones', []))!r}")
    return f"{type(scheduler).__name__}({', '.join(args)})"


def _zero_knobs(scheduler: Any) -> list[str]:
    """Its arguments at 0 that take the lr to 0 (end_factor, gamma, a floor), all parts of a SequentialLR's too."""
    names = ("end_factor", "gamma", "factor", "eta_min", "min_lr", "end_lr", "power")
    out = [f"{k}={getattr(scheduler, k)!r}" for k in names if getattr(scheduler, k, None) in (0, 0.0)]
    out = [k for k in out if not k.startswith(("eta_min", "min_lr", "power"))]  # a floor of 0 alone is the default
    for s in getattr(scheduler, "_schedulers", None) or []:
        out += _zero_knobs(s)
    return out


def _said(scheduler: Any, group: int, steps: int) -> str:
    """What one scheduler did to a group's lr, with the evidence: its arguments, the lr it set last, how often it
    was stepped against the optimizer's steps, and the argument at 0 that explains an lr of 0."""
    last = list(getattr(scheduler, "_last_lr", None) or [g["lr"] for g in scheduler.optimizer.param_groups])
    base = list(getattr(scheduler, "base_lrs", None) or [])
    lr = last[group] if group < len(last) else float("nan")
    said = f"its lr comes from {describe(scheduler, group)}, which set group {group}'s lr to {lr:.3g}"
    if group < len(base) and base[group]:
        said += f" (from {base[group]:.3g})"
    stepped = int(getattr(scheduler, "last_epoch", 0) or 0)
    if stepped > steps + 1:
        said += (
            f"; it was stepped {stepped} times in {steps} optimizer steps: step it once per optimizer step "
            "(not per batch of an accumulation, nor in an inner loop)"
        )
    zero = _zero_knobs(scheduler)
    if zero and lr == 0:
        said += f"; fix: {', '.join(zero)} takes the lr to 0: give it a value > 0"
    elif lr == 0 and getattr(scheduler, "lr_lambdas", None):
        said += "; fix: its lr_lambda returns 0 there (the lr is the start lr times lr_lambda(step)): return > 0"
    elif lr == 0 and stepped <= steps + 1:
        said += "; fix: check its arguments: the schedule reaches lr 0 before the run ends"
    elif lr > 0 and group < len(base) and lr * LR_FALL <= base[group]:
        said += (
            f"; fix: it holds the lr {base[group] / lr:.2g} times below its start, so the updates vanish: check "
            "its factor (a warm-up longer than the run, a decay meant per epoch stepped per batch)"
        )
    return said


def explain_lr(records: Sequence[R], groups: Mapping[str, int | None], optimizer: Any, steps: int) -> list[R]:
    """`records` with the scheduler named in each whose tensors stopped at lr 0 (`zero_lr`), or whose updates
    fell below the value's resolution (`tiny_update`, `below_precision`) where a scheduler cut the group's lr
    `LR_FALL` times below where it began. `groups`: tensor name -> param group; `steps`: optimizer steps."""
    if optimizer is None or not any(r.reason in _LR_REASONS for r in records):
        return list(records)
    found = schedulers(optimizer)
    if not found:
        return list(records)
    out = []
    for rec in records:
        group = groups.get(rec.name)
        if rec.reason not in _LR_REASONS or group is None:
            out.append(rec)
            continue
        if rec.reason != Reason.ZERO_LR and not _cut(found, group):
            out.append(rec)
            continue
        said = "; ".join(_said(s, group, steps) for s in found)
        detail = rec.detail.replace(" (a scheduler?)", "")
        out.append(dataclasses.replace(rec, detail=f"{detail}; {said}"))
    return out


def _cut(found: Sequence[Any], group: int) -> bool:
    """A scheduler set the group's lr at least `LR_FALL` times below where it began."""
    for s in found:
        last, base = getattr(s, "_last_lr", None), getattr(s, "base_lrs", None)
        if last and base and group < len(last) and group < len(base) and base[group] > 0:
            if not math.isfinite(last[group]) or last[group] * LR_FALL <= base[group]:
                return True
    return False


def holders(param: torch.Tensor, watched: Any) -> list[tuple[torch.optim.Optimizer, int]]:
    """The optimizers other than `watched` whose param groups hold `param`, each with the group's index: a
    tensor gradlog's optimizer leaves out may be a second optimizer's (whose step() the loop never calls)."""
    out = []
    for held in gc.get_referrers(param):
        if not isinstance(held, list):
            continue
        for group in gc.get_referrers(held):
            if not isinstance(group, dict) or group.get("params") is not held:
                continue
            for groups in gc.get_referrers(group):
                if not isinstance(groups, list):
                    continue
                for opt in _owners(groups, "param_groups"):
                    if isinstance(opt, torch.optim.Optimizer) and opt is not watched:
                        out.append((opt, next(i for i, g in enumerate(groups) if g is group)))
    return out


def explain_left_out(
    records: Sequence[NeverUpdated], params: Mapping[str, torch.Tensor], optimizer: Any
) -> list[NeverUpdated]:
    """`records` with the other optimizer named in each `not_in_optimizer` one whose tensor a second optimizer
    holds: it never moved the tensor, so its step() never ran (or has lr 0 there)."""
    out = []
    for rec in records:
        p = params.get(rec.name)
        found = holders(p, optimizer) if rec.reason == Reason.NOT_IN_OPTIMIZER and p is not None else []
        if not found:
            out.append(rec)
            continue
        opt, group = found[0]
        detail = rec.detail.replace(
            "in no optimizer param group (added after the optimizer was built?)",
            "in no param group of the optimizer gradlog watches",
        )
        said = (
            f"; it is in param group {group} of another optimizer ({type(opt).__name__}, lr "
            f"{opt.param_groups[group].get('lr', float('nan')):.3g}), which never moved it: its step() is never "
            "called (or its lr is 0); fix: call that optimizer's step() too, or put the tensor in the optimizer "
            "gradlog watches (a GradLogger watches one optimizer: give the other its own)"
        )
        out.append(dataclasses.replace(rec, detail=detail + said))
    return out


#: the guess a `not_in_optimizer` record's detail makes when nothing better is known
_ADDED_LATER = "in no optimizer param group (added after the optimizer was built?)"


def explain_filtered(records: Sequence[NeverUpdated], groups: Mapping[str, int | None]) -> list[NeverUpdated]:
    """`records` with a filter on names named in the `not_in_optimizer` ones it explains: the tensors of one
    attribute name (every `bias`) left out of the optimizer in two or more modules whose other tensors are in
    it. A module's tensors are made together, so "added after the optimizer was built" does not fit them; a
    param-group list built with a name test that misses them (`"Bias" in n`, `n.endswith("bias")` on the
    wrong group) does. `groups`: every tracked tensor's name -> its param group (None: in none)."""
    left: dict[str, list[NeverUpdated]] = {}
    for rec in records:
        if rec.reason == Reason.NOT_IN_OPTIMIZER and rec.detail.startswith(_ADDED_LATER) and "." in rec.name:
            left.setdefault(rec.name.rsplit(".", 1)[1], []).append(rec)
    explained: dict[str, str] = {}
    for attr, recs in left.items():
        siblings = {}
        for rec in recs:
            module = rec.name.rsplit(".", 1)[0]
            inside = [(n, g) for n, g in groups.items() if g is not None and n.rsplit(".", 1)[0] == module and "." in n]
            if inside:
                siblings[rec.name] = inside
        if len(siblings) < 2:
            continue
        names = list(siblings)
        shown = ", ".join(names[:4]) + (f", ... ({len(names)})" if len(names) > 4 else "")
        in_groups = sorted({g for inside in siblings.values() for _, g in inside if g is not None})
        said = (
            f"in no optimizer param group, {FILTERED}: every `{attr}` of {len(names)} modules ({shown}) is in "
            f"none, while their modules' other tensors are in param group{'s' if len(in_groups) > 1 else ''} "
            f"{', '.join(map(str, in_groups))}: tensors made together with the ones the optimizer holds, so not "
            "added later; the list the optimizer was built from dropped them by name; fix: check the name test "
            f"that builds the param groups (a typo or the wrong case: `{attr}`), so every tensor lands in one group"
        )
        for name in names:
            explained[name] = said
    return [
        dataclasses.replace(r, detail=r.detail.replace(_ADDED_LATER, explained[r.name], 1))
        if r.name in explained
        else r
        for r in records
    ]


def explain_padding(records: Sequence[PartlyUpdated], found: Mapping[str, PaddingUse]) -> list[PartlyUpdated]:
    """`records` with the evidence against a `padding_idx` row that the first batch used as a real token: its id
    between other ids in at least half of the sequences (and two), where padding never sits. `found`: the
    embedding's module name -> how the first batch used its padding id (`gradlog.measure.trace.PaddingWatch`)."""
    out = []
    for rec in records:
        use = found.get(rec.name.rsplit(".", 1)[0]) if rec.reason == Reason.PADDING_IDX else None
        if use is None or use.inside < 2 or 2 * use.inside < use.rows:
            out.append(rec)
            continue
        said = (
            f"; but id {use.padding_idx} was {use.share:.0%} of the first batch's ids and sat between other ids in "
            f"{use.inside} of {use.rows} sequences, where padding never sits (it fills a sequence's start or end): "
            f"if {use.padding_idx} is a real token, padding_idx={use.padding_idx} keeps its row from learning; fix: "
            "pass the padding id your tokenizer uses (tokenizer.pad_token_id)"
        )
        out.append(dataclasses.replace(rec, detail=rec.detail + said))
    return out
