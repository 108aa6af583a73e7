"""The end-of-run answer: which tensors never learned, and why."""

from __future__ import annotations

import dataclasses
import enum
import re
import textwrap
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from gradlog.runformat.cells import DIM_NAMES, bare_name
from gradlog.verdict import causes
from gradlog.verdict.judge import (
    ALERT_FINDINGS,
    NAMED_BY_TABLES,
    Verdict,
    finding_lines,
    judge,
    never_kind,
    slice_kinds,
)
from gradlog.verdict.policy import IGNORE, SEVERITIES, WARNING, Policy
from gradlog.verdict.records import (
    ALIASES,
    COUNT,
    DIM,
    FLAG,
    INT,
    NAME_WITH_ALIASES,
    SHAPE,
    SHARE,
    TEXT,
    Record,
    cell,
    ranges,
    simple,
)

R = TypeVar("R", bound=Record)


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
    TINY_UPDATE = "tiny_update"  # fp32/fp64: every update below the value's resolution (a noise-level gradient)
    OVERWRITTEN = "overwritten"  # updated by the optimizer, set back to the same values outside it (a reset, a mask)
    NOT_IN_BATCH = "not_in_batch"  # slices only: embedding rows absent from every measured batch
    PADDING_IDX = "padding_idx"  # slices only: an embedding's padding row, never updated by design
    PRUNED = "pruned"  # slices only: zeroed whole by torch.nn.utils.prune's mask, never updated by design
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


@dataclass(frozen=True)
class Stalled(Record):
    """A tensor that learned, then stopped: no update at any measured step from `since_step` to the end."""

    KIND = "stalled"
    TITLE = "Stopped learning"
    NOUN = "tensor"
    SPARSE = False

    name: str = cell(TEXT)
    since_step: int = cell(INT)  # first optimizer step of the final quiet stretch
    last_update_step: int = cell(INT)  # last measured step with a non-zero update
    reason: Reason = cell(REASON)
    detail: str = cell(TEXT)

    def policy_kind(self) -> str:
        return f"stalled.{self.reason}"


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
class PrecisionLoss(Record):
    """A low-precision tensor whose updates round away in part: on measured steps, `mean_frac` (and at most
    `max_frac`) of its elements had a non-zero gradient and lr > 0, yet kept their value."""

    KIND = "precision"
    TITLE = "Updates rounded away"
    NOUN = "tensor"

    name: str = cell(TEXT)
    dtype: str = cell(TEXT)
    mean_frac: float = cell(SHARE)
    max_frac: float = cell(SHARE)
    steps: int = cell(INT)  # measured steps it was judged on
    detail: str = cell(TEXT)

    def policy_kind(self) -> str:
        return "precision.rounded_away"


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


@dataclass(frozen=True)
class NonFinite:
    """Where a gradient first went NaN/Inf: the step to look at first."""

    step: int
    name: str
    count: int


#: Every kind of finding the `Report` holds, in the order its tables are written and read (`Report.<KIND>`)
FINDINGS: tuple[type[Record], ...] = (NeverUpdated, PartlyUpdated, Stalled, StoppedSlice, IdleExperts, PrecisionLoss)
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
        """The records of one kind of finding (`Report.<kind.KIND>`)."""
        found: list[R] = getattr(self, kind.KIND)
        return found

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
        for kind in FINDINGS:
            records = self.records(kind)
            if not records:
                continue
            if console and kind is NeverUpdated:
                rows = console_rows(self.never_updated)
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
                        "reason": str(getattr(first, "reason", "rounded_away")),
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
        partly_kinds, stopped_kinds = slice_kinds(self)
        judged = {PartlyUpdated.KIND: partly_kinds, StoppedSlice.KIND: stopped_kinds}
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
            **{kind.KIND: self._dicts(kind, policy, judged.get(kind.KIND)) for kind in FINDINGS},
            "first_nonfinite": None if self.first_nonfinite is None else dataclasses.asdict(self.first_nonfinite),
            "hint": self.hint,
            "alerts": [a.to_dict() for a in self.alerts],
            "findings": self.findings(),
        }

    def __str__(self) -> str:
        return self.table()

    def _dicts(self, kind: type[Record], policy: Policy, kinds: list[str] | None) -> list[dict[str, Any]]:
        """`to_dict` of every record of `kind`, with the judge's kind of each where it has one."""
        records = self.records(kind)
        if kinds is None:
            return [r.to_dict(policy) for r in records]
        return [r.to_dict(policy, k) for r, k in zip(records, kinds)]


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
