"""The end-of-run answer: which tensors never learned, and why."""

from __future__ import annotations

import dataclasses
import enum
import re
import textwrap
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar, cast

from gradlog.runformat.cells import DIM_NAMES, bare_name
from gradlog.verdict import causes
from gradlog.verdict.accumulation import AccumulationCleared as AccumulationCleared
from gradlog.verdict.judge import (
    ALERT_FINDINGS,
    NAMED_BY_TABLES,
    Finding,
    Verdict,
    Words,
    by_reason,
    finding_lines,
    judge,
    never_kind,
    nothing_measured,
    per_tensor,
    plural,
    reasons_of,
    slice_kinds,
)
from gradlog.verdict.ledger import NonFinite as NonFinite
from gradlog.verdict.policy import EVENT_SLICES, IGNORE, NOTE, PROBLEM, SEVERITIES, SMALL_SHARE, WARNING, Policy
from gradlog.verdict.precision import PrecisionLoss as PrecisionLoss
from gradlog.verdict.records import (
    ALIASES,
    COUNT,
    DIM,
    FLAG,
    INT,
    NAME_WITH_ALIASES,
    SHAPE,
    TEXT,
    Record,
    cell,
    ranges,
    simple,
)
from gradlog.verdict.records import FINDINGS as FINDINGS
from gradlog.verdict.weight_decay import WeightDecayWipe as WeightDecayWipe

R = TypeVar("R", bound=Record)
#: the verdict line's parts of one kind (`Record.verdict_parts`)
Parts = list[tuple[str, Sequence[Finding]]]


class Reason(str, enum.Enum):
    """Why a tensor never learned. Exactly one per reported tensor, most fundamental first."""

    FROZEN = "frozen"
    NOT_IN_OPTIMIZER = "not_in_optimizer"
    NOT_IN_MODEL = "not_in_model"  # in the optimizer, no longer (or never) in the model: a replaced module
    #: took part in a traced step and got a gradient, but is no parameter of the model (a Python list of modules)
    NOT_REGISTERED = "not_registered"
    NO_GRAD = "no_grad"
    ZERO_LR = "zero_lr"
    ZERO_GRAD = "zero_grad"
    NONFINITE_GRAD = "nonfinite_grad"
    BELOW_PRECISION = "below_precision"  # bf16/fp16: the update rounds away in the weights' dtype
    #: stopped only: bf16/fp16 updates that registered at first, then shrank below the dtype's precision
    SHRANK_BELOW_PRECISION = "shrank_below_precision"
    TINY_UPDATE = "tiny_update"  # fp32/fp64: every update below the value's resolution (a noise-level gradient)
    OVERWRITTEN = "overwritten"  # updated by the optimizer, set back to the same values outside it (a reset, a mask)
    NOT_IN_BATCH = "not_in_batch"  # slices only: embedding rows absent from every measured batch
    PADDING_IDX = "padding_idx"  # slices only: an embedding's padding row, never updated by design
    PRUNED = "pruned"  # zeroed by torch.nn.utils.prune's mask (slices), or zeroed in place after learning, by design
    DEAD_UNITS = "dead_units"  # stopped slices: the same units stopped in the layer's paired tensors too
    NOT_ROUTED = "not_routed"  # experts: the router's rows for them stopped too (no token routed any more)
    UNKNOWN = "unknown"

    def __str__(self) -> str:
        return self.value


def _reason(text: str) -> Reason:
    try:
        return Reason(text)
    except ValueError:
        return Reason.UNKNOWN  # a reason this version does not know: still listed, judged a problem


#: a reason's cell: its value; read back leniently
REASON = simple(lambda r: r.value, _reason, plain=lambda r: r.value)
_WHOLE = "the whole tensor never learned"
#: index ranges a console line shows before it says how many more there are
RANGES_SHOWN = 4

#: Reasons that usually mean the user meant it (fine-tuning with a frozen backbone, padding rows).
INTENTIONAL = frozenset({Reason.FROZEN, Reason.PADDING_IDX, Reason.PRUNED})

#: Alert kinds that are warnings by default (`gradlog.verdict.policy.DEFAULTS`: `alert.<kind>`); a NaN/Inf
#: gradient is the problem `first_nonfinite`, a missing gradient ends in the never-updated table.
WARNING_KINDS = frozenset({"grad_norm_spike", "update_ratio_high", "update_ratio_low"})
RATIO_KINDS = frozenset({"update_ratio_high", "update_ratio_low"})


