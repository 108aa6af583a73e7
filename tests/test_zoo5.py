"""The calibration zoo's fourth round (tests/zoo5.py): each family, first verified healthy by the zoo's own
evidence (training metric and held-out evaluation fall >= 15%, every trainable tensor changed), must get
`gradlog OK` with notes only, at `every=5` and at the default `every`. The cheapest `zoo5.FAST` run by
default, the rest with `-m heavy`. docs/verdict.md ("The fourth round (zoo5)") has the rows.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import zoo  # tests/ is on sys.path (rootdir conftest)
import zoo5

CASES = [
    pytest.param(f, id=f.__name__, marks=() if i < zoo5.FAST else pytest.mark.heavy)
    for i, f in enumerate(zoo5.FAMILIES)
]


@pytest.mark.parametrize("every", [5, None], ids=["every5", "default"])
@pytest.mark.parametrize("family", CASES)
def test_a_healthy_family_of_the_fourth_round_is_ok_with_notes_only(
    family: Callable[[], zoo.Setup], every: int | None
) -> None:
    outcome = zoo.run(family, every)
    assert outcome.healthy, f"{outcome.evidence()}; never changed: {outcome.unchanged}"  # healthy, by itself
    for report in outcome.reports:
        loud = [f for f in zoo.findings(report) if f[0] != "note"]
        assert report.healthy and loud == [], (report.verdict, loud)
        assert set(report.severities()) <= {"note"}, report.verdict


def test_every_family_says_why_it_is_healthy() -> None:
    names = [f.__name__ for f in zoo5.FAMILIES]
    assert len(set(names)) == len(names) >= 12
    assert not set(names) & {f.__name__ for f in zoo.FAMILIES}
    assert all(f.__doc__ and "Healthy" in f.__doc__ for f in zoo5.FAMILIES), names


def test_dinov2s_mask_token_left_trainable_is_the_one_problem_and_it_is_true() -> None:
    """Fine-tuned with its `mask_token` left trainable (transformers builds it; only masked-image pre-training
    reads it), DINOv2 has one tensor that never learns: gradlog names it, and only it, `never.no_grad` (a problem:
    the evidence is a module's parameter no forward read, as in a layer a forward() forgot), and the independent
    check agrees: it is the only trainable tensor equal to its initial copy."""

    def dinov2_mask_token_trainable() -> zoo.Setup:
        s = zoo5.dinov2()
        s.model.dinov2.embeddings.mask_token.requires_grad_(True)
        return s

    outcome = zoo.run(dinov2_mask_token_trainable, 5)
    assert outcome.unchanged == ["dinov2.embeddings.mask_token"]
    assert outcome.train_drop >= zoo.DROP and outcome.eval_drop >= zoo.DROP
    (report,) = outcome.reports
    loud = [(sev, kind, name) for sev, kind, name, _ in zoo.findings(report) if sev != "note"]
    assert loud == [("problem", "never.no_grad", "dinov2.embeddings.mask_token")]


def test_funnels_last_layer_terms_the_cls_query_masks_out_are_named_zero_grad_truly() -> None:
    """Funnel's classifier reads the last layer's [CLS] query only, and Funnel masks the relative-position and
    segment terms out of the [CLS] row: those tensors' gradient is exactly zero (a backward by hand on a fresh
    model), and gradlog names exactly them `never.zero_grad` (a true problem, kept: docs/verdict.md)."""
    zoo.seed(0)
    model = zoo5.funnel_cls().model
    ids, _ = zoo.counting(torch.Generator().manual_seed(3), 16, 16, 64, zoo.FIRST)
    model(input_ids=ids, labels=zoo.first_half(ids, zoo.FIRST, 64)).loss.backward()
    by_hand = {n for n, p in model.named_parameters() if p.grad is not None and not bool(p.grad.any())}
    assert by_hand and all(".attention." in n for n in by_hand), by_hand
    (report,) = zoo.run(zoo5.funnel_cls, 5).reports
    named = {name for sev, kind, name, _ in zoo.findings(report) if kind == "never.zero_grad"}
    assert named == by_hand
