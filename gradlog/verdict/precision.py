"""At close: tensors whose updates round away in part (pure bf16/fp16 training at a small lr).

On each measured step the meter counts, per low-precision tensor (fp16, bf16, 8-bit floats), the
elements whose gradient was non-zero (lr > 0) yet whose value came out of the step unchanged
(`Meter._frozen_counts`: `w_after == w_before` and `grad != 0`, on the device, after the pass that
already takes the update's norm); their share of the elements that had a non-zero gradient (not of the
whole tensor: an embedding's rows that no batch reached have no update to lose) is the series
`weights/frozen_frac/<name>` (written while non-zero), and the ledger keeps its mean and maximum. A
tensor is a finding when the mean share over at least `MIN_STEPS` judged measured steps is at least
`MEAN_FRAC`. Tensors that never changed at all are `never_updated`'s finding (`below_precision`) and
are not repeated here.

A kind of finding in one module: its record (`PrecisionLoss`: its table, its severity, what the verdict line
says) and its detector (`PrecisionLoss.detect`), registered in `gradlog.verdict.report.FINDINGS`.

The threshold, from a 2-layer GPT-2 (d 32) trained 30 steps with AdamW (measured every step):

| run                       | weight matrices, embeddings | biases      | LayerNorm weights      |
|---------------------------|-----------------------------|-------------|------------------------|
| fp32, lr 1e-5 (by hand)   | 0.000                       | 0.000       | 0.007-0.017 (max 0.09) |
| pure bf16, lr 1e-3        | 0.06-0.13                   | 0.014-0.033 | never updated          |
| pure bf16, lr 1e-5        | 0.65-0.96                   | 0.019-0.034 | never updated          |

0.25 sits 15x above the fp32 run's worst mean and 2.6x below the lowest bf16 lr 1e-5 matrix; a bf16 run
at lr 1e-3 (a tenth of its updates rounded away per step) is not called a problem. The mean, not the
maximum, is judged: a 32-element bias has one-step maxima of 0.1-0.2 from a few elements whose Adam
update was momentarily tiny.

fp32 and fp64 tensors are not counted (the count is three passes over a tensor, and fp32 loses an update
only below ~6e-8 of the value: the table's fp32 row was measured by hand, from copies of the weights).
A step's share is not the share of elements that never changed over the run: an element frozen on most
steps still moves on some (the lr 1e-5 run: per-step means 0.91-0.96 where 0.70-0.86 of the elements
never changed over 30 steps). A skipped step (GradScaler) is not judged; sparse gradients are not
compared (cannot tell which elements they touched here).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from gradlog.measure.params import Tracked
from gradlog.verdict.ledger import Evidence
from gradlog.verdict.policy import NOTE, PROBLEM
from gradlog.verdict.records import INT, SHARE, TEXT, Case, Cell, Record, cell

#: `early_frac`, read leniently: a table written before it existed has no such column, and its records read
#: as rounded away from the start (what they were called then)
_EARLY = Cell(write=lambda v, _r, _limit: [f"{v:.3f}"], read=lambda name, c: float(c[name]) if c.get(name) else 1.0)


@dataclass(frozen=True)
class PrecisionLoss(Record):
    """A low-precision tensor whose updates round away in part: on measured steps, `mean_frac` (and at most
    `max_frac`) of its elements had a non-zero gradient and lr > 0, yet kept their value."""

    KIND = "precision"
    TITLE = "Updates rounded away"
    NOUN = "tensor"
    SAID = "with updates partly rounded away (below its dtype's precision)"
    #: updates rounded away by a low-precision dtype
    SEVERITY: ClassVar[dict[str, tuple[str, str]]] = {
        "precision.rounded_away": (
            PROBLEM,
            "a large share of the tensor's updates rounded away every step (pure bf16/fp16 weights): it barely "
            "learns; fp32 master weights, stochastic rounding or Kahan summation fix it",
        ),
        "precision.rounded_late": (
            NOTE,
            "updates that registered at first rounded away later, once they had shrunk (pure bf16/fp16 weights "
            "converging, a decayed lr): the run learned, its last refinements are lost; fp32 master weights keep them",
        ),
    }

    name: str = cell(TEXT)
    dtype: str = cell(TEXT)
    mean_frac: float = cell(SHARE)
    max_frac: float = cell(SHARE)
    steps: int = cell(INT)  # measured steps it was judged on
    detail: str = cell(TEXT)
    #: the mean share over its first judged steps (`early_share`); 1.0 where not known: judged from the start
    early_frac: float = cell(_EARLY, default=1.0)

    def policy_kind(self) -> str:
        return "precision.rounded_away" if from_start(self.early_frac, self.mean_frac) else "precision.rounded_late"

    @classmethod
    def detect(cls, case: Case) -> list[PrecisionLoss]:
        """Over the whole run's evidence; a tensor that never changed at all is the never-updated table's."""
        return rounded_away(case.rows, case.evidence, exclude=case.named("never_updated"))


#: the mean share of elements whose non-zero-gradient update rounded away, from which a tensor is a finding
MEAN_FRAC = 0.25
#: ...judged on at least this many measured steps
MIN_STEPS = 3


def early_share(ev: Evidence) -> float | None:
    """The mean rounded-away share of a tensor's first judged measured steps: its first quarter, at least one
    step and at most `FIRST_SHARES` (None: never judged). High there, the updates were below the dtype's
    precision from the start (an lr too small for it); low there and high later, they registered while the
    tensor learned and shrank below it as the run converged (the calibration zoo's Lightning bf16-true run:
    3-25% a step over its first 10 measured steps, 60-93% from step 80 of 200, the loss down 99%)."""
    first = ev.frozen_first
    if not first:
        return None
    n = min(len(first), max(1, ev.frozen_steps // 4))
    return sum(first[:n]) / n


def from_start(early: float, mean: float) -> bool:
    """Whether updates rounded away from a tensor's first judged steps on, not only once they shrank: the early
    share is itself high and at least half the run's mean (a course that rises to twice its start is the
    updates shrinking; a 4-element bias's share moves in steps of 25%, so "high" alone would not tell)."""
    return early >= MEAN_FRAC and early >= mean / 2