@dataclass(frozen=True)
class NeverUpdated(Record):
    """One tensor that never learned, with the evidence in `detail`."""

    KIND = "never_updated"
    TITLE = "Never updated"
    NOUN = "tensor"
    SPARSE = False
    #: never updated: whole tensors
    SEVERITY: ClassVar[dict[str, tuple[str, str]]] = {
        "never.frozen": (NOTE, "requires_grad=False on purpose (fine-tuning, adapters): the usual reason to list it"),
        "never.frozen_suspect": (
            PROBLEM,
            "frozen after gradlog started, or a block frozen above the same tensor training in a lower layer: "
            "looks like a mistake (a tensor frozen before training is a note, in a param group or not)",
        ),
        "never.not_in_optimizer": (PROBLEM, f"trainable but in no param group (optimizer built too early?): {_WHOLE}"),
        "never.not_in_model": (PROBLEM, "the optimizer steps a tensor the model no longer has (a replaced head)"),
        "never.not_registered": (
            PROBLEM,
            "used in forward and given a gradient, but no parameter of the model (modules in a Python list, a module "
            f"made in forward(), a buffer registered with requires_grad=True): no optimizer steps it, {_WHOLE}",
        ),
        "never.no_grad": (PROBLEM, f"no gradient ever reached it (unused module, detach, no_grad): {_WHOLE}"),
        "never.zero_lr": (PROBLEM, f"its param group's lr is 0 (a scheduler or a typo): {_WHOLE}"),
        "never.zero_grad": (
            PROBLEM,
            f"its gradient was exactly zero every time (zero_grad misplaced, dead path): {_WHOLE}",
        ),
        "never.nonfinite_grad": (PROBLEM, f"NaN/Inf gradients every time: {_WHOLE}"),
        "never.below_precision": (PROBLEM, f"updates rounded away (pure bf16/fp16 weights): {_WHOLE}"),
        "never.tiny_update": (
            PROBLEM,
            f"an fp32 tensor whose every update was below its resolution (a noise-level gradient, lr far too small): "
            f"{_WHOLE}",
        ),
        "never.overwritten": (
            PROBLEM,
            "updated by the optimizer at every measured step, yet set back to the same values outside it (a reset, a "
            f"mask applied to saved weights, a checkpoint reloaded every step): {_WHOLE}",
        ),
        "never.not_in_batch": (PROBLEM, f"{_WHOLE}, not only some rows"),
        "never.padding_idx": (NOTE, "a padding row, never updated by design"),
        "never.pruned": (
            NOTE,
            "learned, then zeroed whole in place and held at zero, outside the optimizer (every rank of an AdaLoRA "
            "module pruned), by design",
        ),
        "never.unknown": (PROBLEM, "never measured: gradlog cannot say it learned"),
        "never.dead_units": (PROBLEM, f"{_WHOLE} (units, stopped slices' reason: not given to whole tensors today)"),
        "never.not_routed": (PROBLEM, f"{_WHOLE} (experts, stopped slices' reason: not given to whole tensors today)"),
        "never.shrank_below_precision": (
            PROBLEM,
            f"{_WHOLE} (stopped tensors' reason: a tensor that never updated is never_updated.below_precision)",
        ),
    }

    name: str = cell(NAME_WITH_ALIASES)
    shape: tuple[int, ...] = cell(SHAPE)  # "not materialised": a lazy module, never run
    numel: int = cell(COUNT)
    reason: Reason = cell(REASON)
    detail: str = cell(TEXT)
    #: the other names the tensor is tied to: in the name cell (`w (= a, b)`), and after the name in JSON
    aliases: tuple[str, ...] = cell(ALIASES, default=())
    #: a normally intentional reason that looks like a mistake here (frozen, yet in an optimizer
    #: param group, or frozen after the logger started): a finding, not an intention. Written, not printed:
    #: it travels with the table, so `gradlog report` judges the run as close() did.
    suspect: bool = cell(FLAG, shown=False, default=False)

    @property
    def intentional(self) -> bool:
        return self.reason in INTENTIONAL and not self.suspect

    def policy_kind(self) -> str:
        return never_kind(self.reason, self.suspect)

    def policy_names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    def weighed(self, report: Any) -> bool:
        """A run that measured no step has no evidence either way: its `unknown` tensors are listed, and the
        verdict says "nothing measured" instead (issue 41)."""
        return not (nothing_measured(report) and str(self.reason) == "unknown")

    @classmethod
    def verdict_parts(cls, found: Sequence[Finding], report: Any, words: Words) -> Parts:
        """Which tensors never updated, "3 of 12 tensors never updated (no_grad 2, zero_lr 1)", or that all of
        them were (or that nothing was measured); nothing where the diagnosis failed (the judge says so)."""
        if report.error is not None:
            return []
        never = [f for f in found if f.severity != IGNORE]
        ignored = len(found) - len(never)
        n = report.tracked_tensors
        if not never and nothing_measured(report):
            return [(f"nothing measured, so no answer on the {plural(n, 'tracked tensor')}", [])]
        if not never and not ignored:
            return [(words.everything(n), [])]
        if not never:
            return [(f"{n - ignored} of {n} {words.tracked_did} ({ignored} ignored by the policy)", [])]
        more = f", {ignored} more ignored by the policy" if ignored else ""
        return [(f"{len(never)} of {plural(n, 'tensor')} {words.never} ({by_reason(reasons_of(never))}{more})", never)]


