"""One measured step: device statistics in, one host copy out.

`Meter.start` runs in the optimizer's step pre-hook (gradients as the optimizer sees them, and a
snapshot of the weights), `Meter.finish` in the post-hook (the update really applied). Nothing
is read back until `fetch`, which makes the step's single device-to-host copy.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from gradlog.measure.bucketing import (
    Known,
    histogram_bucket,
    histogram_partials,
    histogram_ranges,
    host_histograms,
    on_host,
)
from gradlog.measure.decay import decay_of
from gradlog.measure.distributed import DistStep, Reducer, dead_fractions, global_rows, neutral_ranges
from gradlog.measure.fingerprint import Fingerprint, changes_all, take_all
from gradlog.measure.flat_shards import global_numel, slice_view
from gradlog.measure.histogram import Histograms
from gradlog.measure.params import ParamTable, Tracked, is_materialized, local_tensor
from gradlog.measure.slice_grads import SliceGrads
from gradlog.measure.slice_moves import SliceMoves
from gradlog.measure.stats import (
    NONFINITE,
    NONZERO,
    SUMSQ,
    HostStep,
    Packer,
    Part,
    Ranges,
    Reads,
    copy_with_sumsq,
    dense_values,
    hist_key,
    host_reads_free,
    norm_partials,
    stat_dtype,
    subtract_with_sumsq,
)
from gradlog.runformat import names
from gradlog.runformat.tags import HISTOGRAM_KINDS, row_tags, tag

#: elements per block of `_host_frozen`: its three small temporaries stay in the L1/L2 cache
_FROZEN_BLOCK = 1 << 15
#: a float's bits as the integer of its width (numpy has no view of bf16 or the 8-bit floats)
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: float dtypes without a negative zero (their sign bit alone is NaN): every bit tells zero from non-zero
_ONE_ZERO = frozenset(getattr(torch, n) for n in ("float8_e4m3fnuz", "float8_e5m2fnuz") if hasattr(torch, n))


def _host_frozen(d: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """CPU: `[count(d == 0 & g != 0), count(g != 0)]` of a low-precision float `d` (before - after) and a float
    gradient `g` of its shape (any float dtype), on their integer bits with the sign bit masked (-0.0 is zero,
    NaN is not), a cache-sized block at a time (numpy): ~4x faster than torch's compares over the whole
    tensor (measured 12.9 vs 56 ms on 4M bf16 values, 0.1 vs 1.0 ms on 65k; a loaded machine)."""
    (d_bits, d_mask), (g_bits, g_mask) = _magnitude_bits(d.dtype), _magnitude_bits(g.dtype)
    dn = d.resolve_neg().contiguous().view(d_bits).numpy().reshape(-1)
    gn = g.resolve_neg().contiguous().view(g_bits).numpy().reshape(-1)
    kept_total = graded_total = 0
    for at in range(0, dn.size, _FROZEN_BLOCK):
        graded = (gn[at : at + _FROZEN_BLOCK] & g_mask) != 0
        graded_total += int(np.count_nonzero(graded))
        graded &= (dn[at : at + _FROZEN_BLOCK] & d_mask) == 0
        kept_total += int(np.count_nonzero(graded))
    return torch.tensor([kept_total, graded_total])


@functools.cache
def _magnitude_bits(dtype: torch.dtype) -> tuple[torch.dtype, Any]:
    """A float dtype's bits as an integer dtype, and the mask of the bits that are zero exactly where the float
    is zero (a numpy scalar): all but the sign bit, or every bit for the dtypes without a negative zero."""
    bits = _BITS[torch.empty((), dtype=dtype).element_size()]
    info = np.iinfo(torch.empty((), dtype=bits).numpy().dtype)
    return bits, info.dtype.type(-1 if dtype in _ONE_ZERO else info.max)


def _device_frozen(d: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """`_host_frozen`'s two counts on an accelerator, with torch's compares: no host read."""
    graded = g != 0
    return torch.stack([torch.count_nonzero(torch.logical_and(d == 0, graded)), torch.count_nonzero(graded)])


@dataclass(frozen=True)
class Clip:
    """One gradient clipping before a step: which tensors (by id), their total norm before it, and max_norm."""

    ids: frozenset[int]
    total: torch.Tensor
    max_norm: float

    def coef(self) -> torch.Tensor:
        """The factor the gradients were multiplied by, as torch.nn.utils.clip_grads_with_norm_ computes it."""
        return torch.clamp(self.max_norm / (self.total.detach().double() + 1e-6), max=1.0)


#: Returns 1/scale (a device tensor) when the gradients the optimizer sees are scaled, else None.
ScaleFn = Callable[[], "torch.Tensor | None"]
#: Returns a device tensor that is non-zero when the optimizer skipped this step, else None.
SkipFn = Callable[[], "torch.Tensor | None"]


#: The most snapshot memory (bytes) kept on the host between measured steps; see `Meter._keeps_snapshot`.
KEEP_SNAPSHOT_BYTES = 16 << 20
#: ... and only while measured steps are at most this many optimizer steps apart.
KEEP_SNAPSHOT_EVERY = 10

#: The default snapshot budget (`GradLogger(snapshot_budget="auto")`): a measured step copies at most this share
#: of the trainable weights' bytes, or SNAPSHOT_FLOOR bytes where that is more (`Meter._pick`).
SNAPSHOT_SHARE = 0.1
SNAPSHOT_FLOOR = 64 << 20
#: `snapshot_budget`: "auto", a number of bytes, or None (every tensor copied on every measured step)
Budget = int | str | None


def budget_bytes(budget: Budget, trainable: int) -> int | None:
    """The bytes of weights one measured step may copy under `budget`, for `trainable` bytes of moving weights."""
    if budget is None:
        return None
    if budget == "auto":
        return max(int(SNAPSHOT_SHARE * trainable), SNAPSHOT_FLOOR)
    assert isinstance(budget, int)
    return budget


def rotation_length(sizes: Sequence[int], budget: int) -> int:
    """Measured steps one round of `Meter._pick` takes over tensors of these byte sizes (in order): each step takes
    the next tensors while they fit in `budget` (at least one), and a round ends at the last tensor."""
    steps, held = 0, 0
    for n in sizes:
        if steps == 0 or held + n > budget:
            steps, held = steps + 1, n
        else:
            held += n
    return steps


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _sumsq(t: torch.Tensor) -> torch.Tensor:
    flat = t.reshape(-1)
    return torch.dot(flat, flat) if flat.numel() else flat.new_zeros(())


def _double(t: torch.Tensor | None) -> torch.Tensor | None:
    """A host part as float64 (None: not queued this step)."""
    return t.double() if t is not None else None


def _every_row(values: torch.Tensor, positions: list[int], n: int) -> torch.Tensor:
    """`values` of the rows at `positions` (sorted), zeros in the other rows of `n`.

    The index is built on the host and sent without waiting (no sync on accelerators).
    """
    if len(positions) == n:
        return values
    out = values.new_zeros((n, *values.shape[1:]))
    if positions:
        out[torch.tensor(positions).to(values.device, non_blocking=True)] = values
    return out


def _per_row(rows: Sequence[Tracked], by_group: list[float | None]) -> list[float | None]:
    """Each row's value of its optimizer param group (`by_group`), None for a row in no group."""
    return [by_group[r.group] if r.group is not None and r.group < len(by_group) else None for r in rows]