def rounded_away(
    rows: Sequence[Tracked], evidence: Mapping[int, Evidence], exclude: set[str] | frozenset[str] = frozenset()
) -> list[PrecisionLoss]:
    """One record per tensor whose updates round away in part, in model order; `exclude`: already reported."""
    out = []
    for row in rows:
        ev = evidence.get(row.index)
        if ev is None or ev.frozen_steps < MIN_STEPS or row.name in exclude:
            continue
        mean = ev.frozen_sum / ev.frozen_steps
        if mean < MEAN_FRAC:
            continue
        early = early_share(ev)
        early = mean if early is None else early
        share = (
            f"on average {mean:.0%} (at most {ev.frozen_max:.0%}) of its elements with a non-zero gradient and lr > 0 "
            f"kept their {ev.dtype} value, over {ev.frozen_steps} measured steps"
        )
        if from_start(early, mean):
            detail = (
                f"{share}, {early:.0%} from its first measured steps: the updates are below the dtype's precision. "
                "Keep fp32 master weights (mixed precision), use stochastic rounding or Kahan summation in the "
                "optimizer, or raise lr"
            )
        else:
            detail = (
                f"{share}, but {early:.0%} over its first measured steps: its updates registered while it learned "
                "and rounded away once they had shrunk (a converging run, a decayed lr). Keep fp32 master weights "
                "(mixed precision) where the last refinements matter"
            )
        out.append(PrecisionLoss(row.name, ev.dtype, mean, ev.frozen_max, ev.frozen_steps, detail, early))
    return out