@dataclass(frozen=True)
class PartlyUpdated(Record):
    """Slices of a tensor that never changed while the rest of it did: dead units, unseen embedding rows.

    `dim` is 0 (rows: output units, filters, tokens), 1 (columns: input features or channels) or
    None (elements of a 1-D tensor); `indices` are global, sorted, and `never == len(indices)`.
    """

    KIND = "partly_updated"
    TITLE = "Partly updated"
    SPARSE = False
    ABOUT = "slices that never changed"
    #: the markdown's ungrouped table cuts index ranges as the console does
    UNGROUPED_LIMIT = RANGES_SHOWN
    #: partly updated: rows / columns / elements
    SEVERITY: ClassVar[dict[str, tuple[str, str]]] = {
        "partly.frozen": (NOTE, "frozen slices (not produced today; listed for completeness)"),
        "partly.not_in_optimizer": (PROBLEM, "slices left out of the optimizer"),
        "partly.not_in_model": (PROBLEM, "slices the model no longer has"),
        "partly.not_registered": (PROBLEM, "slices outside the model's parameters (not produced today)"),
        "partly.no_grad": (PROBLEM, "slices no gradient reached"),
        "partly.zero_lr": (PROBLEM, "slices with lr 0"),
        "partly.zero_grad": (
            PROBLEM,
            "dead units, filters or experts: capacity lost for good (none on the healthy GPT-2, Mixtral, ViT, ResNet "
            "and LoRA runs of tests/test_calibrated.py)",
        ),
        "partly.nonfinite_grad": (PROBLEM, "slices whose gradient was NaN/Inf"),
        "partly.below_precision": (PROBLEM, "slices whose updates rounded away (pure bf16): stale weights"),
        "partly.tiny_update": (
            NOTE,
            "fp32 elements or slices whose gradient was rounding noise, so no update registered (an attention key "
            "bias: softmax ignores it): harmless on its own; promote it where every element must learn",
        ),
        "partly.overwritten": (
            PROBLEM,
            "rows, columns or elements the optimizer moved that are set back outside it, while the rest of the "
            "tensor learned: a mask re-applied to saved weights (w.data[mask] = w0[mask]) or in place after each step "
            "(w.data.mul_(mask))",
        ),
        "partly.not_in_batch": (
            NOTE,
            "ids or positions no batch contained (rare tokens, the last position under labels=input_ids), or a "
            "layer's input features no batch set with no dead unit upstream: true of most real runs and harmless; "
            "promote it for a table where every row must learn",
        ),
        "partly.padding_idx": (NOTE, "the embedding's padding_idx row, never updated by design"),
        "partly.pruned": (
            NOTE,
            "rows, columns or elements that torch.nn.utils.prune's mask zeroes (the `<name>_orig` parameter's): no "
            "gradient reaches them; or that learned, then were zeroed in place outside the optimizer and held at zero "
            "(AdaLoRA's pruned ranks): by design",
        ),
        "partly.unknown": (PROBLEM, "slices never measured"),
        "partly.dead_units": (PROBLEM, "units that never learned (stopped slices' reason: not given here today)"),
        "partly.few_dead": (
            NOTE,
            f"dead units, filters or experts, at most {SMALL_SHARE:.0%} of their tensor's (counted with its stopped "
            "ones): a few units that never fire are normal in a ReLU network (1 of 64 units of a classification head, "
            "2 of 256 of an MLP encoder); promote it where every unit must learn",
        ),
        "partly.not_routed": (PROBLEM, "experts never routed to (stopped slices' reason: not given here today)"),
        "partly.shrank_below_precision": (
            PROBLEM,
            "slices whose updates rounded away (stopped tensors' reason: not given here today)",
        ),
    }

    name: str = cell(TEXT)
    dim: int | None = cell(DIM)
    never: int = cell(INT)
    total: int = cell(INT)
    indices: tuple[int, ...] = cell(ranges("total", cap=10_000_000))
    reason: Reason = cell(REASON)
    detail: str = cell(TEXT)

    @property
    def intentional(self) -> bool:
        return self.reason in INTENTIONAL

    @property
    def slices(self) -> str:
        """What kind of slice `indices` counts: rows (dim 0), columns (dim 1) or elements (1-D)."""
        return DIM_NAMES.get(self.dim, f"dim {self.dim}")

    def policy_kind(self) -> str:
        return f"partly.{self.reason}"

    @classmethod
    def judged_kinds(cls, report: Any) -> list[str | None]:
        """Dead units weigh by their share of their tensor (`gradlog.verdict.judge.slice_kinds`)."""
        return list(slice_kinds(report)[0])

    @classmethod
    def verdict_parts(cls, found: Sequence[Finding], report: Any, words: Words) -> Parts:
        """Tensors partly never updated over the run, then (`gradlog.check`) in one batch."""
        parts: Parts = []
        for batch, what in ((False, f"partly {words.never}"), (True, "with slices this batch left at zero gradient")):
            partly = [f for f in found if f.in_batch is batch and f.severity != IGNORE]
            if partly:
                tensors = len({f.name for f in partly})
                parts.append((f"{plural(tensors, 'tensor')} {what} ({per_tensor(partly)})", partly))
        return parts