def _root(v: float) -> float:
    return math.sqrt(v) if v >= 0 else math.nan  # a sum of squares: NaN stays NaN, inf stays inf


def _ratios(update: list[float], before: list[float], weight: list[float]) -> list[float]:
    """‖Δw‖ / ‖w_before‖ from sums of squares; a tensor that was all zero before is measured against
    ‖w_after‖, and one all zero before and after (so no update either) has ratio 0. NaN weights give a
    NaN ratio, not 0: "no update" would hide the blow-up. Plain floats: a handful of tensors took ~10
    small torch ops, the biggest part of a measured step's bookkeeping."""
    out = []
    for u, b, w in zip(update, before, weight):
        d = b if b > 0 else w
        out.append(math.sqrt(u / d) if d > 0 or d != d else 0.0)  # d != d: NaN
    return out


def _rated_only(ratio: list[float], rated: list[bool] | None) -> list[float]:
    """NaN for the rows whose ratio was not measured (`Measurement.rated`): no number stands in for it."""
    return ratio if rated is None else [r if ok else math.nan for r, ok in zip(ratio, rated)]


@dataclass(frozen=True)
class HostLists:
    """`Measurement.lists`: the columns the ledger, the alerts, the scalars and the overview all read."""

    sumsq: list[float]
    nonzero: list[float]
    nonfinite: list[float]
    grad_norm: list[float]
    weight_norm: list[float]
    numel: list[float]
    ratio: list[float] | None
    before: list[float] | None
    update: list[float] | None
    rated: list[bool] | None = None  # `Measurement.rated`: rows whose `ratio` was measured (None: all)

    def has_ratio(self, i: int) -> bool:
        """Whether row i has a measured update ratio (the caller still checks that the row is in the optimizer)."""
        return self.ratio is not None and (self.rated is None or self.rated[i])


@dataclass
class Measurement:
    """Host-side statistics of one measured step, one row per tracked tensor (`rows`)."""

    index: int
    rows: list[Tracked]
    has_grad: list[bool]
    numel: torch.Tensor
    grad: torch.Tensor  # [n, 3] sum of squares, non-zeros, non-finite (unscaled)
    weight_sumsq: torch.Tensor  # after the step
    before_sumsq: torch.Tensor | None  # before the step, of the tensors the optimizer may move
    update_sumsq: torch.Tensor | None
    lr: list[float | None]
    skipped: bool
    zeros_counted: bool = True  # False: grad[:, NONZERO] only tells all-zero (0) from not (> 0)
    histograms: dict[str, Histograms] = field(default_factory=dict)  # kind -> {row: Histogram}, built lazily
    skipped_total: int | None = None  # optimizer steps skipped so far (GradScaler), when known
    clip_coef: float | None = None  # the clip coefficient of this step (gradlog.clip_grad_norm_), when clipped
    dead_frac: torch.Tensor | None = None  # [n] rows with an all-zero gradient (zero-count steps; NaN: none)
    #: [n] elements with a non-zero gradient whose value the step left unchanged (`Meter._frozen_counts`),
    #: for the rows in `frozen_rows` (moved by the optimizer with lr > 0 and a dense float gradient)
    frozen: torch.Tensor | None = None
    frozen_rows: list[bool] | None = None
    #: [n] elements with a non-zero gradient, counted with `frozen` (the share's denominator)
    frozen_of: torch.Tensor | None = None
    #: per row, whether its update ratio was measured this step (None: every row's was). A row left out of the
    #: step's snapshot budget that changed (`Meter._pick`) has no ratio; its `update_sumsq` is +inf ("moved")
    rated: list[bool] | None = None
    #: per row, its param group's weight_decay where the optimizer shrinks the weights by lr x weight_decay each
    #: step (`decay_of`: AdamW, decoupled Adam, SGD); None elsewhere (and for every row: no optimizer)
    weight_decay: list[float | None] | None = None

    @functools.cached_property
    def frozen_frac(self) -> list[float | None] | None:
        """Per row, `frozen` / `frozen_of` where judged (None elsewhere, and where no element had a gradient).

        The share is of the elements that had a gradient, not of the tensor: rows no batch reached (an
        embedding's unseen ids, positions past the longest sequence) have nothing to round away, and counting
        them diluted the share (a half-unseen bf16 position table showed 38% where 70% of its reached
        elements kept their value)."""
        if self.frozen is None or self.frozen_rows is None or self.frozen_of is None:
            return None
        counts, graded = self.frozen.tolist(), self.frozen_of.tolist()
        return [c / n if ok and n > 0 else None for c, n, ok in zip(counts, graded, self.frozen_rows)]

    @property
    def nonfinite(self) -> torch.Tensor:
        return self.grad[:, NONFINITE]

    @functools.cached_property
    def lists(self) -> HostLists:
        """The step's per-row numbers as Python lists, read out of their tensors once for every consumer."""
        sumsq, nonzero, nonfinite = self.grad.T.tolist() if len(self.grad) else ([], [], [])
        weight = self.weight_sumsq.tolist()
        before = self.before_sumsq.tolist() if self.before_sumsq is not None else None
        update = self.update_sumsq.tolist() if self.update_sumsq is not None else None
        return HostLists(
            sumsq=sumsq,
            nonzero=nonzero,
            nonfinite=nonfinite,
            grad_norm=[_root(v) for v in sumsq],
            weight_norm=[_root(v) for v in weight],
            numel=self.numel.tolist(),
            ratio=_rated_only(_ratios(update, before, weight), self.rated)
            if update is not None and before is not None
            else None,
            before=before,
            update=update,
            rated=self.rated,
        )

    @property
    def zero_frac(self) -> torch.Tensor:
        numel = self.numel.clamp(min=1)
        return (self.numel - self.grad[:, NONZERO]) / numel

    @functools.cached_property
    def update_ratio(self) -> torch.Tensor | None:
        """‖Δw‖ / ‖w_before‖ per row (`lists.ratio`, see `_ratios`), as a tensor."""
        ratio = self.lists.ratio
        return None if ratio is None else torch.tensor(ratio, dtype=torch.float64)

    def scalars(self) -> dict[str, float]:
        """Every per-tensor scalar of this step, the total gradient norm and the clip coefficient, for the writers
        (names: `gradlog.runformat.tags`); the run-level counts are `gradlog.verdict.series.run_level`'s."""
        out: dict[str, float] = {}
        host = self.lists
        gnorm, nf, sumsq, ratios, wnorm = host.grad_norm, host.nonfinite, host.sumsq, host.ratio, host.weight_norm
        zf = self.zero_frac.tolist() if self.zeros_counted else None
        dead = self.dead_frac.tolist() if self.dead_frac is not None else None
        total = 0.0
        for i, row in enumerate(self.rows):
            t_weight, t_grad, t_zero, t_nonfinite, t_ratio, t_dead = row_tags(row.name)
            out[t_weight] = wnorm[i]
            if self.has_grad[i]:
                out[t_grad] = gnorm[i]
                if zf is not None:
                    out[t_zero] = zf[i]
                out[t_nonfinite] = nf[i]
                total += sumsq[i]
            if ratios is not None and row.group is not None and host.has_ratio(i):
                out[t_ratio] = ratios[i]
            if dead is not None and self.has_grad[i] and not math.isnan(dead[i]):
                out[t_dead] = dead[i]
        for i, frac in enumerate((self.frozen_frac or ()) if not self.skipped else ()):
            if frac:  # written while non-zero: a healthy fp32 run writes none of these series
                out[tag("frozen_frac", self.rows[i].name)] = frac
        out[names.GRAD_NORM_TOTAL] = math.sqrt(total) if math.isfinite(total) else total
        if self.clip_coef is not None:
            out[names.CLIP_COEF] = self.clip_coef
        return out


