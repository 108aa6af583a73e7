"""`gradlog diff`: what changed between checkpoints of one model, tensor by tensor, without a run.

Each tensor is streamed through all checkpoints in training order, holding two values at a time
(the previous checkpoint's and the current one's), in cache-sized chunks that are read once: one
pass gives the bitwise comparison per row/column/element, the norm of the change and the norm of the
new value. Peak memory is about two tensors (memory-mapped formats: the pages of two tensors, which
the kernel can drop again), not the model.

Findings use the records and reasons of a run's `Report`: tensors that never changed
(`NeverUpdated`), rows/columns/elements that never changed (`PartlyUpdated`), tensors that changed
and then stopped (`Stalled`, with checkpoint interval indices as steps: interval i is checkpoint i ->
i + 1), plus NaN/Inf that appeared, tensors missing from a checkpoint, and shape or dtype changes.
With optimizer state in a checkpoint the reasons get sharper (see `OptimizerView`).
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import torch

from gradlog.measure.params import NameFilter, Selection, _matcher
from gradlog.readers.checkpoints import BadCheckpoint, Checkpoint, TensorInfo
from gradlog.verdict.judge import CHECKPOINT_WORDS, Verdict, all_of, finding_lines, judge
from gradlog.verdict.policy import Policy, PolicyLike
from gradlog.verdict.report import (
    COLUMNS,
    CONSOLE_WIDTH,
    PARTLY_COLUMNS,
    STALLED_COLUMNS,
    NeverUpdated,
    PartlyUpdated,
    Reason,
    Report,
    Stalled,
    format_table,
)
from gradlog.verdict.rounding import unmoved
from gradlog.verdict.unchanged import bits, differs, partly_rows, slice_dims

#: elements per chunk: 1 MB of fp32, so the chunk's second and third reads come from cache
CHUNK = 1 << 18
#: the last name part of buffers every model has that are not parameters (never in an optimizer)
BUFFER_LEAVES = frozenset({"running_mean", "running_var", "num_batches_tracked"})
_EMBEDDING = re.compile(r"(^|[._])(embed\w*|wte|wpe|tok\w*|word_embeddings|position_embeddings)([._]|$)")
_REL_TABLE_MAX = 60  # the console shows this many tensors' relative changes; --json has them all


class CannotCompare(Exception):
    """The checkpoints cannot be compared (different models, nothing selected): exit status 2."""


@dataclass(frozen=True)
class Appeared:
    """NaN/Inf in a tensor, first at checkpoint `checkpoint` (0 = already in the first)."""

    name: str
    checkpoint: int
    count: int


@dataclass(frozen=True)
class Missing:
    name: str
    present_in: tuple[int, ...]


@dataclass(frozen=True)
class MetaChange:
    """A tensor whose shape or dtype differs between checkpoint `checkpoint - 1` and `checkpoint`."""

    name: str
    checkpoint: int
    before: str
    after: str


@dataclass
class OptimizerView:
    """Optimizer state of one checkpoint, matched to tensor names.

    Matching: when the optimizer was built from ``model.named_parameters()`` (torch >= 2.6) its
    state dict carries ``param_names`` and the match is exact. Otherwise torch numbers parameters
    0, 1, ... in param-group order, and gradlog assumes that order is the checkpoint's order of
    floating-point tensors minus BatchNorm's running statistics (true for
    ``optimizer(model.parameters())`` with one group). The match is used only when the counts agree
    and every parameter with state has moments of its tensor's shape; otherwise the reasons say
    that no optimizer state could be used.
    """

    checkpoint: int
    how: str
    by_name: dict[str, tuple[int, dict[str, Any]]]
    lrs: list[float]

    def lr(self, name: str) -> float | None:
        hit = self.by_name.get(name)
        return None if hit is None else self.lrs[hit[0]]

    def moment(self, name: str) -> torch.Tensor | None:
        """The first moment (Adam's exp_avg, SGD's momentum_buffer) of a mapped tensor, if any."""
        hit = self.by_name.get(name)
        if hit is None:
            return None
        state = hit[1]
        for key in ("exp_avg", "momentum_buffer", "square_avg", "sum", "exp_inf"):
            t = state.get(key)
            if isinstance(t, torch.Tensor) and t.dim() > 0:
                return t
        return None


def _state_shape(state: dict[str, Any]) -> tuple[int, ...] | None:
    for v in state.values():
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            return tuple(v.shape)
    return None


def map_optimizer(
    opt: dict[str, Any], index: int, names: list[str], infos: dict[str, TensorInfo]
) -> tuple[OptimizerView | None, str]:
    """Match an optimizer state dict's parameter ids to tensor names (see `OptimizerView`)."""
    from gradlog.measure.params import clean_name

    groups = [g for g in opt.get("param_groups", []) if isinstance(g, dict)]
    state = opt.get("state", {})
    ids: list[tuple[int, Any]] = [(gi, pid) for gi, g in enumerate(groups) for pid in g.get("params", [])]
    lrs = []
    for g in groups:
        lr = g.get("lr", None)
        lrs.append(float(lr.item() if isinstance(lr, torch.Tensor) else lr) if lr is not None else math.nan)
    named = all(isinstance(g.get("param_names"), list) and len(g["param_names"]) == len(g["params"]) for g in groups)
    by_name: dict[str, tuple[int, dict[str, Any]]] = {}
    if named and groups:
        for gi, g in enumerate(groups):
            for pid, pname in zip(g["params"], g["param_names"]):
                by_name[clean_name(str(pname))] = (gi, dict(state.get(pid, {})))
        return OptimizerView(index, "by the parameter names in its state dict", by_name, lrs), ""
    candidates = [n for n in names if infos[n].dtype.is_floating_point and n.rsplit(".", 1)[-1] not in BUFFER_LEAVES]
    if len(ids) != len(candidates):
        return None, (
            f"the optimizer state in checkpoint {index} holds {len(ids)} parameters and the checkpoint "
            f"{len(candidates)} trainable-looking tensors, so gradlog cannot tell which is which (build the "
            "optimizer from model.named_parameters() to save the names)"
        )
    for (gi, pid), name in zip(ids, candidates):
        st = dict(state.get(pid, {}))
        shape = _state_shape(st)
        if shape is not None and shape != infos[name].shape:
            return None, (
                f"the optimizer state in checkpoint {index} does not line up with the tensors in order "
                f"(parameter {pid} has state of shape {shape}, {name!r} is {infos[name].shape})"
            )
        by_name[name] = (gi, st)
    return OptimizerView(index, "by position (the order of the checkpoint's tensors)", by_name, lrs), ""


