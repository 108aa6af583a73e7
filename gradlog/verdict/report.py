"""The end-of-run answer: which tensors never learned, and why."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any


class Reason(str, enum.Enum):
    """Why a tensor never learned. Exactly one per reported tensor, most fundamental first."""

    FROZEN = "frozen"
    NOT_IN_OPTIMIZER = "not_in_optimizer"
    NOT_IN_MODEL = "not_in_model"  # in the optimizer, no longer (or never) in the model: a replaced module
    NO_GRAD = "no_grad"
    ZERO_LR = "zero_lr"
    ZERO_GRAD = "zero_grad"
    NONFINITE_GRAD = "nonfinite_grad"
    BELOW_PRECISION = "below_precision"
    NOT_IN_BATCH = "not_in_batch"  # slices only: embedding rows absent from every measured batch
    PADDING_IDX = "padding_idx"  # slices only: an embedding's padding row, never updated by design
    UNKNOWN = "unknown"

    def __str__(self) -> str:
        return self.value


#: Reasons that usually mean the user meant it (fine-tuning with a frozen backbone, padding rows).
INTENTIONAL = frozenset({Reason.FROZEN, Reason.PADDING_IDX})

COLUMNS = ["name", "shape", "numel", "reason", "detail"]
#: Alert kinds that are warnings in the verdict: listed, never a PROBLEM (the alert kinds are in verdict/alerts.py;
#: a NaN/Inf gradient is the problem `first_nonfinite`, a missing gradient ends in the never-updated table).
WARNING_KINDS = frozenset({"grad_norm_spike", "update_ratio_high", "update_ratio_low"})
PARTLY_COLUMNS = ["name", "dim", "never", "total", "indices", "reason", "detail"]
STALLED_COLUMNS = ["name", "since_step", "last_update_step", "reason", "detail"]


@dataclass(frozen=True)
class NeverUpdated:
    """One tensor that never learned, with the evidence in `detail`."""

    name: str
    shape: tuple[int, ...]
    numel: int
    reason: Reason
    detail: str
    aliases: tuple[str, ...] = ()
    #: a normally intentional reason that looks like a mistake here (frozen, yet in an optimizer
    #: param group, or frozen after the logger started): a finding, not an intention
    suspect: bool = False

    @property
    def intentional(self) -> bool:
        return self.reason in INTENTIONAL and not self.suspect

    def row(self) -> list[str]:
        name = self.name if not self.aliases else f"{self.name} (= {', '.join(self.aliases)})"
        return [name, "x".join(map(str, self.shape)) or "scalar", str(self.numel), self.reason.value, self.detail]


@dataclass(frozen=True)
class PartlyUpdated:
    """Slices of a tensor that never changed while the rest of it did: dead units, unseen embedding rows.

    `dim` is 0 (rows: output units, filters, tokens), 1 (columns: input features or channels) or
    None (elements of a 1-D tensor); `indices` are global, sorted, and `never == len(indices)`.
    """

    name: str
    dim: int | None
    never: int
    total: int
    indices: tuple[int, ...]
    reason: Reason
    detail: str


@dataclass(frozen=True)
class Stalled:
    """A tensor that learned, then stopped: no update at any measured step from `since_step` to the end."""

    name: str
    since_step: int  # first optimizer step of the final quiet stretch
    last_update_step: int  # last measured step with a non-zero update
    reason: Reason
    detail: str


@dataclass(frozen=True)
class Alert:
    """A warning raised during training: `step` is the optimizer step it was measured at.

    `value` is the number that crossed the line (an update ratio, a gradient norm, a NaN count) and
    `reference` what it was judged against (the band's edge, the tensor's running median), when any.
    """

    step: int
    kind: str
    name: str
    detail: str
    value: float | None = None
    reference: float | None = None

    def row(self) -> list[str]:
        return [str(self.step), self.kind, self.name, self.detail]


@dataclass(frozen=True)
class NonFinite:
    """Where a gradient first went NaN/Inf: the step to look at first."""

    step: int
    name: str
    count: int


@dataclass
class Report:
    """What `GradLogger.close()` returns: the never-updated tensors and the run's headline numbers."""

    never_updated: list[NeverUpdated] = field(default_factory=list)
    partly_updated: list[PartlyUpdated] = field(default_factory=list)
    stalled: list[Stalled] = field(default_factory=list)
    first_nonfinite: NonFinite | None = None
    optimizer_steps: int = 0
    measured_steps: int = 0
    skipped_steps: int = 0
    tracked_tensors: int = 0
    error: str | None = None  # the diagnosis itself failed (close() warned); never_updated is then unknown
    #: what training warned about (update ratio out of the tensor's band, gradient-norm spikes, no gradient):
    #: listed, never a PROBLEM by themselves; NaN/Inf gradients are the problem `first_nonfinite`
    alerts: list[Alert] = field(default_factory=list)
    #: one mistake that explains every record at once (zero_grad() in the wrong place, an optimizer built
    #: for another model or before the adapters): said once, not on every row
    hint: str | None = None

    @property
    def healthy(self) -> bool:
        """True when nothing is suspicious: only intentionally frozen tensors may be listed."""
        if self.error is not None:
            return False
        return self.first_nonfinite is None and all(r.intentional for r in self.never_updated)

    def warnings(self) -> dict[str, int]:
        """Alert kinds that are warnings, with their counts (the NaN alert is `first_nonfinite`)."""
        out: dict[str, int] = {}
        for a in self.alerts:
            if a.kind in WARNING_KINDS:
                out[a.kind] = out.get(a.kind, 0) + 1
        return out

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for rec in self.never_updated:
            out[rec.reason.value] = out.get(rec.reason.value, 0) + 1
        return out

    @property
    def verdict(self) -> str:
        """One line a user can act on."""
        n = len(self.never_updated)
        parts = []
        if self.first_nonfinite is not None:  # first: the one thing to look at before anything else
            f = self.first_nonfinite
            parts.append(f"first non-finite gradient at step {f.step} in {f.name}")
        if self.error is not None:
            parts.append(f"the diagnosis failed ({self.error}); which tensors never updated is unknown")
        elif n == 0:
            parts.append(f"all {self.tracked_tensors} tracked tensors were updated")
        else:
            by = ", ".join(f"{k} {v}" for k, v in self.counts().items())
            parts.append(f"{n} of {self.tracked_tensors} tensors never updated ({by})")
        if self.skipped_steps:
            parts.append(f"{self.skipped_steps} optimizer step{'s' if self.skipped_steps != 1 else ''} skipped")
        warned = self.warnings()
        if warned:
            k = sum(warned.values())
            by = ", ".join(f"{kind} {v}" for kind, v in warned.items())
            parts.append(f"{k} warning{'s' * (k != 1)} ({by})")
        head = "OK" if self.healthy else "PROBLEM"
        steps = f" ({self.optimizer_steps} optimizer steps, {self.measured_steps} measured)"
        return f"gradlog {head}: " + "; ".join(parts) + steps

    def rows(self) -> list[list[str]]:
        return [r.row() for r in self.never_updated]

    def warning_lines(self) -> list[str]:
        """One line per warning kind, naming the first few tensors."""
        out = []
        for kind in self.warnings():
            names = [a.name for a in self.alerts if a.kind == kind]
            shown = ", ".join(names[:4]) + (f", and {len(names) - 4} more" if len(names) > 4 else "")
            out.append(f"warning: {kind} in {len(names)} tensor{'s' * (len(names) != 1)}: {shown}")
        return out

    def table(self) -> str:
        """The console text: the never-updated table (intentionally frozen tensors one line per module
        subtree), the run-level hint once, the warnings, and the verdict."""
        lines = []
        if self.never_updated:
            lines.append(format_table(COLUMNS, console_rows(self.never_updated)))
        if self.hint:
            lines.append(f"hint: {self.hint}")
        lines += self.warning_lines()
        lines.append(self.verdict)
        return "\n".join(lines)

    def markdown(self) -> str:
        """A markdown table (TensorBoard's text plugin renders it)."""
        lines = []
        if self.never_updated:
            lines.append("| " + " | ".join(COLUMNS) + " |")
            lines.append("|" + "---|" * len(COLUMNS))
            for row in self.rows():
                lines.append("| " + " | ".join(c.replace("|", "\\|") for c in row) + " |")
            lines.append("")
        if self.hint:
            lines.append(f"hint: {self.hint}")
            lines.append("")
        lines.append(f"**{self.verdict}**")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "healthy": self.healthy,
            "verdict": self.verdict,
            "optimizer_steps": self.optimizer_steps,
            "measured_steps": self.measured_steps,
            "skipped_steps": self.skipped_steps,
            "tracked_tensors": self.tracked_tensors,
            "error": self.error,
            "never_updated": [
                {
                    "name": r.name,
                    "aliases": list(r.aliases),
                    "shape": list(r.shape),
                    "numel": r.numel,
                    "reason": r.reason.value,
                    "detail": r.detail,
                    "suspect": r.suspect,
                    "intentional": r.intentional,
                }
                for r in self.never_updated
            ],
            "first_nonfinite": None if self.first_nonfinite is None else dataclasses.asdict(self.first_nonfinite),
            "hint": self.hint,
            "alerts": [dataclasses.asdict(a) for a in self.alerts],
        }

    def __str__(self) -> str:
        return self.table()


def format_table(columns: list[str], rows: list[list[str]]) -> str:
    widths = [len(c) for c in columns]
    for row in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row)]
    sep = "  "
    out = [sep.join(c.ljust(w) for c, w in zip(columns, widths)).rstrip()]
    out.append(sep.join("-" * w for w in widths))
    out += [sep.join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(out)


#: The console shows intentionally frozen tensors in at most this many lines (module subtrees).
MAX_FROZEN_LINES = 8


def _count(n: int) -> str:
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return str(n)


def _subtree(name: str) -> str:
    """The module subtree a tensor belongs to, with layer indices folded: transformer.h.3.attn.w -> transformer.h.*"""
    parts = name.split(" (= ", 1)[0].split(".")
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
    findings = [r.row() for r in records if not r.intentional]
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
            [key, "-", str(numel), "/".join(reasons), f"{len(rs)} tensors, {_count(numel)} params: {'/'.join(reasons)}"]
        )
    return out