@dataclass
class _Open:
    """Device state held between the pre- and post-hook of one measured step."""

    index: int
    rows: list[Tracked]
    has_grad: list[bool]
    lr: list[float | None]
    grad: torch.Tensor
    histograms: bool  # histograms due
    zeros: bool  # exact zero counts (grad_zero_frac) due
    packer: Packer
    grad_pos: list[int]  # rows that had a gradient (sharded: every row)
    numel: list[float]  # per row
    dist: DistStep | None = None  # sharded parameters: sums pending the step's all_reduce
    before: torch.Tensor | None = None  # the weights' sums of squares before the step (with a snapshot)
    snapshot: list[torch.Tensor] | None = None  # copies of the moving rows' weights (`Meter._snapshot`)
    moving: list[int] = field(default_factory=list)  # rows with a snapshot: in the optimizer and requiring grad
    #: rows the optimizer may move that were fingerprinted instead of copied (`Meter._pick`): whether they changed
    #: is known exactly, how much only where they did not (an update of 0)
    watched: list[int] = field(default_factory=list)
    weight_decay: list[float | None] | None = None  # per row (`Meter._decays`)
    fingerprints: list[Fingerprint] = field(default_factory=list)
    slice_keys: list[int] = field(default_factory=list)  # tensors whose slice evidence this step updated
    # kind -> (counts, moments) of histograms made on the CPU (`bucketing.host_histograms`): no host copy to wait for
    held: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    frozen_rows: list[bool] | None = None  # rows whose frozen count was taken (`Meter._frozen_counts`)