@dataclass
class _Track:
    """What streaming one tensor through the checkpoints found."""

    name: str
    info: TensorInfo
    rel: list[float] = field(default_factory=list)  # per interval
    changed: list[bool] = field(default_factory=list)  # per interval, bitwise
    slices: dict[int | None, torch.Tensor] = field(default_factory=dict)  # slice kind -> ever changed
    nonfinite: Appeared | None = None


def _sumsq(x: torch.Tensor) -> float:
    if x.numel() == 0:
        return 0.0
    n = float(torch.linalg.vector_norm(x, dtype=torch.float32 if x.element_size() < 4 else None))
    return n * n


def _count_nonfinite(t: torch.Tensor) -> int:
    return int(t.numel() - int(torch.isfinite(t).sum()))


def _first_pass(t: torch.Tensor) -> tuple[float, int]:
    """Norm squared and NaN/Inf count of one value (the first checkpoint's)."""
    ss = _sumsq(t)
    return ss, (_count_nonfinite(t) if not math.isfinite(ss) else 0)


def _compare(a: torch.Tensor, b: torch.Tensor, need: dict[int | None, torch.Tensor]) -> tuple[bool, float, float, int]:
    """One chunked pass over two values: (changed, ‖b − a‖², ‖b‖², NaN/Inf count in b).

    Equal bytes are found first with one `torch.equal` on integer views (a memcmp that stops at the
    first difference). Otherwise each cache-sized chunk is read once: its difference, the norms of
    its rows (they add up to ‖b − a‖² too), the max and min of its columns, the norm of b. A slice
    changed when its difference is non-zero, so +0.0 and -0.0 count as the same value; where a
    difference is NaN/Inf the chunk is compared bitwise instead (NaN in the same place is no change).

    `need` holds, per slice kind, the mask of slices seen changing so far; it is updated in place
    (only while some slice has not changed yet: later intervals skip the per-slice work).
    """
    if a.numel() == 0 or torch.equal(bits(a), bits(b)):
        return False, 0.0, (_sumsq(b) if a.numel() else 0.0), 0
    rows_needed = 0 in need and not bool(need[0].all())
    cols_needed = 1 in need and not bool(need[1].all())
    elem_needed = None in need and not bool(need[None].all())
    flat = a.dim() < 2
    av = a.reshape(-1) if flat else a.reshape(a.shape[0], -1)
    bv = b.reshape(-1) if flat else b.reshape(b.shape[0], -1)
    half = a.element_size() < 4
    step = CHUNK if flat else max(1, CHUNK // max(1, av.shape[1]))
    c3 = b.reshape(b.shape[0], b.shape[1], -1).shape[2] if cols_needed else 1
    changed = False
    d_ss = b_ss = 0.0
    bad = 0
    for lo in range(0, av.shape[0], step):
        hi = min(av.shape[0], lo + step)
        ac, bc = av[lo:hi], bv[lo:hi]
        if half:
            ac, bc = ac.float(), bc.float()
        ss = _sumsq(bc)
        b_ss += ss
        if not math.isfinite(ss):
            bad += _count_nonfinite(bc)
        d = bc - ac
        if flat or not rows_needed:
            dss = _sumsq(d)
            row_norms = None
        else:
            row_norms = torch.linalg.vector_norm(d, dim=1)
            dss = float(row_norms.double().square().sum())
        if not math.isfinite(dss):  # NaN/Inf in the difference: compare this chunk's bits
            ne = differs(av[lo:hi], bv[lo:hi])
            changed = changed or bool(ne.any())
            if elem_needed:
                need[None][lo:hi] |= ne
            if rows_needed:
                need[0][lo:hi] |= ne.any(dim=1)
            if cols_needed:
                need[1] |= ne.reshape(hi - lo, -1, c3).any(dim=2).any(dim=0)
            d = torch.where(ne, d, 0.0)  # the norm of what really changed (NaN stays NaN)
            dss = _sumsq(d)
            d_ss += dss
            continue
        d_ss += dss
        if dss == 0:
            continue
        changed = True
        if elem_needed:
            need[None][lo:hi] |= d != 0
        if row_norms is not None:
            need[0][lo:hi] |= row_norms != 0
        if cols_needed:
            d2 = d if c3 == 1 else d.reshape(hi - lo, -1, c3).transpose(1, 2).reshape(-1, d.shape[1] // c3)
            need[1] |= (d2.amax(dim=0) != 0) | (d2.amin(dim=0) != 0)
            cols_needed = not bool(need[1].all())  # usually the first chunk already shows every column moving
    return changed, d_ss, b_ss, bad


@dataclass
class DiffResult:
    """Everything `gradlog diff` found; `text()` for people, `to_dict()` for scripts."""

    checkpoints: list[str]
    report: Report
    relative_change: dict[str, list[float]]
    nonfinite: list[Appeared]
    missing: list[Missing]
    meta_changes: list[MetaChange]
    optimizer_note: str
    skipped_non_float: list[str]
    compared_bytes: int = 0

    @property
    def intervals(self) -> int:
        return len(self.checkpoints) - 1

    def judged(self) -> Verdict:
        """The judge's verdict (`gradlog.verdict.judge`, the same function as a run's) on the report plus
        what only checkpoints show: NaN/Inf that appeared, missing tensors, shape or dtype changes; worded for
        values compared between checkpoints ("never changed", not "never updated")."""
        extra: list[tuple[str, str | None]] = [("diff.nonfinite", a.name) for a in self.nonfinite]
        extra += [("diff.missing", m.name) for m in self.missing]
        extra += [("diff.shape_or_dtype_changed", m.name) for m in self.meta_changes]
        return judge(self.report, extra, label="gradlog diff", words=CHECKPOINT_WORDS)

    @property
    def healthy(self) -> bool:
        return self.judged().healthy

    @property
    def verdict(self) -> str:
        v = self.judged()
        c = len(self.checkpoints)
        n = self.report.tracked_tensors
        tail = f" ({v.tally})" if v.tally else ""
        everything = CHECKPOINT_WORDS.everything(n)
        if v.parts == (everything,):
            return f"{v.label} {v.status}: {everything} across {c} checkpoints{tail}"
        parts = "; ".join(v.parts)
        tail = f"; {v.tally}" if v.tally else ""
        return f"{v.label} {v.status}: {parts} ({c} checkpoints{tail})"

    def text(self) -> str:
        out = ["Checkpoints (in training order; interval i is checkpoint i -> i+1):"]
        out += [f"  {i}: {label}" for i, label in enumerate(self.checkpoints)]
        r = self.report
        if r.never_updated:
            out += ["", "Never changed:", format_table(COLUMNS, [x.row() for x in r.never_updated], CONSOLE_WIDTH)]
        if r.partly_updated:
            rows = partly_rows(r.partly_updated)
            out += ["", "Rows/columns/elements that never changed:", format_table(PARTLY_COLUMNS, rows, CONSOLE_WIDTH)]
        if r.stalled:
            rows = [s.row() for s in r.stalled]
            out += [
                "",
                "Changed, then stopped (steps are checkpoint intervals):",
                format_table(STALLED_COLUMNS, rows, CONSOLE_WIDTH),
            ]
        if self.nonfinite:
            rows = [
                [a.name, f"{a.checkpoint} ({self.checkpoints[a.checkpoint]})", str(a.count)] for a in self.nonfinite
            ]
            out += ["", "NaN/Inf appeared:", format_table(["name", "first checkpoint", "count"], rows)]
        if self.missing:
            rows = [[m.name, ", ".join(map(str, m.present_in))] for m in self.missing]
            out += ["", "Not in every checkpoint:", format_table(["name", "present in checkpoints"], rows)]
        if self.meta_changes:
            rows = [[m.name, str(m.checkpoint), m.before, m.after] for m in self.meta_changes]
            out += ["", "Shape or dtype changed:", format_table(["name", "at checkpoint", "before", "after"], rows)]
        if self.relative_change:
            names = list(self.relative_change)
            shown = names[:_REL_TABLE_MAX]
            cols = ["name"] + [f"{i}->{i + 1}" for i in range(self.intervals)]
            rows = [[n] + [_fmt(v) for v in self.relative_change[n]] for n in shown]
            out += ["", "Relative change ‖B−A‖/‖A‖ per interval:", format_table(cols, rows)]
            if len(names) > len(shown):
                out.append(f"... {len(names) - len(shown)} more tensors (--json lists them all)")
        if self.optimizer_note:
            out += ["", f"Optimizer state: {self.optimizer_note}"]
        if self.skipped_non_float:
            out += ["", f"Not compared (integer or bool tensors, not learned): {len(self.skipped_non_float)}"]
        out += ["", *finding_lines(self.judged()), self.verdict]
        return "\n".join(out)

    def to_dict(self) -> dict[str, Any]:
        whole = self.report.to_dict()
        v = self.judged()
        return {
            "healthy": v.healthy,
            "verdict": self.verdict,
            "severities": {s: v.count(s) for s in ("problem", "warning", "note", "ignore")},
            "checkpoints": list(self.checkpoints),
            **{key: whole[key] for key in ("never_updated", "partly_updated", "stalled")},
            "relative_change": {k: list(v) for k, v in self.relative_change.items()},
            "nonfinite": [{"name": a.name, "checkpoint": a.checkpoint, "count": a.count} for a in self.nonfinite],
            "missing": [{"name": m.name, "present_in": list(m.present_in)} for m in self.missing],
            "shape_or_dtype_changed": [
                {"name": m.name, "checkpoint": m.checkpoint, "before": m.before, "after": m.after}
                for m in self.meta_changes
            ],
            "optimizer": self.optimizer_note,
            "not_compared": list(self.skipped_non_float),
            "compared_bytes": self.compared_bytes,
        }


def _fmt(v: float) -> str:
    if math.isnan(v):
        return "nan"
    return "0" if v == 0 else f"{v:.3g}"


class Progress:
    """Progress on stderr. On a terminal a tqdm bar (done, rate, time left) where tqdm is installed; otherwise,
    and always on a pipe or a log file, a plain line every 10% (a bar redrawn with \\r is one unreadable line
    in a log)."""

    def __init__(self, total: int, stream: TextIO | None = None, force: bool | None = None, min_bytes: int = 2 << 30):
        self.stream = stream if stream is not None else sys.stderr
        tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.tty = tty
        self.forced = force
        self.on = force if force is not None else (total > 0 and ((tty and total >= (64 << 20)) or total >= min_bytes))
        self.min_bytes = min_bytes
        self.total = max(total, 1)
        self.done = 0
        self._shown = -1
        self._bar: Any = None

    def begin(self, total: int) -> None:
        """The real amount of work, once the selected tensors are known (`on` is decided again)."""
        if self.forced is None:
            self.on = total > 0 and ((self.tty and total >= (64 << 20)) or total >= self.min_bytes)
        self.total = max(total, 1)

    def add(self, nbytes: int) -> None:
        if not self.on:
            return
        self.done += nbytes
        if self._bar is None:  # first call: a bar on a terminal, if tqdm is there (False: plain lines)
            self._bar = (self.tty and _tqdm(self.total, self.stream)) or False
        if self._bar:
            self._bar.update(nbytes)
            return
        pct = min(100, self.done * 100 // self.total)
        if pct // 10 != self._shown // 10 or self._shown < 0:
            self._shown = pct
            self.stream.write(f"gradlog diff: {pct}% of {self.total / 1e9:.2f} GB\n")
            self.stream.flush()

    def close(self) -> None:
        if self._bar:
            self._bar.close()
            self._bar = False


def _tqdm(total: int, stream: TextIO) -> Any:
    """A tqdm bar counting bytes, or None without tqdm (an optional import: most training setups have it)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, file=stream, desc="gradlog diff", unit="B", unit_scale=True, dynamic_ncols=True)


def _select(include: NameFilter, exclude: NameFilter) -> Callable[[str], bool]:
    inc = _matcher(include, "include")
    exc = _matcher(exclude, "exclude")
    return lambda n: (inc is None or inc(n)) and (exc is None or not exc(n))


def _never_reason(name: str, info: TensorInfo, opt: OptimizerView | None, opt_note: str, c: int) -> tuple[Reason, str]:
    base = f"bitwise equal in {all_of(c, 'checkpoint')}"
    if opt is None:
        why = opt_note or "no checkpoint holds optimizer state to say why"
        return Reason.UNKNOWN, f"{base}; {why}"
    at = f"(optimizer state of checkpoint {opt.checkpoint})"
    if name not in opt.by_name:
        return Reason.NOT_IN_OPTIMIZER, f"{base}; not among the optimizer's parameters {at}: left out, or a buffer"
    lr = opt.lr(name)
    if lr == 0:
        return Reason.ZERO_LR, f"{base}; lr 0 in param group {opt.by_name[name][0]} {at}"
    state = opt.by_name[name][1]
    if not state:
        return Reason.NO_GRAD, (
            f"{base}; the optimizer holds no state for it {at}: it never stepped it (grad None at every step: "
            "unused in forward, detached, or run under torch.no_grad())"
        )
    m = opt.moment(name)
    if m is not None and not bool(m.any()):
        return Reason.ZERO_GRAD, f"{base}; zero moments {at}: every gradient it got was exactly zero"
    if m is not None and not bool(torch.isfinite(m).all()):
        return Reason.NONFINITE_GRAD, f"{base}; NaN/Inf in its optimizer moments {at}"
    if m is not None and (info.dtype.is_floating_point or info.dtype.is_complex):
        dtype = str(info.dtype).replace("torch.", "")
        reason, why = unmoved(dtype)
        return reason, f"{base}; non-zero moments {at}, yet the {dtype} value never changed: {why}"
    return Reason.UNKNOWN, f"{base}; the optimizer has state for it {at}, so it stepped it; nothing explains it"


def _never_moments(m: torch.Tensor | None, dim: int | None, never: torch.Tensor) -> torch.Tensor | None:
    """The optimizer moment of each never-changed slice, one row per slice (None: no moment of that shape)."""
    if m is None:
        return None
    at = never.nonzero().reshape(-1)
    if dim is not None and m.dim() >= 2 and m.shape[dim] == never.shape[0]:
        return m.index_select(dim, at).movedim(dim, 0).reshape(at.numel(), -1)
    if dim is None and m.dim() == 1 and m.shape[0] == never.shape[0]:
        return m[at].reshape(-1, 1)
    return None


def _slice_reason(
    name: str, dim: int | None, never: torch.Tensor, opt: OptimizerView | None, dtype: torch.dtype
) -> tuple[Reason, str]:
    sl = _never_moments(opt.moment(name) if opt is not None else None, dim, never)
    zero_moments = sl is not None and not bool(sl.any())
    moments = f"; zero moments there (optimizer state of checkpoint {opt.checkpoint})" if zero_moments and opt else ""
    if dim == 0 and _EMBEDDING.search(name):
        return Reason.NOT_IN_BATCH, (
            f"never changed in any checkpoint; the name looks like an embedding: tokens never in a batch{moments}"
        )
    if zero_moments:
        return Reason.ZERO_GRAD, f"never changed in any checkpoint{moments}: their gradient was always exactly zero"
    stepped = sl is not None and bool(torch.isfinite(sl).all()) and bool((sl != 0).any(1).all())
    if stepped and opt is not None and (dtype.is_floating_point or dtype.is_complex):
        # every one of them has a non-zero moment: the optimizer moved them by steps their dtype rounded away
        reason, why = unmoved(str(dtype).replace("torch.", ""))
        return reason, (
            f"never changed in any checkpoint (bitwise) while the rest of the tensor did, though each has a "
            f"non-zero optimizer moment (checkpoint {opt.checkpoint}): {why}"
        )
    return Reason.UNKNOWN, "never changed in any checkpoint (bitwise) while the rest of the tensor did"


def diff(
    checkpoints: Sequence[Checkpoint],
    include: NameFilter = None,
    exclude: NameFilter = None,
    progress: Progress | None = None,
    policy: PolicyLike = None,
) -> DiffResult:
    """Compare two or more checkpoints of one model, in training order (see the module docstring);
    `policy` tunes severities as for a run (`gradlog.Policy`)."""
    judged_by = Policy.coerce(policy)
    if len(checkpoints) < 2:
        raise CannotCompare(f"gradlog diff needs two or more checkpoints, got {len(checkpoints)}")
    Selection(include, exclude)  # validates the filters with the same messages as GradLogger
    names, common, infos = _tensors(checkpoints, include, exclude)
    c = len(checkpoints)
    opt, opt_note = _optimizer_view(checkpoints, infos)
    missing = [Missing(n, tuple(i for i in range(c) if n in checkpoints[i])) for n in names if n not in common]
    if progress is not None:
        progress.begin(sum(inf[n].nbytes for inf in infos for n in common))
    meta: list[MetaChange] = []
    skipped: list[str] = []
    report = Report(measured_steps=c, policy=judged_by)
    rel: dict[str, list[float]] = {}
    appeared: list[Appeared] = []
    compared = 0
    for name in common:
        metas = [inf[name] for inf in infos]
        bad_meta = [i for i in range(1, c) if metas[i] != metas[i - 1]]
        if bad_meta or not metas[0].dtype.is_floating_point:  # nothing to compare value by value
            meta += [MetaChange(name, i, metas[i - 1].text(), metas[i].text()) for i in bad_meta]
            if not bad_meta:
                skipped.append(name)
            if progress is not None:
                progress.add(sum(m.nbytes for m in metas))
            continue
        track = _stream(name, metas[0], checkpoints, progress)
        compared += metas[0].nbytes * c
        report.tracked_tensors += 1
        rel[name] = track.rel
        if track.nonfinite is not None:
            appeared.append(track.nonfinite)
        _judge_tensor(report, track, checkpoints, opt, opt_note)
    # NaN/Inf in saved values are this result's `nonfinite` (diff.nonfinite), not the report's first non-finite
    # gradient: checkpoints hold no gradient, and the verdict said both of the one value
    appeared.sort(key=lambda a: (a.checkpoint, names.index(a.name)))
    return DiffResult(
        checkpoints=[ck.label for ck in checkpoints],
        report=report,
        relative_change=rel,
        nonfinite=appeared,
        missing=missing,
        meta_changes=meta,
        optimizer_note=opt_note,
        skipped_non_float=skipped,
        compared_bytes=compared,
    )


def _tensors(
    checkpoints: Sequence[Checkpoint], include: NameFilter, exclude: NameFilter
) -> tuple[list[str], list[str], list[dict[str, TensorInfo]]]:
    """The selected names (in checkpoint order), those every checkpoint holds, and each checkpoint's
    tensor infos; `CannotCompare` when the checkpoints cannot be of one model or the filters leave nothing."""
    keep = _select(include, exclude)
    order: dict[str, None] = {}
    for ck in checkpoints:
        order.update(dict.fromkeys(ck.names))
    every = [n for n in order if all(n in ck for ck in checkpoints)]
    if not every:
        samples = [ck.names[:3] for ck in checkpoints[:2]]
        raise CannotCompare(
            f"the checkpoints have no tensor name in common (e.g. {samples[0]} vs {samples[1]}): "
            "are they checkpoints of the same model?"
        )
    names = [n for n in order if keep(n)]
    if not names:
        shown = ", ".join(repr(n) for n in list(order)[:6])
        raise CannotCompare(
            f"include={include!r}, exclude={exclude!r} leave no tensor to compare; names look like {shown}"
        )
    infos = [{n: ck.info(n) for n in ck.names} for ck in checkpoints]
    if not any(all(inf[n].shape == infos[0][n].shape for inf in infos) for n in every):
        raise CannotCompare(
            f"every one of the {len(every)} tensors the checkpoints share changes shape between them "
            f"(e.g. {every[0]!r}: {infos[0][every[0]].text()} vs {infos[-1][every[0]].text()}): different models?"
        )
    return names, [n for n in every if keep(n)], infos


def _optimizer_view(
    checkpoints: Sequence[Checkpoint], infos: Sequence[dict[str, TensorInfo]]
) -> tuple[OptimizerView | None, str]:
    """The optimizer state of the last checkpoint that holds one (the end of training says the most)."""
    for i in range(len(checkpoints) - 1, -1, -1):
        state = checkpoints[i].optimizer
        if state is not None:
            opt, note = map_optimizer(state, i, checkpoints[i].names, infos[i])
            if opt is not None:
                note = f"checkpoint {i} ({checkpoints[i].label}), matched to tensors {opt.how}"
            return opt, note
    return None, ""


def _judge_tensor(
    report: Report, track: _Track, checkpoints: Sequence[Checkpoint], opt: OptimizerView | None, opt_note: str
) -> None:
    """One streamed tensor's findings: never changed, stopped changing, or slices that never changed."""
    c, name, info = len(checkpoints), track.name, track.info
    if not any(track.changed):
        reason, detail = _never_reason(name, info, opt, opt_note, c)
        report.never_updated.append(NeverUpdated(name, info.shape, math.prod(info.shape), reason, detail))
        return
    last = max(i for i, ch in enumerate(track.changed) if ch)
    if last < c - 2:
        quiet = c - 2 - last
        lr = opt.lr(name) if opt is not None else None
        reason = Reason.ZERO_LR if lr == 0 else Reason.UNKNOWN
        why = f"; lr 0 in its param group (optimizer state of checkpoint {opt.checkpoint})" if lr == 0 and opt else ""
        detail = (
            f"steps are checkpoint intervals: last changed between checkpoint {last} ({checkpoints[last].label}) "
            f"and {last + 1} ({checkpoints[last + 1].label}), then bitwise equal over the last {quiet} "
            f"interval{'s' if quiet != 1 else ''}{why}"
        )
        report.stalled.append(Stalled(name, since_step=last + 1, last_update_step=last, reason=reason, detail=detail))
    for dim, ever in track.slices.items():
        never = ~ever
        count = int(never.sum())
        if 0 < count < never.shape[0]:
            idx = tuple(int(i) for i in never.nonzero().reshape(-1).tolist())
            reason, detail = _slice_reason(name, dim, never, opt, track.info.dtype)
            report.partly_updated.append(PartlyUpdated(name, dim, count, never.shape[0], idx, reason, detail))


def _stream(name: str, info: TensorInfo, checkpoints: Sequence[Checkpoint], progress: Progress | None) -> _Track:
    """One tensor through every checkpoint, two values held at a time."""
    track = _Track(name, info)
    track.slices = {
        d: torch.zeros(info.shape[d] if d is not None else info.shape[0], dtype=torch.bool)
        for d in slice_dims(info.shape)
    }
    prev = checkpoints[0].get(name)
    if tuple(prev.shape) != info.shape:
        raise BadCheckpoint(f"{checkpoints[0].path!r}: tensor {name!r} does not have the shape its header says")
    prev_ss, bad = _first_pass(prev)
    if bad:
        track.nonfinite = Appeared(name, 0, bad)
    if progress is not None:
        progress.add(info.nbytes)
    for i in range(1, len(checkpoints)):
        cur = checkpoints[i].get(name)
        if tuple(cur.shape) != info.shape:
            raise BadCheckpoint(f"{checkpoints[i].path!r}: tensor {name!r} does not have the shape its header says")
        changed, d_ss, cur_ss, bad = _compare(prev, cur, track.slices)
        track.changed.append(changed)
        if not changed:
            track.rel.append(0.0)
        else:
            ref = prev_ss if prev_ss > 0 else cur_ss
            track.rel.append(math.sqrt(d_ss / ref) if ref > 0 else (0.0 if d_ss == 0 else math.inf))
        if bad and track.nonfinite is None:
            track.nonfinite = Appeared(name, i, bad)
        prev, prev_ss = cur, cur_ss
        if progress is not None:
            progress.add(info.nbytes)
    del prev
    return track


def open_all(paths: Sequence[str]) -> list[Checkpoint]:
    """Open every checkpoint (headers only); labels are the shortest distinct path tails."""
    cks = [Checkpoint(p) for p in paths]
    labels = [ck.label for ck in cks]
    if len(set(labels)) < len(labels):
        for ck in cks:
            ck.label = ck.path
    return cks