@dataclass(frozen=True)
class Stalled(Record):
    """A tensor that learned, then stopped: no update at any measured step from `since_step` to the end."""

    KIND = "stalled"
    TITLE = "Stopped learning"
    NOUN = "tensor"
    SPARSE = False
    #: stopped learning
    SEVERITY: ClassVar[dict[str, tuple[str, str]]] = {
        **{
            f"stalled.{r}": (PROBLEM, "learned, then stopped: something changed mid-run")
            for r in (r.value for r in Reason)
        },
        "stalled.shrank_below_precision": (
            NOTE,
            "pure bf16/fp16 weights whose updates registered while they learned, then shrank below the dtype's "
            "precision (Adam's steps shrink as a run converges, a schedule decays lr): they learn no further; fp32 "
            "master weights keep refining them",
        ),
    }

    name: str = cell(TEXT)
    since_step: int = cell(INT)  # first optimizer step of the final quiet stretch
    last_update_step: int = cell(INT)  # last measured step with a non-zero update
    reason: Reason = cell(REASON)
    detail: str = cell(TEXT)

    def policy_kind(self) -> str:
        return f"stalled.{self.reason}"

    @classmethod
    def verdict_parts(cls, found: Sequence[Finding], report: Any, words: Words) -> Parts:
        """ "2 tensors stopped learning (zero_grad 2), the first from step 9"."""
        stalled = [f for f in found if f.severity != IGNORE]
        if not stalled:
            return []
        names = {f.name for f in stalled}
        first = min(s.since_step for s in report.records(cls) if s.name in names)
        text = f"{plural(len(stalled), 'tensor')} {words.stopped} ({by_reason(reasons_of(stalled))})"
        return [(f"{text}, the first from step {first}", stalled)]


@dataclass(frozen=True)
class StoppedSlice(Record):
    """Slices of a tensor that had a non-zero gradient at some measured step and none from `since_step` on
    (to the end of the run), while the rest of the tensor kept getting one: units that died mid-run, experts
    no longer routed. `dim` as in `PartlyUpdated`; `last_grad_step` is the last measured step with a non-zero
    gradient in any of them (they stopped between it and `since_step`), -1 where it was not observed: slices
    of a resumed run that had a gradient before the resume and none since (`since_step` is the resume step)."""

    KIND = "stopped_slices"
    TITLE = "Stopped slices"
    ABOUT = "had a gradient, then none to the end"
    #: slices that stopped learning mid-run (rows, columns, elements, experts)
    SEVERITY: ClassVar[dict[str, tuple[str, str]]] = {
        "stopped.dead_units": (
            PROBLEM,
            "units that had a gradient and then none, in the layer's paired tensors too (ReLU units pushed dead): "
            "capacity lost for good",
        ),
        "stopped.not_routed": (
            PROBLEM,
            "experts the router stopped choosing (router collapse): capacity lost for good",
        ),
        "stopped.zero_grad": (PROBLEM, "slices that had a gradient and then none while the rest of the tensor learned"),
        "stopped.few_dead": (
            NOTE,
            f"units, filters or experts that stopped, at most {SMALL_SHARE:.0%} of their tensor's (counted with its "
            f"never-active ones) and fewer than {EVENT_SLICES} at one step: a few ReLU units die in healthy runs",
        ),
        **{
            f"stopped.{r}": (PROBLEM, "slices that learned, then stopped while the rest of the tensor learned")
            for r in (r.value for r in Reason)
            if r not in ("dead_units", "not_routed", "zero_grad")
        },
    }

    name: str = cell(TEXT)
    dim: int | None = cell(DIM)
    stopped: int = cell(INT)
    total: int = cell(INT)
    indices: tuple[int, ...] = cell(ranges("total", cap=10_000_000))
    since_step: int = cell(INT)
    last_grad_step: int = cell(INT)
    reason: Reason = cell(REASON)
    detail: str = cell(TEXT)

    @property
    def slices(self) -> str:
        return DIM_NAMES.get(self.dim, f"dim {self.dim}")

    def policy_kind(self) -> str:
        return f"stopped.{self.reason}"

    @classmethod
    def judged_kinds(cls, report: Any) -> list[str | None]:
        """Dead units weigh by their share of their tensor (`gradlog.verdict.judge.slice_kinds`)."""
        return list(slice_kinds(report)[1])

    @classmethod
    def verdict_parts(cls, found: Sequence[Finding], report: Any, words: Words) -> Parts:
        """ "1 tensor with slices that stopped learning (dead_units 1), the first silent ... from step 7 on"."""
        sliced = [f for f in found if f.severity != IGNORE]
        if not sliced:
            return []
        names = {f.name for f in sliced}
        first = min(r.since_step for r in report.records(cls) if r.name in names)
        text = f"{plural(len(names), 'tensor')} with slices that {words.stopped} ({per_tensor(sliced)})"
        return [(text + f", the first silent at every measured step from step {first} on", sliced)]


