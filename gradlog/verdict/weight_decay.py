"""At close: tensors whose weight decay wipes them every step (lr x weight_decay at or above one half).

Under AdamW (and Adam with `decoupled_weight_decay=True`) each step multiplies every weight by
(1 - lr x weight_decay) before adding its update; SGD's decay takes lr x weight_decay x w off each weight
(`gradlog.measure.decay`). At lr x weight_decay = 1 a step leaves the weights holding only its own update:
nothing they learned before survives. Above 1 the decay flips their sign, above 2 it grows them. At 0.5 half
of the weights go each step: they keep about two steps of learning. A healthy run's product is 1e-5 to 1e-3
(AdamW's default weight_decay 0.01 at lr 1e-3..1e-1): 500x below the line, so a healthy run never shows it.

The evidence is the optimizer's own settings, read on the host from `param_groups` at each measured step
(no device work: `Meter._decays` beside the learning rates), counted per tensor in the ledger
(`Evidence.wipe_steps`); the update ratio ‖Δw‖/‖w‖ measured on those steps (a healthy one: about 1e-3) is
stated beside it. Only optimizers whose decay acts so are judged: Adam's L2 decay passes through Adam's
normalisation (the product says nothing there), and an optimizer gradlog does not know is not judged at all.
A group with weight_decay 0 or lr 0, or a schedule that brings lr x weight_decay below the line, is not a
finding on those steps.

A kind of finding in one module: its record (`WeightDecayWipe`) and its detector (`WeightDecayWipe.detect`),
registered in `gradlog.verdict.report.FINDINGS`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from gradlog.measure.params import Tracked
from gradlog.verdict.ledger import WIPES, Evidence
from gradlog.verdict.policy import PROBLEM
from gradlog.verdict.records import INT, TEXT, Case, Record, cell, simple

#: a setting (lr, weight_decay, their product) to four significant digits, and back
NUMBER = simple(lambda v: f"{v:.4g}", float)

#: measured steps at or above the line a tensor needs (fewer where the run measured it fewer times)
MIN_STEPS = 2


@dataclass(frozen=True)
class WeightDecayWipe(Record):
    """A tensor whose param group's lr x weight_decay (`product`, the largest seen, with its `lr` and
    `weight_decay`) was at least `WIPES` on `steps` of the `of` measured steps with a known decay rule,
    from `since_step` on: each such step removes that share of the weights."""

    KIND = "weight_decay"
    TITLE = "Weight decay wipes the weights"
    NOUN = "tensor"
    SAID = f"wiped by weight decay (lr x weight_decay >= {WIPES:g})"
    #: weight decay too large for the learning rate
    SEVERITY: ClassVar[dict[str, tuple[str, str]]] = {
        "weight_decay.wipes": (
            PROBLEM,
            f"lr x weight_decay >= {WIPES:g} (AdamW, SGD): each step removes that share of the weights, so they "
            "keep only the last steps' updates and cannot learn; use lr x weight_decay << 1",
        ),
    }

    name: str = cell(TEXT)
    group: int = cell(INT)  # the optimizer's param group
    lr: float = cell(NUMBER)
    weight_decay: float = cell(NUMBER)
    product: float = cell(NUMBER)
    steps: int = cell(INT)  # measured steps at or above the line
    of: int = cell(INT)  # measured steps with a known decay rule
    since_step: int = cell(INT)
    detail: str = cell(TEXT)

    def policy_kind(self) -> str:
        return "weight_decay.wipes"

    @classmethod
    def detect(cls, case: Case) -> list[WeightDecayWipe]:
        """Over the whole run's evidence (`Evidence.wipe_steps`)."""
        return wiped(case.rows, case.evidence)


def wiped(rows: Sequence[Tracked], evidence: Mapping[int, Evidence]) -> list[WeightDecayWipe]:
    """One record per tensor of an optimizer group whose decay wiped it at measured steps, in model order."""
    sizes: dict[int, int] = {}
    for row in rows:
        if row.group is not None:
            sizes[row.group] = sizes.get(row.group, 0) + 1
    out = []
    for row in rows:
        ev = evidence.get(row.index)
        if ev is None or row.group is None or ev.wipe_steps < min(MIN_STEPS, max(1, ev.decay_steps)):
            continue
        detail = _detail(ev, row.group, sizes[row.group])
        out.append(
            WeightDecayWipe(
                row.name, row.group, ev.wipe_lr, ev.wipe_wd, ev.wipe_product, ev.wipe_steps, ev.decay_steps,
                ev.wipe_first, detail,
            )
        )  # fmt: skip
    return out


def _effect(product: float) -> str:
    """What one step's decay does to the weights at lr x weight_decay = `product`."""
    factor = 1.0 - product
    said = f"each step multiplies the weights by {factor:.3g}"
    if factor == 0:
        return f"{said} (a step leaves only its own update)"
    if factor < -1:
        return f"{said} (their size grows each step: training diverges)"
    if factor < 0:
        return f"{said} (their sign flips each step)"
    return f"{said} (they keep about {1 / product:.3g} steps of updates)"


def _detail(ev: Evidence, group: int, size: int) -> str:
    """The evidence and the fix, in words."""
    ratio = (
        f"; its update ratio ‖Δw‖/‖w‖ was {ev.wipe_ratio_sum / ev.wipe_ratio_n:.3g} on average on those steps "
        "(healthy: about 1e-3)"
        if ev.wipe_ratio_n
        else ""
    )
    return (
        f"param group {group} ({size} tensor{'s' * (size != 1)}): lr {ev.wipe_lr:.4g} x weight_decay "
        f"{ev.wipe_wd:.4g} = {ev.wipe_product:.3g} at {ev.wipe_steps} of {ev.decay_steps} measured steps from step "
        f"{ev.wipe_first}: {_effect(ev.wipe_product)}{ratio}. weight_decay is a fraction per unit of lr: AdamW's "
        "default is 0.01; use lr x weight_decay << 1"
    )