class Meter:
    """Computes one step's statistics on the device; see the module docstring."""

    def __init__(
        self,
        table: ParamTable,
        optimizer: torch.optim.Optimizer | None,
        bins: int,
        histogram_kinds: tuple[str, ...],
        grad_scale: ScaleFn | None = None,
        skipped: SkipFn | None = None,
        reducer: Reducer | None = None,
        skip_count: SkipFn | None = None,
        sample: int | None = None,
        budget: Budget = None,
    ) -> None:
        self.table = table
        self.sample = sample  # histograms of bigger tensors are counted on a sample (`bucketing.sampled`)
        self.budget = budget  # bytes of weights a measured step may copy (`_pick`); None: every tensor
        self._cursor = 0  # `_pick`: the tracked index the next measured step's copies start from
        #: measured steps per round of the snapshot rotation (1: every tensor's update on every measured step)
        self.rotation = 1
        self.snapshot_bytes = 0  # bytes the last measured step copied (and held as fingerprints)
        self.copied: list[str] = []  # the tensors it copied
        self.optimizer = optimizer
        self.bins = bins
        self.histogram_kinds = histogram_kinds
        self.grad_scale = grad_scale
        self.skipped = skipped
        self.reducer = reducer  # makes statistics of sharded (DTensor) parameters global
        self.skip_count = skip_count
        self._open: _Open | None = None
        self._done: tuple[_Open, Packer] | None = None
        self.slice_grads = SliceGrads()  # per-slice "gradient ever non-zero", on the device
        self.slice_moves = SliceMoves()  # per-slice "moved by the optimizer", a tensor's first measured steps
        self._slice_evidence = True  # private: benchmarks/slice_evidence.py flips it for its A/B
        self.tensor_work = 0  # number of start() calls that touched tensors; tests assert on it
        #: CPU: the last snapshot's buffers by row, reused by the next measured step (see `_keeps_snapshot`)
        self._kept: dict[int, torch.Tensor] = {}
        self._last_start = -(1 << 62)  # optimizer step of the last start() with a snapshot
        self.count_frozen = True  # updates rounded away (`_frozen_counts`); False: benchmarks' A/B

    @property
    def busy(self) -> bool:
        return self._open is not None

    @property
    def kept_bytes(self) -> int:
        """Host memory held between measured steps: the snapshot buffers kept for reuse."""
        return sum(t.numel() * t.element_size() for t in self._kept.values())

    def release(self) -> None:
        """Drop the kept snapshot buffers (at close)."""
        self._kept = {}

    @staticmethod
    def _keeps_snapshot(weights: list[torch.Tensor], device: torch.device) -> bool:
        """On the CPU, when measured steps come often (at most KEEP_SNAPSHOT_EVERY optimizer steps apart), the
        snapshot's buffers are kept for the next measured step if they total at most KEEP_SNAPSHOT_BYTES: a
        fresh buffer on every measured step went through glibc's heap, which returned it to the kernel and
        faulted it back in (with the optimizer's own temporaries: ~1,000-2,000 page faults, ~1 ms, per
        measured step of a frozen backbone's 4 MB head). The cap is small because a kept copy is there
        during forward and backward too and raises the step's peak by its size, while a fresh one, made
        after backward, reuses memory the activations freed (the GPT benchmark's 26 MB copy kept: peak
        +30 MB over the baseline instead of +2). Measured rarely (the default every=50) the faults are
        spread thin and nothing is held. On accelerators the caching allocator already reuses memory;
        bigger snapshots are made fresh (in huge pages, see `hostmem`)."""
        if device.type != "cpu":
            return False
        return sum(w.numel() * w.element_size() for w in weights) <= KEEP_SNAPSHOT_BYTES

    def _device(self, rows: list[Tracked]) -> torch.device:
        for r in rows:
            return local_tensor(r.param).device
        return torch.device("cpu")

    @torch.no_grad()
    def start(
        self,
        index: int,
        histograms: bool,
        snapshot: bool,
        zeros: bool = True,
        clips: Sequence[Clip] = (),
    ) -> None:
        """Gradient statistics and (with an optimizer) the weight snapshot, before the step.

        `clips`: the step's gradient clipping (`gradlog.clip_grad_norm_`); the gradients seen here are
        already clipped, so their norms are divided by the clip coefficient: the norms before clipping,
        with no second pass over the gradients."""
        self.tensor_work += 1
        rows, numel = self._measured_rows()
        device = self._device(rows)
        grads = [r.param.grad for r in rows]
        has_grad = [g is not None for g in grads]
        pos = [i for i, h in enumerate(has_grad) if h]
        xs = [dense_values(grads[i]) for i in pos]  # type: ignore[arg-type]
        inv = self.grad_scale() if self.grad_scale is not None else None
        active = self.reducer is not None and self.reducer.active(rows)
        fuse = histograms and "grad" in self.histogram_kinds and not active and self._fuses(xs, device)
        ranges = self._ranges(xs, device) if fuse and zeros else None
        grad = self._grad_partials(xs, pos, len(rows), device, zeros, inv, ranges)
        known = self._grad_known(grad, pos, inv, ranges) if fuse else None
        dist = self.reducer.open(index, rows, device, tracked=len(self.table.live)) if self.reducer and active else None
        op = _Open(
            index=index,
            rows=rows,
            has_grad=has_grad,
            lr=self._lrs(rows),
            grad=grad,
            histograms=histograms,
            zeros=zeros,
            packer=Packer(device),
            grad_pos=pos,
            numel=numel,
            dist=dist,
        )
        op.weight_decay = self._decays(rows)
        if clips and dist is None:
            self._unclip(grad, rows, clips, op.packer)
        op.slice_keys = self._observe_slices(op, grads)
        if dist is not None:
            op.grad_pos = list(range(len(rows)))  # every rank buckets every row; fetch drops rows with no grad anywhere
            xs = [dense_values(g) if g is not None else grad.new_zeros(0) for g in grads]
        self._grad_histogram(op, xs, inv, known)
        if snapshot:
            self._snapshot(op)
        self._open = op

    def _measured_rows(self) -> tuple[list[Tracked], list[float]]:
        """The rows a measured step reads, and their numel (global: a DTensor's or FSDP1 slice's whole tensor's, as
        Tracked.numel).
        Frozen tensors (requires_grad False now) are fingerprinted at start and close only: on a measured step
        they are not read at all (no norms, no histograms), however many a fine-tuning run holds."""
        live = self.table.live
        picked = [
            (r, p)
            for r, p in zip(live, map(Tracked.held, live))
            if p is not None and p.requires_grad and is_materialized(p)
        ]
        return [r for r, _ in picked], [float(global_numel(p)) for _, p in picked]

    def _fuses(self, xs: list[torch.Tensor], device: torch.device) -> bool:
        """Whether this step's histograms of `xs` take what the step already knows of them (`Known`): on the CPU
        (the caller checks that the step is not sharded), the norms' sums of squares for every histogram, sampled or
        not (so a tensor counted in full has the same histogram whatever `sample` is), the ranges for sampled ones."""
        return bool(xs) and on_host(xs, device)

    def _ranges(self, xs: list[torch.Tensor], device: torch.device) -> Ranges | None:
        """A `Ranges` for the tensors of `xs` whose histograms are sampled (None: none to take)."""
        if self.sample is None or not self._fuses(xs, device):
            return None
        want = [x.numel() > self.sample for x in xs]
        return Ranges(want) if any(want) else None

    @staticmethod
    def _known(ranges: Ranges | None, sumsq: list[float] | None, n: int) -> list[Known | None]:
        """Per tensor, the range taken in a pass of the step and the sum of squares of its norm (None: unknown)."""
        found = ranges.found() if ranges is not None else [None] * n
        return [(found[j], sumsq[j] if sumsq is not None else None) for j in range(n)]

    def _grad_known(
        self, grad: torch.Tensor, pos: list[int], inv: torch.Tensor | None, ranges: Ranges | None
    ) -> list[Known | None]:
        """The gradient histograms' `Known`: ranges from the zero count's pass, sums of squares from the norms (as
        the optimizer sees the gradients: read before `_unclip`; left out under AMP, whose norms are unscaled)."""
        col = grad[:, SUMSQ].tolist() if inv is None else None
        return self._known(ranges, [col[i] for i in pos] if col is not None else None, len(pos))

    @staticmethod
    def _grad_partials(
        xs: list[torch.Tensor],
        pos: list[int],
        n: int,
        device: torch.device,
        zeros: bool,
        inv: torch.Tensor | None,
        ranges: Ranges | None = None,
    ) -> torch.Tensor:
        """[n, 3] sum of squares, non-zeros, NaN/Inf of the gradients `xs` (rows `pos`), unscaled by `inv` (AMP).
        Counting zeros is a pass of its own; without it "all zero" still comes from the norm. `ranges`: taken in
        the zero count's pass (`norm_partials`)."""
        if not xs:
            return torch.zeros(n, 3, dtype=stat_dtype(device), device=device)
        part = norm_partials(xs, device, zero_counts=zeros, ranges=ranges)
        if inv is not None:
            part[:, SUMSQ] *= inv.to(part) ** 2
        return _every_row(part, pos, n)

    def _lrs(self, rows: list[Tracked]) -> list[float | None]:
        """Each row's learning rate now (its optimizer group's), None outside the optimizer."""
        group_lr: list[float | None] = []
        for g in self.optimizer.param_groups if self.optimizer is not None else []:
            lr = g.get("lr")
            group_lr.append(float(lr) if lr is not None else None)
        return _per_row(rows, group_lr)

    def _decays(self, rows: list[Tracked]) -> list[float | None] | None:
        """Each row's weight_decay now, where its group's optimizer multiplies the weights by (1 - lr x weight_decay)
        each step (`decay_of`); None outside the optimizer or its groups of another rule. Host reads only."""
        if self.optimizer is None:
            return None
        return _per_row(rows, [decay_of(self.optimizer, g) for g in self.optimizer.param_groups])

    def _observe_slices(self, op: _Open, grads: list[torch.Tensor | None]) -> list[int]:
        """Per-row/column evidence (tensors not yet complete only) and, on zero-count steps, dead_frac, queued on
        the step; returns the tensors whose evidence this step updated. A gradient whose zero count is 0 has every
        slice non-zero: on the CPU that is read from the counts just taken, and those tensors need no per-slice
        pass at all."""
        if not self._slice_evidence:  # private: benchmarks/slice_evidence.py's A/B
            return []
        device, dist, packer = op.packer.device, op.dist, op.packer
        dense: list[bool] | None = None
        if op.zeros and op.grad_pos and dist is None and host_reads_free(device):
            counts = op.grad[:, NONZERO].tolist()
            dense = [
                g is not None and g.layout == torch.strided and counts[i] == g.numel() for i, g in enumerate(grads)
            ]
        keep = dist is not None
        if dist is not None:  # FSDP1 slices: as the whole rows they touch (`FlatShard.rows`)
            grads = [slice_view(g, r.param) if r.flat and g is not None else g for r, g in zip(op.rows, grads)]
        seen = self.slice_grads.observe(op.rows, grads, op.zeros, device, keep_rows=keep, dense=dense, step=op.index)
        if seen.done is not None:
            packer.add("slices_done", seen.done)
        if seen.dead_frac is not None:
            packer.add("dead", seen.dead_frac)
            if dist is not None:  # sharded rows: which are all-zero is known only globally
                dist.add_flag("dead_rows", global_rows(op.rows, seen.rows, device))
        return seen.keys

    def _grad_histogram(
        self, op: _Open, xs: list[torch.Tensor], inv: torch.Tensor | None, known: list[Known | None] | None = None
    ) -> None:
        """The gradient histograms due this step, unscaled by `inv` (AMP): sharded (two-phase, global range), on
        the CPU (kept on the step, `held`) or on an accelerator (a partials block for the step's host copy).
        `known`: `host_histograms`' (CPU)."""
        due = op.histograms and "grad" in self.histogram_kinds and bool(xs)
        h = None
        if op.dist is not None:
            h = self._dist_grad_histogram(op.dist, xs, op.histograms)
        elif due and on_host(xs, op.packer.device):
            counts, moments = host_histograms(xs, self.bins, sample=self.sample, known=known)
            if inv is not None:
                moments[:, :3] *= inv.to(moments)
                moments[:, 3] *= inv.to(moments) ** 2
            op.held["grad"] = counts, moments
        elif due:
            h = histogram_partials(xs, self.bins, op.packer.device, sample=self.sample)
        if h is None:
            return
        if inv is not None:
            h[:, self.bins : self.bins + 3] *= inv.to(h)
            h[:, self.bins + 3] *= inv.to(h) ** 2
        if op.dist is not None:
            op.dist.add(hist_key("grad"), h, keep=(self.bins, self.bins + 1))
        else:
            op.packer.add(hist_key("grad"), h, owned=True)

    def _snapshot(self, op: _Open) -> None:
        """A copy of the weights the optimizer may move, and their sums of squares: a frozen backbone is never
        copied. In the weights' own dtype: one copy, never more (finish() takes the norm of a low-precision
        update in fp32, one tensor at a time)."""
        rows, device = op.rows, op.packer.device
        moving = [i for i, r in enumerate(rows) if r.group is not None and r.param.requires_grad]
        op.moving, op.watched = self._pick(op, moving)
        op.fingerprints = take_all([local_tensor(rows[i].param) for i in op.watched])
        weights = [local_tensor(rows[i].param) for i in op.moving]  # no_grad here: no detach needed
        keep = self._keeps_snapshot(weights, device) and op.index - self._last_start <= KEEP_SNAPSHOT_EVERY
        self._last_start = op.index
        into = [self._kept.get(rows[i].index) for i in op.moving] if keep else None
        op.snapshot, sumsq = copy_with_sumsq(weights, device, into)
        self._kept = {rows[i].index: c for i, c in zip(op.moving, op.snapshot)} if keep else {}
        op.before = _every_row(sumsq, op.moving, len(rows))
        self.snapshot_bytes = sum(map(_nbytes, weights)) + sum(f.nbytes for f in op.fingerprints)
        self.copied = [rows[i].name for i in op.moving]

    def _pick(self, op: _Open, moving: list[int]) -> tuple[list[int], list[int]]:
        """(rows to copy, rows to fingerprint) of the rows the optimizer may move, under the snapshot budget.

        When every such row fits in the budget, all are copied (as without a budget: a tensor without a gradient
        gets its update of 0 and update histogram as a sharded run's ranks give them). Otherwise a row without a
        gradient is fingerprinted, never copied: optimizers leave it as it is, and the fingerprint says so exactly
        (an update of 0), or that it moved after all. The others are copied while their bytes fit
        in the budget; those that do not are fingerprinted (whether they moved stays exact: the verdict's "never
        updated", "stalled" and "updated at step s" keep their evidence) and copied on the next measured steps, in
        the tracked order, a round at a time: each tensor's update ratio is measured once every `rotation` measured
        steps. A tensor larger than the budget is copied alone on its turn.

        Sharded runs (`op.dist`): every rank must copy the same rows (the update histograms and sums are reduced
        row by row), chosen with no collective of its own: from the tensors' whole (global) byte sizes, the tracked
        order and whether any rank's part has a gradient (`DistStep.has_grad`, made global by the pre-hook's header
        exchange), which every rank knows alike, never from its own piece's size or its own gradient (a rank may
        hold none of a tensor). The budget so applies to the whole tensors: each rank holds about 1/world of it."""
        if self.budget is None:
            return moving, []
        rows = op.rows
        size = {i: self._row_bytes(op, i) for i in moving}
        total = sum(size.values())
        limit = budget_bytes(self.budget, total)
        assert limit is not None
        if total <= limit:
            self.rotation = 1
            return moving, []
        has_grad = op.dist.has_grad if op.dist is not None else op.has_grad
        graded = [i for i in moving if has_grad[i]]
        if sum(size[i] for i in graded) <= limit:
            copy = graded
            self.rotation = 1
        else:
            order = sorted(graded, key=lambda i: rows[i].index)
            self.rotation = rotation_length([size[i] for i in order], limit)
            start = next((k for k, i in enumerate(order) if rows[i].index >= self._cursor), 0)
            take: list[int] = []
            held = 0
            for i in order[start:]:
                if take and held + size[i] > limit:
                    break
                take.append(i)
                held += size[i]
            after = start + len(take)
            self._cursor = rows[order[after]].index if after < len(order) else 0
            copy = sorted(take)
        taken = set(copy)
        return copy, [i for i in moving if i not in taken]

    @staticmethod
    def _row_bytes(op: _Open, i: int) -> int:
        """A row's bytes for the snapshot budget: this process's tensor, or under `op.dist` the whole tensor's
        (its global numel), the same number on every rank."""
        t = local_tensor(op.rows[i].param)
        return int(op.numel[i]) * t.element_size() if op.dist is not None else _nbytes(t)

    @staticmethod
    def _unclip(grad: torch.Tensor, rows: list[Tracked], clips: Sequence[Clip], packer: Packer) -> None:
        smallest: torch.Tensor | None = None
        for clip in clips:
            at = [i for i, r in enumerate(rows) if id(r.param) in clip.ids]
            if not at:
                continue
            coef = clip.coef().to(grad.device, grad.dtype)
            idx = torch.tensor(at).to(grad.device, non_blocking=True)
            sumsq = grad[idx, SUMSQ]
            grad[idx, SUMSQ] = torch.where(coef > 0, sumsq / coef.square(), torch.full_like(sumsq, math.inf))
            smallest = coef if smallest is None else torch.minimum(smallest, coef)
        if smallest is not None:
            packer.add("clip_coef", smallest.reshape(1))

    def _dist_grad_histogram(self, dist: DistStep, xs: list[torch.Tensor], due: bool) -> torch.Tensor | None:
        """Sharded gradients: the step-index check and the global histogram range share one all_reduce."""
        assert self.reducer is not None
        if "grad" not in self.histogram_kinds:
            self.reducer.exchange_header(dist, due, None)
            return None
        local = histogram_ranges(xs, dist.device) if due else neutral_ranges(len(xs), dist.device)
        ranges = self.reducer.exchange_header(dist, due, local)
        return histogram_bucket(xs, self.bins, ranges, dist.device) if due and ranges is not None else None

    @torch.no_grad()
    def finish(self) -> None:
        """Weight norms and the applied update, after the step; queues everything for one host copy."""
        op = self._open
        if op is None:
            return
        self._open = None
        device, packer = op.packer.device, op.packer
        weights = [local_tensor(r.param) for r in op.rows]  # no_grad here: no detach needed
        sums: dict[Part, torch.Tensor] = {"grad": op.grad}
        weight: torch.Tensor | None = None  # sums of squares after the step, every row
        hists: list[tuple[str, list[torch.Tensor], list[int] | None]] = []  # kind, tensors, their rows
        if op.histograms and "weight" in self.histogram_kinds and weights:
            hists.append(("weight", weights, None))
        upd_known: list[Known | None] | None = None
        w_ranges: list[tuple[float, float] | None] | None = None  # of the weights, by row
        # the weights not copied: compared with their fingerprints first, their range and norm taken in that read
        reads = self._reads(op, weights, device, bool(hists)) if op.watched else None
        changed = self._changed(op, weights, device, reads) if op.watched else None
        read_sumsq = {op.watched[j]: v for j, v in reads.sumsq().items()} if reads is not None else {}
        if op.snapshot is not None and op.before is not None:
            sums["before"] = op.before
            update = torch.zeros_like(op.before)
            if op.snapshot:
                after = [weights[i] for i in op.moving]
                fuse = op.histograms and op.dist is None and self._fuses(after, device)
                u_r = self._ranges(after, device) if fuse and "update" in self.histogram_kinds else None
                w_r = self._ranges(after, device) if fuse and "weight" in self.histogram_kinds else None
                both = (
                    None
                    if u_r is None and w_r is None
                    else (u_r or Ranges([False] * len(after)), w_r or Ranges([False] * len(after)))
                )
                # fp16/bf16: the difference of two values of different sign rounds in their own dtype,
                # so its norm is taken from an fp32 difference, built and dropped per tensor.
                low = [j for j, a in enumerate(after) if a.is_floating_point() and a.element_size() < 4]
                exact = [_sumsq(after[j].float() - op.snapshot[j].float()) for j in low]
                if op.dist is None:  # the values before the step, at a tensor's first measured steps only
                    self.slice_moves.before(op.index, [op.rows[i].index for i in op.moving], op.snapshot)
                # before - after, in place (no second copy), with the norms of after and of the difference
                moved_weight, moved = subtract_with_sumsq(op.snapshot, after, device, both)
                if op.dist is None:  # which slices the step moved, at a tensor's first measured steps only
                    self.slice_moves.observe(op.index, [op.rows[i].index for i in op.moving], op.snapshot)
                if self.count_frozen:
                    sums["frozen"], sums["frozen_of"], op.frozen_rows = self._frozen_counts(op, device)
                weight = self._merge(moved_weight, op.moving, weights, device, read_sumsq)
                if low:
                    moved[torch.tensor(low, device=device)] = torch.stack(exact).to(device, moved.dtype)
                update = _every_row(moved, op.moving, len(op.rows))
                if fuse:
                    upd_known = self._known(u_r, moved.tolist(), len(after))
                    if w_r is not None:
                        w_ranges = [None] * len(op.rows)
                        for j, r in zip(op.moving, w_r.found()):
                            w_ranges[j] = r
                if op.histograms and "update" in self.histogram_kinds:
                    # The snapshot holds before - after; the histogram is of the update, its negation. The
                    # CPU counts it without negating (one pass fewer); elsewhere it is negated in place, as
                    # the device path would otherwise make a negated copy of each tensor.
                    if op.dist is None:  # bucketed now, so the snapshot is gone before the weights are
                        self._queue_histogram(op, "update", op.snapshot, negate=True, known=upd_known)
                    else:
                        torch._foreach_neg_(op.snapshot)
                        hists.append(("update", op.snapshot, op.moving))
            sums["update"] = update
        if changed is not None:
            if reads is not None:
                w_ranges = w_ranges if w_ranges is not None else [None] * len(op.rows)
                for j, r in enumerate(reads.found()):
                    if r is not None:
                        w_ranges[op.watched[j]] = r
            if op.dist is None:
                sums["changed"] = changed
            else:  # every rank fingerprints its own piece: the tensor changed if any piece did (the SUM is > 0)
                op.dist.add_flag("changed", changed)
        if op.dist is None:
            op.snapshot = None  # the step's one copy of the weights: released before the weight histograms
        if weight is None:
            none = torch.zeros(0, dtype=stat_dtype(device), device=device)
            weight = (
                self._merge(none, [], weights, device, read_sumsq)
                if read_sumsq
                else norm_partials(weights, device, counts=False)[:, SUMSQ]
            )
        sums["weight"] = weight
        flag = self.skipped() if self.skipped is not None else None
        if op.dist is None:
            for key, t in sums.items():  # this step's own results, referenced nowhere else: no copy at fetch
                packer.add(key, t, owned=True)
            for kind, xs, _ in hists:
                w_known = self._weight_known(op, xs, sums["weight"], w_ranges) if kind == "weight" else None
                self._queue_histogram(op, kind, xs, known=w_known)
            if flag is not None:
                packer.add("skipped", flag.reshape(-1)[:1])
        else:
            self._reduce(op.dist, sums, hists, flag, op.has_grad, packer)
        op.snapshot = None
        total = self.skip_count() if self.skip_count is not None else None
        if total is not None:
            packer.add("skipped_total", total.reshape(-1)[:1])
        self._done = (op, packer)

    def _reads(self, op: _Open, weights: list[torch.Tensor], device: torch.device, histograms: bool) -> Reads | None:
        """What the fingerprint compare takes of the rows not copied (`stats.Reads`), on the CPU and unsharded:
        every such row's sum of squares (its weight norm), and the range of those whose weight histogram is
        sampled (`histograms`: a weight histogram is due)."""
        watched = [weights[i] for i in op.watched]
        if op.dist is not None or not on_host(watched, device):
            return None
        sampled = histograms and self._fuses(watched, device)
        want = [sampled and self.sample is not None and w.numel() > self.sample for w in watched]
        return Reads(want, [True] * len(watched))

    @staticmethod
    def _changed(
        op: _Open, weights: list[torch.Tensor], device: torch.device, reads: Reads | None = None
    ) -> torch.Tensor:
        """1 where a fingerprinted row (`_pick`) changed through the step, else 0 (no host read). `reads`: takes
        the range and norm of each row it wants in the same read (`changes_all`'s pieces)."""
        watched = [weights[i] for i in op.watched]
        pieces = (
            [functools.partial(reads.add, j) if reads.takes(j, w) else None for j, w in enumerate(watched)]
            if reads is not None
            else None
        )
        found = changes_all(op.fingerprints, watched, pieces)
        flags = [
            c.any().to(device) if c is not None else torch.ones((), dtype=torch.bool, device=device) for c in found
        ]
        op.fingerprints = []
        return torch.stack(flags).to(op.grad.dtype)

    @staticmethod
    def _frozen_counts(op: _Open, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, list[bool]]:
        """Per row, how many elements had a non-zero gradient and kept their value through the step (the
        snapshot holds before - after here, so "kept" is `== 0`): updates rounded away by the weights' dtype;
        and how many had a non-zero gradient (the share's denominator: elements with no gradient had nothing
        to lose). Rows judged: low-precision floats (fp16, bf16, 8-bit; fp32 is left out: the count is 3
        passes over a tensor, and fp32 loses an update only below ~6e-8 of the value) moved by the optimizer
        with lr > 0, with a dense gradient of the weight's shape.
        Two counts per tensor on the device, stacked: no host read."""
        assert op.snapshot is not None
        judged = [False] * len(op.rows)
        at: list[int] = []
        counts: list[torch.Tensor] = []
        for j, i in enumerate(op.moving):
            lr = op.lr[i]
            g = op.rows[i].param.grad
            d = op.snapshot[j]
            if lr is None or not lr > 0 or g is None or not d.is_floating_point() or d.element_size() >= 4:
                continue  # fp32/fp64 weights: an update rounds away only below ~6e-8 of the value (not counted)
            if not d.numel():
                continue
            g = local_tensor(g)
            if g.layout != torch.strided or g.shape != d.shape:
                continue  # a sparse gradient: which elements it touched is not compared here (cannot tell)
            judged[i] = True
            at.append(i)
            on_cpu = d.device.type == "cpu" and g.device.type == "cpu"
            counts.append(_host_frozen(d, g) if on_cpu else _device_frozen(d, g))
        kept = torch.zeros(len(op.rows), dtype=op.grad.dtype, device=device)
        graded_out = torch.zeros_like(kept)
        if counts:
            stacked = torch.stack([c.to(device) for c in counts]).to(kept.dtype)
            kept = _every_row(stacked[:, 0].contiguous(), at, len(op.rows))
            graded_out = _every_row(stacked[:, 1].contiguous(), at, len(op.rows))
        return kept, graded_out, judged

    def _weight_known(
        self,
        op: _Open,
        weights: list[torch.Tensor],
        sumsq: torch.Tensor,
        ranges: list[tuple[float, float] | None] | None,
    ) -> list[Known | None] | None:
        """The weight histograms' `Known`: the sums of squares of the step's weight norms, and the ranges the
        subtraction took of the copied rows (the others' are read by the histogram: no pass of the step reads
        them piece by piece)."""
        if not self._fuses(weights, op.packer.device) or sumsq.device.type != "cpu":
            return None
        col = sumsq.tolist()
        found = ranges if ranges is not None else [None] * len(weights)
        return [(found[i], col[i]) for i in range(len(weights))]

    def _queue_histogram(
        self,
        op: _Open,
        kind: str,
        xs: list[torch.Tensor],
        negate: bool = False,
        known: list[Known | None] | None = None,
    ) -> None:
        """One kind's histograms of the step: on the CPU its counts and moments are kept on the step (`held`);
        elsewhere its partials block joins the step's host copy. `negate`: of `-x` for each x (on the CPU
        counted without negating; elsewhere `xs` are negated in place, not copied). `known`: `host_histograms`'."""
        device = op.packer.device
        if on_host(xs, device):
            op.held[kind] = host_histograms(xs, self.bins, negate=negate, sample=self.sample, known=known)
            return
        if negate:
            torch._foreach_neg_(xs)
        op.packer.add(hist_key(kind), histogram_partials(xs, self.bins, device, sample=self.sample), owned=True)

    @staticmethod
    def _merge(
        moved: torch.Tensor,
        moving: list[int],
        weights: list[torch.Tensor],
        device: torch.device,
        read: dict[int, float] | None = None,
    ) -> torch.Tensor:
        """Weight sums of squares for every row: the moving rows' came with the update, those in `read` (rows not
        copied, by row: `Reads.sumsq`) with their fingerprint compare, the rest (frozen, not in the optimizer)
        get a norm of their own."""
        out = _every_row(moved, moving, len(weights))
        if read:
            at = list(read)
            out += _every_row(torch.tensor([read[i] for i in at], dtype=out.dtype).to(device), at, len(weights))
        if len(moving) + len(read or ()) < len(weights):
            taken = set(moving) | set(read or ())
            rest = [i for i in range(len(weights)) if i not in taken]
            out += _every_row(
                norm_partials([weights[i] for i in rest], device, counts=False)[:, SUMSQ], rest, len(weights)
            )
        return out

    def _reduce(
        self,
        dist: DistStep,
        sums: dict[Part, torch.Tensor],
        hists: list[tuple[str, list[torch.Tensor], list[int] | None]],
        flag: torch.Tensor | None,
        has_grad: list[bool],
        packer: Packer,
    ) -> None:
        """Sharded parameters: global histogram ranges (one MAX), then every sum of the step (one SUM)."""
        assert self.reducer is not None
        for key, t in sums.items():
            dist.add(key, t)
        dist.add_flag("has_grad", torch.tensor(has_grad, dtype=torch.float64))
        if flag is not None:
            dist.add_flag("skipped", (flag.reshape(-1)[:1] != 0).double())
        if hists:
            ranges = self.reducer.global_ranges(
                dist, torch.cat([histogram_ranges(xs, dist.device) for _, xs, _ in hists])
            )
            at = 0
            for kind, xs, rows in hists:
                h = histogram_bucket(xs, self.bins, ranges[at : at + len(xs)], dist.device)
                at += len(xs)
                dist.add(hist_key(kind), h, rows=rows, keep=(self.bins, self.bins + 1))
        for reduced, t in dist.reduce().items():
            packer.add(reduced, t)

    def abandon(self) -> None:
        """The step raised between the hooks: drop the snapshot."""
        self._open = None

    def fetch(self) -> Measurement | None:
        """The step's one device-to-host copy, then host-side assembly. None when nothing is queued."""
        if self._done is None:
            return None
        op, packer = self._done
        self._done = None
        host = packer.fetch()
        assert host.grad is not None and host.weight is not None  # queued on every measured step (`finish`)
        numel = torch.tensor(op.numel, dtype=torch.float64)
        hists: dict[str, Histograms] = {}
        for kind in HISTOGRAM_KINDS:
            positions = {"grad": op.grad_pos, "update": op.moving}.get(kind, list(range(len(op.rows))))
            # Histogram objects are built when a writer reaches them
            h = host.hist.get(kind)
            if h is not None:
                hists[kind] = Histograms(h, positions)
            elif kind in op.held:
                hists[kind] = Histograms.of(*op.held[kind], positions)
        skipped = bool(host.skipped.item() != 0) if host.skipped is not None else False
        rated = self._rated(op, host)
        if host.slices_done is not None:
            self.slice_grads.mark_done(op.slice_keys, host.slices_done.tolist())
        has_grad = op.has_grad
        if host.has_grad is not None:  # sharded: a tensor has a gradient if any rank has one
            has_grad = [v > 0 for v in host.has_grad.tolist()]
            if "grad" in hists:
                hists["grad"] = hists["grad"].only(has_grad)
                if not hists["grad"]:
                    del hists["grad"]
        if host.dead_rows is not None and host.dead is not None:  # after has_grad: a rank holding none of a tensor
            host.dead = dead_fractions(op.rows, host.dead, host.dead_rows, has_grad)  # still gets its dead_frac
        return Measurement(
            index=op.index,
            rows=op.rows,
            has_grad=has_grad,
            numel=numel,
            grad=host.grad.double(),
            weight_sumsq=host.weight.double(),
            before_sumsq=_double(host.before),
            update_sumsq=_double(host.update),
            lr=op.lr,
            skipped=skipped,
            zeros_counted=op.zeros,
            histograms=hists,
            skipped_total=int(host.skipped_total.item()) if host.skipped_total is not None else None,
            clip_coef=float(host.clip_coef.item()) if host.clip_coef is not None else None,
            dead_frac=host.dead,
            frozen=_double(host.frozen),
            frozen_rows=op.frozen_rows if host.frozen is not None else None,
            frozen_of=_double(host.frozen_of),
            rated=rated,
            weight_decay=op.weight_decay,
        )

    @staticmethod
    def _rated(op: _Open, host: HostStep) -> list[bool] | None:
        """The fingerprinted rows (`_pick`) into the host numbers: one that did not change has an update of 0 and
        its weights before the step are its weights after; one that changed has no ratio this step and an update
        of +inf (it moved: the ledger's evidence); one whose weights are NaN now has a NaN update either way.
        Returns `Measurement.rated` (None: every row has its ratio)."""
        if host.changed is None or host.update is None or host.before is None or host.weight is None:
            return None
        rated = [True] * len(op.rows)
        changed = host.changed.tolist()
        update, before, weight = host.update, host.before, host.weight
        for i, moved in zip(op.watched, changed):
            w = float(weight[i])
            # NaN weights: NaN, as a copy's difference would have it (the ledger reads NaN as "not moved")
            update[i] = math.nan if w != w else math.inf if moved else 0.0
            before[i] = w
            rated[i] = not moved
        return rated