@dataclass(frozen=True)
class IdleExperts(Record):
    """Experts of one MoE layer (`layer`: the module holding them) that got no gradient: `state` "never" (at
    no measured step) or "stopped" (from `since_step` on). Derived from the never-updated, partly-updated,
    stalled and stopped-slice records of the layer's expert tensors (`gradlog.verdict.experts`): the same
    finding said per expert, not per row. No severity of its own: the verdict counts the records it is built
    from."""

    KIND = "experts"
    TITLE = "Experts"
    KEY = "layer"

    layer: str = cell(TEXT)
    state: str = cell(TEXT)
    #: the idle experts' indices, and their count in the `idle` column after them
    experts: tuple[int, ...] = cell(ranges("total", cap=1_000_000, cut=False, count="idle"))
    total: int = cell(INT)
    since_step: int = cell(INT)  # -1 for "never"
    reason: Reason = cell(REASON)
    detail: str = cell(TEXT)

    def policy_names(self) -> str:
        return self.layer


@dataclass(frozen=True)
class Alert(Record):
    """A warning raised during training: `step` is the optimizer step it was measured at.

    `value` is the number that crossed the line (an update ratio, a gradient norm, a NaN count) and
    `reference` what it was judged against (the band's edge, the tensor's running median), when any: not in
    the table (an alert read back has neither).
    """

    KIND = "alerts"
    TITLE = "Alerts"

    step: int = cell(INT)
    kind: str = cell(TEXT)
    name: str = cell(TEXT)
    detail: str = cell(TEXT)
    value: float | None = None
    reference: float | None = None


#: Every kind of finding the `Report` holds, in the order its tables are written and read (`Report.<KIND>`, or
#: `Report.extra[KIND]` for a kind registered after these): a kind added later registers itself after them
FINDINGS.register(
    NeverUpdated, PartlyUpdated, Stalled, StoppedSlice, IdleExperts, PrecisionLoss, WeightDecayWipe, AccumulationCleared
)
#: what each table a person reads is called, by the `Report` field its rows come from
TITLES = {r.KIND: r.TITLE for r in FINDINGS}
#: The tables' columns, from the records (the console shows the never-updated table without `suspect`).
COLUMNS = NeverUpdated.columns()
TABLE_COLUMNS = NeverUpdated.columns(written=True)
PARTLY_COLUMNS = PartlyUpdated.columns()
STALLED_COLUMNS = Stalled.columns()
STOPPED_COLUMNS = StoppedSlice.columns()
EXPERT_COLUMNS = IdleExperts.columns()
PRECISION_COLUMNS = PrecisionLoss.columns()
ALERT_COLUMNS = Alert.columns()


@dataclass(frozen=True)
class Section:
    """One non-empty table of a `Report` as a person reads it: `key` is the `Report` field its rows come
    from (a key of `TITLES`), so a view picks tables by what they hold, not by their heading's text."""

    key: str
    heading: str  # the title and its count: "Stopped learning (2 tensors)"
    columns: list[str]
    rows: list[list[str]]


