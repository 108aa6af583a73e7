"""At close: the rows, columns and elements of a tensor that never learned while the rest of it did.

Inputs are host-side bool vectors per tensor (made global under FSDP2/DTensor before they get
here): which slices changed since the tensor was first seen (exact, from the per-slice
fingerprints) and which ever had a non-zero gradient on a measured step. A slice is reported when

- its values never changed, or
- it changed, but its gradient was zero at every measured step with a gradient, its param group has
  weight decay, and the optimizer's running gradient statistics (Adam's `exp_avg_sq`, momentum), where
  it keeps them, are zero there too (no unmeasured step gave it a gradient either): it moved only by
  decay, it did not learn (the whole-tensor diagnosis does the same).

The reason comes from the owning module: an `nn.Embedding`'s `padding_idx` row is intentional,
its other zero-gradient rows are ids never in a batch; Linear/Conv rows are dead units/filters and
the columns of the next layer are inputs that are always zero. A slice with a non-zero gradient
that never changed lost its update to rounding (bf16/fp16).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from gradlog.measure.distributed import Reducer, is_sharded
from gradlog.measure.fingerprint import Changes
from gradlog.measure.flat_shards import slice_view
from gradlog.measure.owners import Owner, Owners
from gradlog.measure.params import Tracked
from gradlog.measure.slice_grads import SliceGrads, slice_nonzero
from gradlog.measure.slice_moves import SliceMoves
from gradlog.runformat.cells import DIM_NAMES
from gradlog.verdict.experts import is_fused_experts
from gradlog.verdict.ledger import Evidence
from gradlog.verdict.overwritten import set_back_again, set_back_slices, zeroed_after_learning
from gradlog.verdict.records import format_ranges
from gradlog.verdict.report import PartlyUpdated, Reason
from gradlog.verdict.rounding import unmoved


@dataclass
class SliceFacts:
    """Per tensor, host bool vectors: `changed` (values differ from the start) and `nonzero` (gradient
    non-zero at some measured step; None when no measured step saw a gradient) per slice kind."""

    changed: dict[int | None, torch.Tensor]  # dim 0 rows, dim 1 columns, None elements
    nonzero: dict[int | None, torch.Tensor | None]
    #: from the optimizer's running gradient statistics (Adam's exp_avg_sq, momentum, ...): the slice
    #: had a non-zero gradient at SOME step, measured or not (None: the optimizer keeps no such state)
    state: dict[int | None, torch.Tensor | None] = field(default_factory=dict)
    #: per slice, moved by the optimizer at one of the tensor's first measured steps (`measure.slice_moves`),
    #: and those steps (empty: not watched); a slice so moved whose values never changed was set back
    moved: dict[int | None, torch.Tensor | None] = field(default_factory=dict)
    moved_at: tuple[int, ...] = ()
    #: per slice, moved at one watched step and as it was before it before the next (`SliceMoves.set_back`):
    #: set back outside the optimizer, whatever its first value; and the first such pair of steps
    back: dict[int | None, torch.Tensor | None] = field(default_factory=dict)
    back_at: tuple[int, int] | None = None
    #: per slice, moved at one watched step and still moved before the next (`SliceMoves.kept`): it learned
    kept: dict[int | None, torch.Tensor | None] = field(default_factory=dict)


# what a slice is called, by owning module type and dim: (plural noun, zero-gradient question)
_WORDS: dict[tuple[str, int | None], tuple[str, str]] = {
    ("linear.weight", 0): ("output units", "dead units (a ReLU that never fires?)"),
    ("linear.weight", 1): ("input features", "inputs always zero (dead units upstream?)"),
    ("linear.bias", None): ("units", "dead units (a ReLU that never fires?)"),
    ("conv.weight", 0): ("filters", "dead filters (a ReLU that never fires?)"),
    ("conv.weight", 1): ("input channels", "input channels always zero (dead filters upstream?)"),
    ("conv.bias", None): ("filters", "dead filters (a ReLU that never fires?)"),
    ("embedding.weight", 0): ("rows", "ids never in a batch?"),
    ("embedding.weight", 1): ("columns", "embedding dims with no gradient"),
    ("experts", 0): ("experts", "no token routed to them (a collapsed router, or too few tokens?)"),
}
#: a position-embedding table by its usual names (GPT-2's wpe, BERT's position_embeddings, BART's embed_positions)
_POSITIONS = re.compile(r"(^|\.)(wpe|position_embeddings?|pos_embed\w*|pos_emb\w*|embed_positions)(\.weight)?$")
#: an embedding used as a table of buckets, not of token ids: T5's relative_attention_bias, DeBERTa's
#: rel_embeddings, relative-position tables by their usual names
_BUCKETS = re.compile(
    r"(^|\.)(relative_attention_bias|rel_embeddings|relative_positions?\w*|rel_pos\w*|\w*buckets?)(\.weight)?$"
)
#: ids a note shows before it says how many more there are
_IDS_SHOWN = 5


def _counted(k: int, noun: str, plural: str = "") -> str:
    """ "id" for one, "ids" for more (`plural` when not noun + "s")."""
    return noun if k == 1 else plural or noun + "s"


def unseen_words(name: str, indices: Sequence[int], total: int, *, one_batch: bool = False) -> str:
    """What embedding rows no batch reached usually are, in words: positions past the longest sequence (or
    a causal LM's last position, said as the possibility it is: gradlog does not know the labels), buckets
    of a relative-position table that no query-key distance used, or ids (tokens, items) that no batch
    contained. `one_batch`: the rows are those of the one batch `gradlog.check` tried, not of a run's
    measured batches, and the words say so ("not in this batch")."""
    idx = sorted(indices)
    k = len(idx)
    last = total - 1
    batches = "this batch" if one_batch else "any measured batch"
    if _POSITIONS.search(name) and idx and idx[-1] == last and idx == list(range(idx[0], total)):
        a = idx[0]
        if a == last:
            return (
                f"position {last} had no gradient in {batches}: no sequence reached it, or it was only ever a "
                "sequence's last position, which has no target in a causal LM whose labels are its inputs"
            )
        return (
            f"positions {a}-{last} ({k} of {total}) had no gradient in {batches}: the longest sequence seen had "
            f"{a} positions ({a + 1} if this is a causal LM whose labels are its inputs: the last position has no "
            "target)"
        )
    shown = ", ".join(str(i) for i in idx[:_IDS_SHOWN]) + (", ..." if k > _IDS_SHOWN else "")
    if _BUCKETS.search(name):
        used = "is" if k == 1 else "are"
        if not one_batch:
            used = "was" if k == 1 else "were"
        return (
            f"relative-position {_counted(k, 'bucket')} {shown} ({k:,} of {total:,}) {used} used by no query-key "
            f"pair of {batches}: no distance between two positions fell in {'it' if k == 1 else 'them'} (longer "
            "sequences reach the far buckets)"
        )
    if one_batch:
        absent = "is not in this batch" if k == 1 else "are not in this batch"
    else:
        absent = "was in no measured batch" if k == 1 else "were in no measured batch"
    return f"{_counted(k, 'id')} {shown} ({k:,} of {total:,}) {absent}"


#: optimizer state that accumulates every gradient (squares or magnitudes): zero only if every gradient
#: was (until it underflows: ~1e5 steps for Adam's beta2 0.999, ~1e3 for momentum 0.9)
_STATE_KEYS = ("exp_avg_sq", "square_avg", "sum", "exp_inf", "momentum_buffer", "exp_avg")


def _state_nonzero(param: torch.Tensor, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor] | None:
    """Per-slice "some step had a gradient here", from the optimizer's accumulated state (device bools)."""
    if optimizer is None:
        return None
    state = optimizer.state.get(param)
    if not state:
        return None
    for key in _STATE_KEYS:
        st = state.get(key)
        if isinstance(st, torch.Tensor) and tuple(st.shape) == tuple(param.shape) and st.layout == torch.strided:
            rows, cols = slice_nonzero(slice_view(st, param))  # an FSDP1 slice: its whole rows
            return [rows] if cols is None else [rows, cols]
    return None


def _state_matters(row: Tracked, grads: SliceGrads, optimizer: torch.optim.Optimizer | None) -> bool:
    """Whether `partly_updated` can use this tensor's optimizer-state slices: only to tell decay-only slices
    (weight decay on, some slice with no non-zero gradient yet) and for their caveat. A 5,000-tensor model
    otherwise paid a per-slice pass over every tensor's state at close for nothing. Sharded tensors always
    take part: their evidence is combined over ranks, which must all send the same items."""
    if is_sharded(row.param):
        return True
    if not row.param.requires_grad or (optimizer is not None and row.group is None):
        return False  # partly_updated skips these tensors
    return row.index not in grads.full and _weight_decay(row, optimizer) > 0


def slice_facts(
    rows: Sequence[Tracked],
    changes: dict[int, Changes],
    grads: SliceGrads,
    optimizer: torch.optim.Optimizer | None = None,
    moves: SliceMoves | None = None,
) -> dict[int, SliceFacts]:
    """Host-side facts of every tensor with 1+ dims: the ledger's slice changes, the meter's evidence
    (gradients, and `moves`: the slices the optimizer moved) and the optimizer state's (one host copy for
    all of it)."""
    keys: list[tuple[int, int | None]] = []
    parts: list[torch.Tensor] = []
    for row in rows:
        for dim, src in ((0, grads.rows), (1, grads.cols)):
            t = src.get(row.index)
            if t is not None:
                keys.append((row.index, dim))
                parts.append(t)
        if row.index in changes and row.shape and _state_matters(row, grads, optimizer):
            for dim, t in enumerate(_state_nonzero(row.param, optimizer) or []):
                keys.append((row.index, 10 + dim))  # 10, 11: the state's rows and columns
                parts.append(t)
        for dim in (0, 1) if row.index in changes else ():
            t = moves.get(row.index, dim) if moves is not None else None
            if t is not None:
                keys.append((row.index, 20 + dim))  # 20, 21: the rows and columns the optimizer moved
                parts.append(t)
            t = moves.kept(row.index, dim) if moves is not None else None
            if t is not None:
                keys.append((row.index, 40 + dim))  # 40, 41: those that kept an update to the next watched step
                parts.append(t)
        pairs = moves.set_back(row.index) if moves is not None and row.index in changes else []
        for p, (_, _, back_rows, back_cols) in enumerate(pairs):
            for dim, t in ((0, back_rows), (1, back_cols)):
                if t is not None:
                    keys.append((row.index, 30 + 2 * p + dim))  # 30, 31, 32, ...: set back, per pair of steps
                    parts.append(t)
    # host vectors are used as they are (read only below); the others come over in one copy
    seen: dict[tuple[int, int | None], torch.Tensor] = {}
    away = [(key, t) for key, t in zip(keys, parts) if t.device.type != "cpu"]
    for key, t in zip(keys, parts):
        if t.device.type == "cpu":
            seen[key] = t
    if away:
        host = torch.cat([t.to(away[0][1].device) for _, t in away]).cpu()
        at = 0
        for key, t in away:
            seen[key] = host[at : at + t.numel()]
            at += t.numel()
    out: dict[int, SliceFacts] = {}
    for row in rows:
        ch = changes.get(row.index)
        if ch is None or not row.shape:
            continue
        if ch.elems is not None:
            changed: dict[int | None, torch.Tensor] = {None: ch.elems}
            nonzero: dict[int | None, torch.Tensor | None] = {None: seen.get((row.index, 0))}
            state: dict[int | None, torch.Tensor | None] = {None: seen.get((row.index, 10))}
            moved: dict[int | None, torch.Tensor | None] = {None: seen.get((row.index, 20))}
            kept: dict[int | None, torch.Tensor | None] = {None: seen.get((row.index, 40))}
        elif ch.rows is not None and ch.cols is not None:
            changed = {0: ch.rows, 1: ch.cols}
            nonzero = {0: seen.get((row.index, 0)), 1: seen.get((row.index, 1))}
            state = {0: seen.get((row.index, 10)), 1: seen.get((row.index, 11))}
            moved = {0: seen.get((row.index, 20)), 1: seen.get((row.index, 21))}
            kept = {0: seen.get((row.index, 40)), 1: seen.get((row.index, 41))}
        else:
            continue
        for found in (nonzero, state, moved, kept):
            for d, t in list(found.items()):
                if t is not None and t.shape != changed[d].shape:  # resized since: the evidence is stale
                    found[d] = None
        moved_at = tuple(moves.steps.get(row.index, ())) if moves is not None else ()
        back, back_at = _set_back(row.index, seen, moves.set_back(row.index) if moves is not None else [], changed)
        out[row.index] = SliceFacts(changed, nonzero, state, moved, moved_at, back, back_at, kept)
    return out


def _set_back(
    index: int,
    seen: dict[tuple[int, int | None], torch.Tensor],
    pairs: list[tuple[int, int, torch.Tensor, torch.Tensor | None]],
    changed: dict[int | None, torch.Tensor],
) -> tuple[dict[int | None, torch.Tensor | None], tuple[int, int] | None]:
    """The slices set back at any pair of watched steps (host, by kind as `changed`), and the first pair."""
    back: dict[int | None, torch.Tensor | None] = {}
    first: tuple[int, int] | None = None
    for p, (was, step, _, _) in enumerate(pairs):
        for dim in (0, 1):
            t = seen.get((index, 30 + 2 * p + dim))
            d: int | None = None if dim == 0 and None in changed else dim
            if t is None or d not in changed or t.shape != changed[d].shape:
                continue
            acc = back.get(d)
            back[d] = t if acc is None else acc | t
            if first is None and bool(t.any()):
                first = (was, step)
    return back, first


def global_facts(rows: Sequence[Tracked], facts: dict[int, SliceFacts], reducer: Reducer) -> dict[int, SliceFacts]:
    """Sharded tensors (FSDP2, DTensor): each rank's slices placed at their global indices and
    combined over ranks (a slice changed, or had a gradient, if it did on any rank)."""
    items: list[tuple[Tracked, int | None, torch.Tensor | None]] = []
    for row in rows:
        if not is_sharded(row.param) or not row.shape:
            continue
        f = facts.get(row.index)
        dims: tuple[int | None, ...] = (0, 1) if len(row.shape) >= 2 else (None,)
        for dim in dims:
            items.append((row, dim, f.changed.get(dim) if f is not None else None))
            items.append((row, dim, f.nonzero.get(dim) if f is not None else None))
            items.append((row, dim, f.state.get(dim) if f is not None else None))
    merged = reducer.global_slices(items)
    at = 0
    out = dict(facts)
    for row in rows:
        if not is_sharded(row.param) or not row.shape:
            continue
        dims = (0, 1) if len(row.shape) >= 2 else (None,)
        changed: dict[int | None, torch.Tensor] = {}
        nonzero: dict[int | None, torch.Tensor | None] = {}
        state: dict[int | None, torch.Tensor | None] = {}
        for dim in dims:
            ch, nz, st = merged[at : at + 3]
            at += 3
            if ch is not None:
                changed[dim], nonzero[dim], state[dim] = ch, nz, st
        if changed:
            out[row.index] = SliceFacts(changed, nonzero, state)
        else:
            out.pop(row.index, None)
    return out


def slice_kind(owner: Owner | None, row: Tracked) -> str:
    """What a tensor's slices are, by its owning module and attribute: "embedding.weight", "linear.bias",
    "conv1d_t.weight" (transformers' Conv1D), "conv.weight", "experts" (a fused 3-D expert tensor: its
    rows are experts, `gradlog.verdict.experts`), or "" (rows and columns, unnamed). The one answer
    `partly_updated` and `gradlog.verdict.stopped_slices` name slices by."""
    if owner is not None and owner.family:
        return f"{owner.family}.{owner.attr}"
    return "experts" if is_fused_experts(owner, row.name, len(row.shape)) else ""


def words_key(kind: str, dim: int | None) -> tuple[str, int | None]:
    """The (kind, dim) a slice is worded as: transformers' Conv1D holds a Linear's weight transposed (in, out),
    so its columns are the units a Linear's rows are (GPT-2's c_fc, c_proj, c_attn)."""
    if kind.startswith("conv1d_t."):
        return "linear." + kind.split(".", 1)[1], {0: 1, 1: 0}.get(dim, dim) if dim is not None else None
    return kind, dim


def share_words(k: int, total: int, noun: str) -> str:
    """ "1.6% of the layer's units": a dead-units finding's weight (`gradlog.verdict.policy.SMALL_SHARE`)."""
    return f"{100 * k / max(total, 1):.1f}% of the layer's {noun}"


def _steps(n: int) -> str:
    return f"{n} measured step{'s' if n != 1 else ''}"


def _weight_decay(row: Tracked, optimizer: torch.optim.Optimizer | None) -> float:
    if optimizer is None or row.group is None or row.group >= len(optimizer.param_groups):
        return 0.0
    wd = optimizer.param_groups[row.group].get("weight_decay", 0.0)
    return float(wd) if isinstance(wd, (int, float)) else 0.0


def partly_updated(
    rows: Sequence[Tracked],
    facts: dict[int, SliceFacts],
    evidence: dict[int, Evidence],
    whole: set[str],
    owners: Owners,
    optimizer: torch.optim.Optimizer | None,
    optimizer_steps: int,
    sites: Mapping[int, str] | None = None,
    between: Mapping[int, tuple[int, int]] | None = None,
) -> list[PartlyUpdated]:
    """One record per tensor, dim and reason, in model order; `whole` names the tensors already in
    `never_updated` (their slices are not repeated); `owners`: the tensors' owning modules, which name
    the slices (kept from the last time the model was there when it was garbage-collected); `sites`: where
    a tensor was written outside the optimizer, where seen (`gradlog.measure.writes`), for slices set back;
    `between`: two steps between which it was so written, where known."""
    candidates: list[tuple[Tracked, SliceFacts]] = []
    for row in rows:
        f = facts.get(row.index)
        if f is None or row.name in whole or not row.param.requires_grad or not row.shape:
            continue
        if optimizer is not None and row.group is None:
            continue
        candidates.append((row, f))
    # "every slice changed" and "every slice had a gradient" for all tensors and dims in a few whole-array ops:
    # most tensors of a healthy model are settled by these two facts, and a 5,000-tensor model paid ~10 torch
    # calls per tensor and dim for them
    checks: list[torch.Tensor] = []
    for _, f in candidates:
        for dim, changed in f.changed.items():
            checks.append(changed)
            nz = f.nonzero.get(dim)
            if nz is not None:
                checks.append(nz)
            back = f.back.get(dim)
            if back is not None:
                checks.append(~back)
    every = iter(_all_each(checks))
    out: list[PartlyUpdated] = []
    made: list[tuple[tuple[Any, ...], list[PartlyUpdated]]] = []  # each tensor's `_records` arguments and records
    for row, f in candidates:
        ev = evidence.get(row.index, Evidence())
        with_grad = ev.measured - ev.grad_none
        wd = _weight_decay(row, optimizer)
        todo: list[int | None] = []
        for dim in f.changed:
            all_changed = next(every)
            all_nonzero = next(every) if f.nonzero.get(dim) is not None else True
            none_back = next(every) if f.back.get(dim) is not None else True
            # every slice changed and none can be decay-only or was set back: nothing to report
            if not (all_changed and none_back and (with_grad <= 0 or not wd > 0 or all_nonzero)):
                todo.append(dim)
        if not todo:
            continue
        owner = owners.get(row.index)
        kind = slice_kind(owner, row)
        padding = _padding_idx(owner, row.shape[0]) if kind == "embedding.weight" else None
        for dim in todo:
            changed = f.changed[dim]
            if not bool(changed.any()):  # the whole tensor never changed: never_updated's job
                continue
            nonzero = f.nonzero.get(dim)
            zero = ~nonzero if nonzero is not None and with_grad > 0 else None
            decayed = changed & zero if zero is not None and wd > 0 else torch.zeros_like(changed)
            in_state = f.state.get(dim)
            if in_state is not None:  # the optimizer saw every step: a gradient at an unmeasured step shows
                decayed &= ~in_state
            never = ~changed
            back = f.back.get(dim)
            back = back & changed if back is not None else None  # set back to a value other than the first
            picked = never | decayed if back is None else never | decayed | back
            if not bool(picked.any()):
                continue
            caveat = "" if in_state is not None else _caveat(ev, optimizer_steps)
            pruned = _pruned(owner, dim, changed.numel())
            moves = Moves(
                f.moved.get(dim), f.moved_at, (sites or {}).get(row.index, ""), (between or {}).get(row.index)
            )
            moves.back, moves.back_at, moves.back_any = back, f.back_at, f.back.get(dim)
            moves.zeroed = _zeroed_after_learning(row.param, dim, f.kept.get(dim), picked)
            args = (row, dim, kind, padding, never, decayed, zero, with_grad, wd, ev, caveat, pruned, moves)
            made.append((args, _records(*args)))
    absent = _absent_inputs([(a[2], r) for a, found in made for r in found])
    for args, found in made:
        if any(id(r) in absent for r in found):
            found = _records(*args, absent=True)
        out += found
    return out


#: the (kind, dim) of a layer's units (`words_key`): the slices a dead unit zeroes in its own layer
_UNIT_DIMS = frozenset({("linear.weight", 0), ("linear.bias", None), ("conv.weight", 0), ("conv.bias", None)})
#: the (kind, dim) of a layer's inputs: zero where the input is zero in every batch
_INPUT_DIMS = frozenset({("linear.weight", 1), ("conv.weight", 1)})


def _absent_inputs(found: Sequence[tuple[str, PartlyUpdated]]) -> set[int]:
    """The `id`s of the zero-gradient input-feature (or input-channel) records that no dead unit gradlog watches
    can explain: the run has no zero-gradient units whose count divides the layer's input count (a dead unit
    zeroes the next layer's column, or its block of columns after a flatten). Such a column's input was zero in
    every measured batch because the data, or the model's own preprocessing, never sets that feature (transformers'
    time-series models feed log1p(|loc|), which is 0 under their default mean scaling): a linear layer on it is
    an embedding whose id never came (`one_hot(ids) @ W` is `Embedding(ids)`), as harmless as that."""
    units = {r.total for kind, r in found if r.reason is Reason.ZERO_GRAD and words_key(kind, r.dim) in _UNIT_DIMS}
    return {
        id(r)
        for kind, r in found
        if r.reason is Reason.ZERO_GRAD
        and words_key(kind, r.dim) in _INPUT_DIMS
        and not any(r.total % n == 0 for n in units if n)
    }


@dataclass
class Moves:
    """What the optimizer's moves say of one tensor's slices of one kind (`partly_updated`): those it moved at
    its first watched steps and those steps, the line that wrote it outside the optimizer and two steps
    between which it did (where known), and the slices set back to their values before a watched step (changed
    since the start) with the first pair of steps that showed it."""

    moved: torch.Tensor | None = None
    moved_at: tuple[int, ...] = ()
    site: str = ""
    between: tuple[int, int] | None = None
    back: torch.Tensor | None = None
    back_at: tuple[int, int] | None = None
    back_any: torch.Tensor | None = None  # `back` with the slices that never changed
    #: slices that kept an update of the optimizer's for a while (`SliceFacts.kept`) and are exactly zero at close
    zeroed: torch.Tensor | None = None


def _all_each(flags: list[torch.Tensor]) -> list[bool]:
    """`bool(t.all())` of each host bool tensor, from one concatenation and one running count."""
    if not flags:
        return []
    flat = torch.cat([t.reshape(-1).cpu() for t in flags]).to(torch.bool)
    missing = torch.cat([torch.zeros(1, dtype=torch.int64), (~flat).to(torch.int64).cumsum(0)])
    lengths = torch.tensor([t.numel() for t in flags], dtype=torch.int64)
    ends = lengths.cumsum(0)
    return (missing[ends] == missing[ends - lengths]).tolist()


def _caveat(ev: Evidence, optimizer_steps: int) -> str:
    """For slices that moved by decay only: when not every step was measured, a slice used only on
    unmeasured steps would look the same."""
    if ev.measured and optimizer_steps > ev.measured:
        return f" ({ev.measured} of {optimizer_steps} optimizer steps measured: use every=1 to rule out rare use)"
    return ""


def _zeroed_after_learning(
    param: torch.Tensor, dim: int | None, kept: torch.Tensor | None, picked: torch.Tensor
) -> torch.Tensor | None:
    """The slices of kind `dim` that kept an optimizer update for a while (`kept`) and whose values are all
    exactly zero at close, among the `picked` ones; None where none could be (one host read of the tensor,
    only then)."""
    if kept is None or kept.shape != picked.shape or not bool((kept & picked).any()) or is_sharded(param):
        return None
    zero = param.detach() == 0
    if dim is None:
        flags = zero.reshape(-1)
    elif dim == 0:
        flags = zero.reshape(zero.shape[0], -1).all(1)
    else:
        flags = zero.reshape(zero.shape[0], zero.shape[1], -1).all(2).all(0)
    flags = flags.cpu()
    return flags & kept if flags.shape == kept.shape else None


def _pruned(owner: Owner | None, dim: int | None, n: int) -> torch.Tensor | None:
    """The slices of kind `dim` that torch.nn.utils.prune's mask zeroes whole (a bool mask of `n`), or None."""
    for d, idx in owner.pruned if owner is not None else ():
        if d == dim and idx and max(idx) < n:
            out = torch.zeros(n, dtype=torch.bool)
            out[list(idx)] = True
            return out
    return None


def _padding_idx(owner: Owner | None, n: int) -> int | None:
    pad = owner.padding_idx if owner is not None else None
    if pad is None:
        return None
    pad = pad + n if pad < 0 else pad
    return pad if 0 <= pad < n else None


def _records(
    row: Tracked,
    dim: int | None,
    kind: str,
    padding: int | None,
    never: torch.Tensor,
    decayed: torch.Tensor,
    zero: torch.Tensor | None,
    with_grad: int,
    wd: float,
    ev: Evidence,
    caveat: str,
    pruned: torch.Tensor | None = None,
    moves: Moves | None = None,
    absent: bool = False,
) -> list[PartlyUpdated]:
    """One tensor's records of dim `dim`; `absent`: its zero-gradient slices are inputs no batch set
    (`_absent_inputs`), said and weighed as ids no batch held."""
    total = never.numel()
    noun, question = _WORDS.get(words_key(kind, dim), (DIM_NAMES[dim], "no gradient ever reached them"))
    hooked = bool(getattr(row.param, "_backward_hooks", None))
    if hooked:  # a tensor hook (register_hook) rewrites the gradient: the likeliest thing to zero slices
        question = "a gradient hook on this tensor (register_hook) zeroes them?"
    absent = absent and not hooked
    if absent:
        question = (
            "the layer's input was zero there in every measured batch, and no dead unit that gradlog watches "
            "feeds it (a feature the data, or the model's own preprocessing, never sets: like an id no batch "
            f"held, the {noun} have nothing to learn from)"
        )
    moves = moves or Moves()
    embedding = kind == "embedding.weight" and not hooked
    masks = _reason_masks(never, decayed, zero, pruned, moves, dim, padding, embedding, ev.dtype, absent)
    found = [(reason, m.nonzero().flatten()) for reason, m in masks]
    found = sorted(((r, at) for r, at in found if at.numel()), key=lambda f: int(f[1][0]))
    groups: dict[Reason, list[int]] = {r: at.tolist() for r, at in found}
    never_in = {r: int(never[at].sum()) for r, at in found}
    out = []
    for reason, idx in groups.items():
        n_never = never_in[reason]
        moved = len(idx) - n_never
        what = f"{noun if len(idx) > 1 else noun[:-1]} {format_ranges(idx, 8)} ({len(idx)} of {total})"
        if moved == 0:
            head = f"{what} never changed"
        elif n_never == 0:
            head = f"{what} moved only through weight decay ({wd:g})"
        else:
            head = f"{what} never changed ({n_never}) or moved only through weight decay ({moved}, weight_decay {wd:g})"
        said = _Said(what, head, moved, with_grad, caveat, question, hooked, embedding)
        detail = _detail(reason, said, row.name, idx, total, noun, ev, moves)
        out.append(PartlyUpdated(row.name, dim, len(idx), total, tuple(idx), reason, detail))
    return out


def _reason_masks(
    never: torch.Tensor,
    decayed: torch.Tensor,
    zero: torch.Tensor | None,
    pruned: torch.Tensor | None,
    moves: Moves,
    dim: int | None,
    padding: int | None,
    embedding: bool,
    dtype: str,
    absent: bool = False,
) -> list[tuple[Reason, torch.Tensor]]:
    """One mask per reason over the picked slices (whole-tensor ops: an embedding of 800k rows is one call, not
    a Python loop per row); `embedding`: an embedding's rows with no gradient hook, whose zero rows are ids no
    batch held; `absent`: a layer's inputs that no batch set (`_absent_inputs`), the same."""
    picked = never | decayed if moves.back is None else never | decayed | moves.back
    masks: list[tuple[Reason, torch.Tensor]] = []
    rest = picked
    if dim == 0 and padding is not None and bool(picked[padding]):
        pad = torch.zeros_like(picked)
        pad[padding] = True
        masks.append((Reason.PADDING_IDX, pad))
        rest = picked & ~pad
    by_optimizer = moves.moved
    over = rest & never & by_optimizer if by_optimizer is not None else torch.zeros_like(rest)
    if dim is None:  # an element moved by rounding noise may come back to its start by itself over later steps:
        # set back only where seen so at two consecutive steps (`SliceMoves.back`)
        over &= moves.back_any if moves.back_any is not None else torch.zeros_like(over)
    if moves.back is not None:  # moved, and as they were before the next watched step: set back
        over |= rest & moves.back
    if moves.zeroed is not None and bool((over & moves.zeroed).any()):  # learned, then zeroed: pruned
        masks.append((Reason.PRUNED, over & moves.zeroed))
        rest = rest & ~(over & moves.zeroed)
        over = over & ~moves.zeroed
    if bool(over.any()):  # moved, yet as they were
        masks.append((Reason.OVERWRITTEN, over))
        rest = rest & ~over
    if pruned is not None and zero is not None and bool((rest & zero & pruned).any()):
        masks.append((Reason.PRUNED, rest & zero & pruned))  # no gradient there by design: the mask zeroes them
        rest = rest & ~(zero & pruned)
    if zero is not None:
        unseen = (embedding and dim == 0) or absent
        masks.append((Reason.NOT_IN_BATCH if unseen else Reason.ZERO_GRAD, rest & zero))
        masks.append((unmoved(dtype)[0], rest & ~zero))
    else:
        masks.append((Reason.UNKNOWN, rest))
    return masks


@dataclass(frozen=True)
class _Said:
    """What every slice detail of one tensor draws on: the slices' words and the tensor's evidence."""

    what: str
    head: str
    moved: int
    with_grad: int
    caveat: str
    question: str
    hooked: bool
    embedding: bool = True  # an embedding's rows: ids (`unseen_words`), not a dense layer's inputs


def _detail(
    reason: Reason, said: _Said, name: str, idx: list[int], total: int, noun: str, ev: Evidence, moves: Moves
) -> str:
    """The detail of the slices `idx` kept for `reason`: what was seen and what likely caused it."""
    head, caveat = said.head, said.caveat if said.moved else ""
    if reason is Reason.PADDING_IDX:
        return f"{head}: the embedding's padding_idx row, never updated by design"
    if reason is Reason.PRUNED and moves.zeroed is not None and bool(moves.zeroed[idx].all()):
        return zeroed_after_learning(said.what, moves.site, moves.between)
    if reason is Reason.PRUNED:
        base = name[: -len("_orig")] if name.endswith("_orig") else name
        return (
            f"{head}: pruned by torch.nn.utils.prune ({base}_mask is zero there: no gradient reaches them, "
            f"and the effective {base.rsplit('.', 1)[-1]} is zero there), by design"
        )
    if reason is Reason.OVERWRITTEN and moves.back is not None and moves.back_at is not None and said.moved:
        return set_back_again(said.what, moves.back_at, moves.site)
    if reason is Reason.OVERWRITTEN:
        return set_back_slices(said.what, moves.moved_at, moves.site, moves.between)
    if reason is Reason.NOT_IN_BATCH and not said.hooked and said.embedding:
        words = unseen_words(name, idx, total)
        return f"{words}: {head}; zero gradient at all {said.with_grad} measured steps with a gradient{caveat}"
    if reason in (Reason.ZERO_GRAD, Reason.NOT_IN_BATCH):
        detail = f"{head}; zero gradient at all {said.with_grad} measured steps with a gradient: {said.question}"
        if reason is Reason.ZERO_GRAD:  # what the verdict weighs it by (`judge.slice_kinds`)
            detail += f"; {share_words(len(idx), total, noun)}"
        return detail + caveat
    if reason in (Reason.BELOW_PRECISION, Reason.TINY_UPDATE):
        return (
            f"{head}; non-zero gradient at some of {_steps(said.with_grad)} with a gradient, yet the {ev.dtype} "
            f"values never changed: {unmoved(ev.dtype)[1]}"
        )
    return f"{head}; no measured step saw a gradient for this tensor"