@dataclass
class Report:
    """What `GradLogger.close()` returns: the never-updated tensors and the run's headline numbers."""

    never_updated: list[NeverUpdated] = field(default_factory=list)
    partly_updated: list[PartlyUpdated] = field(default_factory=list)
    stalled: list[Stalled] = field(default_factory=list)
    #: slices (rows, columns, elements, experts) that had a gradient, then none to the end (`StoppedSlice`)
    stopped_slices: list[StoppedSlice] = field(default_factory=list)
    #: the experts of each MoE layer that got no gradient, never or from some step on (`IdleExperts`)
    experts: list[IdleExperts] = field(default_factory=list)
    #: tensors whose updates round away in part (`PrecisionLoss`)
    precision: list[PrecisionLoss] = field(default_factory=list)
    #: tensors whose weight decay wipes them every step (`WeightDecayWipe`)
    weight_decay: list[WeightDecayWipe] = field(default_factory=list)
    accumulation: list[AccumulationCleared] = field(default_factory=list)
    first_nonfinite: NonFinite | None = None
    optimizer_steps: int = 0
    measured_steps: int = 0
    skipped_steps: int = 0
    tracked_tensors: int = 0
    #: measured steps per round of the snapshot budget's rotation (`GradLogger(snapshot_budget=...)`): each
    #: tensor's update ratio is measured once every that many measured steps (1: on every one)
    update_rotation: int = 1
    error: str | None = None  # the diagnosis itself failed (close() warned); never_updated is then unknown
    #: what training warned about (update ratio out of the tensor's band, gradient-norm spikes, no gradient):
    #: listed, never a PROBLEM by themselves; NaN/Inf gradients are the problem `first_nonfinite`
    alerts: list[Alert] = field(default_factory=list)
    #: one mistake that explains every record at once (zero_grad() in the wrong place, an optimizer built
    #: for another model or before the adapters): said once, not on every row
    hint: str | None = None
    #: how much each kind of finding matters (`gradlog.verdict.policy`); None: the defaults
    policy: Policy | None = None
    #: the records of the kinds without a field of their own (registered after the built-in ones), by `KIND`
    extra: dict[str, list[Record]] = field(default_factory=dict)

    def judged(self) -> Verdict:
        """The judge's verdict on this report under its policy (`gradlog.verdict.judge`)."""
        return judge(self)

    @property
    def healthy(self) -> bool:
        """True when no finding is a problem under the policy (`gradlog.verdict.judge`)."""
        return judge(self).healthy

    @property
    def status(self) -> str:
        """ "OK" or "PROBLEM", as the verdict line begins."""
        return judge(self).status

    def warning_alerts(self) -> list[Alert]:
        """The alerts the verdict counts (not ignored by the policy). An alert on a tensor that never updated
        or stopped learning is left out: the table already names that tensor, with its reason."""
        found = {r.name for r in self.never_updated} | {r.name for r in self.stalled}
        policy = self.policy or Policy()
        return [
            a
            for a in self.alerts
            if a.kind in ALERT_FINDINGS
            and not (a.kind in NAMED_BY_TABLES and a.name in found)
            and policy.severity(f"alert.{a.kind}", a.name) != IGNORE
        ]

    def warnings(self) -> dict[str, int]:
        """Warning-severity findings per kind (`alert.update_ratio_high`, ...; with the default policy only alerts)."""
        out: dict[str, int] = {}
        for f in judge(self).of(WARNING):
            kind = f.kind.removeprefix("alert.")
            out[kind] = out.get(kind, 0) + 1
        return out

    def severities(self) -> dict[str, int]:
        """Findings per severity (problem, warning, note, ignore)."""
        out: dict[str, int] = {}
        for f in judge(self).findings:
            out[f.severity] = out.get(f.severity, 0) + 1
        return out

    def counts(self) -> dict[str, int]:
        """Never-updated tensors per reason."""
        return _count(r.reason for r in self.never_updated)

    def partly_counts(self) -> dict[str, int]:
        """Partly-updated records per reason."""
        return _count(r.reason for r in self.partly_updated)

    def stalled_counts(self) -> dict[str, int]:
        """Stalled tensors per reason."""
        return _count(r.reason for r in self.stalled)

    @property
    def verdict(self) -> str:
        """One line a user can act on."""
        return judge(self).text

    def records(self, kind: type[R]) -> list[R]:
        """The records of one kind of finding (`Report.<kind.KIND>`, or `extra[kind.KIND]`)."""
        found = getattr(self, kind.KIND) if kind.KIND in _FIELDS else self.extra.get(kind.KIND, [])
        return cast("list[R]", found)

    def with_records(self, found: dict[type[Record], list[Record]]) -> Report:
        """This report with the records of each kind in `found` (its field, or `extra`) replaced."""
        own = {kind.KIND: records for kind, records in found.items() if kind.KIND in _FIELDS}
        extra = {kind.KIND: records for kind, records in found.items() if kind.KIND not in _FIELDS}
        out = dataclasses.replace(self, extra={**self.extra, **extra})
        for key, records in own.items():
            setattr(out, key, records)
        return out

    def sections(self, console: bool = False, grouped: bool = False) -> list[Section]:
        """The non-empty tables a person reads, never-updated first.

        `grouped` (and `console`): one row per cause (`gradlog.verdict.causes`: a layer's tensors left out of
        the optimizer, the units of a layer that died at one step in every tensor they touch), its detail
        naming the tensors once; the records themselves (and the written tables) stay one per tensor. On the
        console, intentionally frozen tensors also fold into one line per module subtree and index ranges
        are cut; the count in a heading is of records, or of findings when grouped."""
        grouped = grouped or console
        limit = RANGES_SHOWN if console else None
        out = []
        weighed = [r for r in self.never_updated if r.weighed(self)]  # nothing measured: no table of "unknown"
        for kind in FINDINGS:
            records: Sequence[Record] = self.records(kind)
            if console and kind is NeverUpdated:  # the verdict says "nothing measured" instead
                records = weighed
            if not records:
                continue
            if console and kind is NeverUpdated:
                rows = console_rows(weighed)
            elif grouped:
                rows = grouped_rows(kind.KIND, records, lambda r: r.row(limit))
            else:
                rows = [r.row(kind.UNGROUPED_LIMIT) for r in records]
            heading = f"{kind.TITLE} ({self._counted(kind, records, grouped)})"
            out.append(Section(kind.KIND, heading, kind.columns(), rows))
        return out

    def _counted(self, kind: type[Record], records: Sequence[Record], grouped: bool) -> str:
        """What a table's heading counts: "3 of 10 tensors" never updated; "2 tensors", or "1 finding in 3
        records" when grouped, with what the table holds after it."""
        n = len(records)
        if kind is NeverUpdated:
            return f"{n} of {self.tracked_tensors} tensors"
        k = len(causes.group(kind.KIND, records)) if grouped else n
        noun = kind.NOUN
        text = f"{n} {noun}{'s' * (n != 1)}" if k == n else f"{k} finding{'s' * (k != 1)} in {n} {noun}s"
        return f"{text}: {kind.ABOUT}" if kind.ABOUT else text

    def findings(self) -> list[dict[str, Any]]:
        """One finding per cause (`gradlog.verdict.causes`) of the record tables, in table order: the table, what
        names it (a tensor, or the module of several), the tensors it touches once each (`touched` with their
        slices), its reason, its severity under the policy (the worst of its records'), its records' count
        and the full detail of its first record. What the tab lists; `to_dict()["findings"]`."""
        policy = self.policy or Policy()
        out: list[dict[str, Any]] = []
        for kind in FINDINGS:
            for group in causes.group(kind.KIND, self.records(kind)):
                first = group[0]
                kinds = [r.policy_kind() for r in group]
                if kinds[0] is None:  # no severity of its own (the experts: said of the records they are built from)
                    break
                severities = [policy.severity(str(k), r.policy_names()) for k, r in zip(kinds, group)]
                out.append(
                    {
                        "table": kind.KIND,
                        "label": causes.label(kind.KIND, group),
                        "tensors": list(dict.fromkeys(bare_name(r.name) for r in group)),
                        "touched": causes.touched(kind.KIND, group),
                        "kind": kinds[0],
                        "reason": str(getattr(first, "reason", str(kinds[0]).split(".", 1)[1])),
                        "severity": min(severities, key=SEVERITIES.index),
                        "records": len(group),
                        "detail": first.detail,
                    }
                )
        return out

    def warning_lines(self) -> list[str]:
        """One line per warning and note kind, naming the first few tensors (notes are listed, never hidden)."""
        return finding_lines(judge(self))

    def table(self) -> str:
        """The console text: the tables (never updated, with intentionally frozen tensors one line per
        module subtree; partly updated; stopped learning), the run-level hint once, the warnings and notes,
        the verdict."""
        blocks = [
            f"{s.heading}:\n{format_table(s.columns, s.rows, CONSOLE_WIDTH)}" for s in self.sections(console=True)
        ]
        lines = ([f"hint: {self.hint}"] if self.hint else []) + self.warning_lines()
        tail = [wrapped(line, CONSOLE_WIDTH, "  ") for line in lines] + [self.verdict]  # the verdict: one line to grep
        return "\n\n".join([*blocks, "\n".join(tail)])

    def markdown(self) -> str:
        """The same as markdown (TensorBoard's text plugin renders it)."""
        lines = []
        for section in self.sections():
            lines.append(f"**{section.heading}**")
            lines.append("")
            lines.append(markdown_table(section.columns, section.rows))
            lines.append("")
        if self.hint:
            lines.append(f"hint: {self.hint}")
            lines.append("")
        for line in self.warning_lines():
            lines.append(line)
            lines.append("")
        lines.append(f"**{self.verdict}**")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types: booleans, numbers, lists; reasons as their string values; each record's
        `severity` under the policy."""
        v = judge(self)
        policy = self.policy or Policy()
        return {
            "healthy": v.healthy,
            "status": v.status,
            "verdict": v.text,
            "severities": {s: v.count(s) for s in ("problem", "warning", "note", "ignore")},
            "policy": [dict(zip(("kind", "pattern", "severity"), r)) for r in policy.rows()],
            "optimizer_steps": self.optimizer_steps,
            "measured_steps": self.measured_steps,
            "skipped_steps": self.skipped_steps,
            "tracked_tensors": self.tracked_tensors,
            "error": self.error,
            **{kind.KIND: self._dicts(kind, policy) for kind in FINDINGS},
            "first_nonfinite": None if self.first_nonfinite is None else dataclasses.asdict(self.first_nonfinite),
            "hint": self.hint,
            "alerts": [a.to_dict() for a in self.alerts],
            "findings": self.findings(),
        }

    def __str__(self) -> str:
        return self.table()

    def _dicts(self, kind: type[Record], policy: Policy) -> list[dict[str, Any]]:
        """`to_dict` of every record of `kind`, with the judge's kind of each (`Record.judged_kinds`)."""
        return [r.to_dict(policy, k) for r, k in zip(self.records(kind), kind.judged_kinds(self))]


#: the `Report` fields that hold a kind's records (the built-in kinds'); others are in `Report.extra`
_FIELDS = frozenset(kind.KIND for kind in FINDINGS)
#: a kind registered later takes none of the report's other names (its JSON keys would collide)
FINDINGS.reserved |= {f.name for f in dataclasses.fields(Report)} - _FIELDS
FINDINGS.reserved |= set(Report().to_dict()) - _FIELDS


def _count(reasons: Iterable[Reason]) -> dict[str, int]:
    out: dict[str, int] = {}
    for reason in reasons:
        out[reason.value] = out.get(reason.value, 0) + 1
    return out


def markdown_table(columns: list[str], rows: list[list[str]]) -> str:
    """A markdown table; `|` in a cell is escaped."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in row) + " |")
    return "\n".join(lines)


#: the console's width: tables whose last column (the detail) would run past it print that column under
#: each row, wrapped (the full text stays in the records, `to_dict()`, the written tables and the tab)
CONSOLE_WIDTH = 100
#: how far a detail printed under its row is indented
DETAIL_INDENT = "    "


def wrapped(text: str, width: int, indent: str) -> str:
    """`text` wrapped at spaces to `width` columns, later lines indented by `indent`; a word longer than the
    width (a long tensor name) stays whole."""
    return (
        textwrap.fill(text, width, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)
        if len(text) > width
        else text
    )


def format_table(columns: list[str], rows: list[list[str]], width: int | None = None) -> str:
    """Columns padded to their widest cell. With `width`, a table wider than that prints its last column
    under each row instead, wrapped to `width` (a detail of 300 characters made 400-column lines)."""
    widths = [len(c) for c in columns]
    for row in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row)]
    sep = "  "
    below = width is not None and len(columns) > 1 and sum(widths) + len(sep) * (len(widths) - 1) > width
    shown = widths[:-1] if below else widths
    # still too wide (a long tensor or module name): each name on a line of its own, its other cells under it
    apart = width is not None and len(shown) > 2 and sum(shown) + len(sep) * (len(shown) - 1) > width
    cells = (lambda r: [r[0], NAME_INDENT + line(r[1:], shown[1:])]) if apart else (lambda r: [line(r, shown)])
    rule = sep.join("-" * w for w in (shown[1:] if apart else shown))
    out = [*cells(columns), (NAME_INDENT if apart else "") + rule]
    for row in rows:
        out += cells(row)
        if below and width is not None and len(row) == len(columns) and row[-1]:
            out.append(wrapped(DETAIL_INDENT + row[-1], width, DETAIL_INDENT))
    return "\n".join(out)


#: the cells under a name that has a line of its own (`format_table`)
NAME_INDENT = "  "


def line(cells: Sequence[str], widths: Sequence[int]) -> str:
    """One table line: `cells` padded to `widths`, two spaces apart (cells past `widths` are not shown)."""
    return "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()


#: the end of a stopped slice's detail that names its peers (`gradlog.verdict.stopped_slices`)
_PEERS = re.compile(r"; the same \d+ stopped in [^;]*$")


def grouped_rows(key: str, records: Sequence[Any], row: Callable[[Any], list[str]]) -> list[list[str]]:
    """One row per cause (`gradlog.verdict.causes`) of the `key` table's `records`: a cause of one record is
    that record's row; of several, the name cell is their module, a cell their records share is said once,
    others list each record's value, and the detail names the tensors touched, then the first record's
    detail."""
    out: list[list[str]] = []
    for group in causes.group(key, records):
        rows = [row(r) for r in group]
        if len(rows) == 1:
            out.append(rows[0])
            continue
        cells = [", ".join(dict.fromkeys(col)) for col in zip(*rows)]
        cells[0] = causes.label(key, group)
        tensors = causes.touched(key, group)
        detail = _PEERS.sub("", rows[0][-1])  # "the same 8 stopped in <the other tensors>": listed here already
        cells[-1] = f"{len(tensors)} tensors ({', '.join(tensors)}): {detail}"
        out.append(cells)
    return out


#: The console shows intentionally frozen tensors in at most this many lines (module subtrees).
MAX_FROZEN_LINES = 8


def _human(n: int) -> str:
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return str(n)


def _subtree(name: str) -> str:
    """The module subtree a tensor belongs to, with layer indices folded: transformer.h.3.attn.w -> transformer.h.*"""
    parts = bare_name(name).split(".")
    for i, p in enumerate(parts[:-1]):
        if p.isdigit() and i > 0:
            return ".".join(parts[:i]) + ".*"
    return ".".join(parts[:-1]) + ".*" if len(parts) > 1 else parts[0]


def _parent(key: str) -> str:
    parts = key.removesuffix(".*").split(".")
    return ".".join(parts[:-1]) + ".*" if len(parts) > 1 else key


def console_rows(records: list[NeverUpdated]) -> list[list[str]]:
    """Findings first, one row each; then the intentionally frozen tensors, one line per module subtree
    (a fine-tuning run freezes thousands: they would bury the rows that matter). `Report.never_updated`
    and the writers' table keep every row."""
    findings = grouped_rows("never_updated", [r for r in records if not r.intentional], NeverUpdated.row)
    frozen = [r for r in records if r.intentional]
    groups: dict[str, list[NeverUpdated]] = {}
    for r in frozen:
        groups.setdefault(_subtree(r.name), []).append(r)
    while len(groups) > MAX_FROZEN_LINES:  # coarsen the deepest keys one level at a time
        depth = max(k.count(".") for k in groups)
        merged: dict[str, list[NeverUpdated]] = {}
        for k, rs in groups.items():
            merged.setdefault(_parent(k) if k.count(".") == depth else k, []).extend(rs)
        if len(merged) == len(groups) and merged.keys() == groups.keys():
            break
        groups = merged
    out = findings
    for key, rs in groups.items():
        if len(rs) == 1:
            out.append(rs[0].row())
            continue
        reasons = sorted({r.reason.value for r in rs})
        numel = sum(r.numel for r in rs)
        out.append(
            [key, "-", str(numel), "/".join(reasons), f"{len(rs)} tensors, {_human(numel)} params: {'/'.join(reasons)}"]
        )
    return out
