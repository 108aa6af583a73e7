"""One finding per cause (issue 41): the units of a layer that stop firing at one step touch three tensors
(the layer's weight rows, its bias, the next layer's input columns), and a layer left out of the optimizer
two (weight, bias). The records stay one per tensor; the console, `gradlog report` and the verdict's counts
say each cause once, within a terminal's width.

The expected causes come from the run itself: the test reads `fc1.bias.grad` at every step and groups the
units by the last step their gradient was non-zero (never from gradlog), keeping those whose silence a unit
active at random would show with chance below 1e-3 (`math.comb`, as gradlog.verdict.silence states the bar)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from catalogue import DyingUnitsCNN, train
from torch import nn

import gradlog
from gradlog.cli.entry import main
from gradlog.verdict.records import format_ranges
from gradlog.verdict.report import CONSOLE_WIDTH
from gradlog.verdict.stopped_slices import MIN_QUIET_FRACTION, MIN_QUIET_STEPS

STEPS = 40
KILLS = {8: range(0, 9), 18: range(9, 12)}  # the step before which units are killed -> the units
TOUCHED = ["fc1.weight rows", "fc1.bias elements", "fc2.weight columns"]


def dying_run(writer: gradlog.Writer | str, log_dir: Path | None = None) -> tuple[gradlog.Report, dict[int, list[int]]]:
    """The run of the issue: `extra` out of the optimizer, fc1's units killed at two steps. Returns the report
    and, from the gradients read here, {step the units stopped at: the units} (quiet long enough to count)."""
    torch.manual_seed(0)
    model = DyingUnitsCNN()
    opt = model.optimizer_without_extra()
    gl = gradlog.GradLogger(model, opt, writer=writer, every=1, log_dir=None if log_dir is None else str(log_dir))
    gen = torch.Generator().manual_seed(1)
    last = torch.full((32,), -1)
    hits = torch.zeros(32, dtype=torch.int64)

    def loss(step: int) -> torch.Tensor:
        if step in KILLS:
            model.kill(KILLS[step])
        x, y = torch.randn(16, 1, 8, 8, generator=gen), torch.randint(0, 10, (16,), generator=gen)
        return nn.functional.cross_entropy(model(x), y)

    def reference(step: int) -> None:
        grad = model.fc1.bias.grad
        assert grad is not None
        last[grad != 0] = step
        hits[grad != 0] += 1

    report = train(opt, gl, STEPS, loss, after_backward=reference)
    need = max(MIN_QUIET_STEPS, math.ceil(MIN_QUIET_FRACTION * STEPS))
    top = int(last.max())
    stopped: dict[int, list[int]] = {}
    for v in sorted(set(last.tolist())):
        if 0 <= v < top and top - v >= need:
            # the evidence bar (issue 38): c active steps of the v + 1 up to the stop, all falling there among
            # the top + 1 up to the layer's last active one, would happen by chance C(v+1, c) / C(top+1, c)
            units = [
                u
                for u in (last == v).nonzero().flatten().tolist()
                if math.comb(v + 1, int(hits[u])) / math.comb(top + 1, int(hits[u])) < 1e-3
            ]
            if units:
                stopped[v + 1] = units
    return report, stopped


def test_a_long_layer_name_keeps_the_console_within_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    """The stopped-slices table without its detail is ~75 columns and a name: a layer named as deep models
    name theirs (`image_encoder.backbone_stage_three.fc1`, 38) made 113-column lines. The name then has a
    line of its own with its cells under it, every line but the verdict within the width."""

    class Deep(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.image_encoder = nn.ModuleDict({"backbone_stage_three": DyingUnitsCNN()})

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.image_encoder["backbone_stage_three"](x)
            return out

    torch.manual_seed(0)
    model = Deep()
    cnn = model.image_encoder["backbone_stage_three"]
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gl = gradlog.GradLogger(model, opt, writer="memory", every=1)
    gen = torch.Generator().manual_seed(1)

    def loss(step: int) -> torch.Tensor:
        if step == 8:
            cnn.kill(range(0, 9))
        x, y = torch.randn(16, 1, 8, 8, generator=gen), torch.randint(0, 10, (16,), generator=gen)
        return nn.functional.cross_entropy(model(x), y)

    report = train(opt, gl, STEPS, loss)
    lines = capsys.readouterr().out.splitlines()
    layer = "image_encoder.backbone_stage_three.fc1"
    causes = {(r.since_step, r.indices) for r in report.stopped_slices if r.name.startswith(layer + ".")}
    assert causes and any(len(units) >= 5 for _, units in causes)  # most of the nine killed units, at one step
    assert max(len(ln) for ln in lines[:-1]) <= CONSOLE_WIDTH, max(lines[:-1], key=len)
    at = [i for i, ln in enumerate(lines) if ln == layer]  # each cause's row: its name alone, its cells under it
    rows = [re.split(r"  +", lines[i + 1].strip()) for i in at]
    assert sorted((int(r[4]), r[3]) for r in rows) == sorted((s, format_ranges(u, 4)) for s, u in causes)


def test_a_layers_units_are_one_finding_and_the_console_fits_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    report, stopped = dying_run(gradlog.MemoryWriter())
    out = capsys.readouterr().out
    assert set(KILLS) <= set(stopped)  # both planted deaths (and whatever died by itself)
    # the records stay per tensor: 3 per stop step (fc1 rows, fc1 bias, fc2 columns), 2 never-updated tensors
    assert len(report.stopped_slices) == 3 * len(stopped)
    assert {r.name for r in report.never_updated} == {"extra.weight", "extra.bias"}
    # the console: one row per cause, the tensors it touches named once
    assert f"Stopped slices ({len(stopped)} findings in {3 * len(stopped)} records" in out
    for since, units in stopped.items():
        row = [re.split(r"  +", ln) for ln in out.splitlines() if ln.startswith("fc1 ")]
        assert [r[4] for r in row if r[5] == str(since)] == [format_ranges(units, 4)], out
    assert out.count("3 tensors (" + ", ".join(TOUCHED) + ")") == len(stopped)
    assert out.count("2 tensors (extra.weight, extra.bias): in no optimizer param group") == 1
    assert "\nextra.weight " not in out and "\nfc1.bias " not in out  # no row per tensor
    # within a terminal's width, but for the verdict: one line to grep
    lines = out.splitlines()
    assert lines[-1] == report.verdict
    assert max(len(ln) for ln in lines[:-1]) <= CONSOLE_WIDTH, max(lines[:-1], key=len)
    # the verdict counts causes: the layer out of the optimizer, and one per stop step
    assert report.verdict.endswith(f"measured; {1 + len(stopped)} problems)"), report.verdict
    # counted per cause, and said so where the causes are not one per tensor (3 tensors: fc1 rows and bias, fc2 columns)
    counts = f"dead_units {len(stopped)}"
    assert f"({counts if len(stopped) == 3 else f'{len(stopped)} causes: {counts}'})" in report.verdict
    assert report.to_dict()["severities"]["problem"] == 1 + len(stopped)


def test_report_groups_the_same_and_json_keeps_every_record_in_full(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report, stopped = dying_run("tensorboard", tmp_path / "run")
    capsys.readouterr()
    assert main(["report", str(tmp_path / "run")]) == 1
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert lines[-1] == report.verdict  # the same line close() printed
    assert max(len(ln) for ln in lines[1:-1]) <= CONSOLE_WIDTH, max(lines[1:-1], key=len)  # [0]: the run's path
    assert text.count("3 tensors (" + ", ".join(TOUCHED) + ")") == len(stopped)
    assert text.count("2 tensors (extra.weight, extra.bias)") == 1
    assert main(["report", "--json", str(tmp_path / "run")]) == 1
    got = json.loads(capsys.readouterr().out)
    assert [r["detail"] for r in got["stopped_slices"]] == [r.detail for r in report.stopped_slices]  # in full
    findings = got["findings"]
    assert [(f["table"], f["label"], f["records"]) for f in findings] == [("never_updated", "extra", 2)] + [
        ("stopped_slices", "fc1", 3)
    ] * len(stopped)
    assert all(f["touched"] == TOUCHED for f in findings[1:])
    assert {re.search(r"from step (\d+) on", f["detail"]).group(1) for f in findings[1:]} == {  # type: ignore[union-attr]
        str(s) for s in stopped
    }


# --- a block frozen at step k: one cause, named by the block -------------------------------------------------------
def test_a_gpt2_block_frozen_mid_run_is_one_cause_named_by_the_block() -> None:
    """A real transformers GPT-2 trained with labels=input_ids; at step 6 `h[1].mlp` is frozen
    (requires_grad_(False)) while its tensors stay in the optimizer: c_fc and c_proj, 4 tensors, stop learning
    at the same step for the same reason. Before, grouping per module made that 2 causes ("2 problems"); it is
    one, named `transformer.h.1.mlp`. The reference: the tensors whose values stop changing after step 6,
    from copies made here."""
    from catalogue import lm_loss, tiny_gpt2

    model = tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    gl = gradlog.GradLogger(model, opt, writer="memory", every=1, print_report=False)
    block = model.transformer.h[1].mlp
    at_freeze: dict[str, torch.Tensor] = {}
    for step in range(12):
        if step == 6:
            block.requires_grad_(False)  # the planted freeze: the optimizer still holds these tensors
            at_freeze = {n: p.detach().clone() for n, p in model.named_parameters()}
        lm_loss(model, gen).backward()
        opt.step()
        gl.log(step)
        opt.zero_grad()
    report = gl.close()
    stopped = sorted(n for n, p in model.named_parameters() if torch.equal(p.detach(), at_freeze[n]))
    assert stopped == [f"transformer.h.1.mlp.{m}.{w}" for m in ("c_fc", "c_proj") for w in ("bias", "weight")]
    assert sorted(s.name for s in report.stalled) == stopped
    assert {(str(s.reason), s.since_step) for s in report.stalled} == {("frozen", 6)}
    assert "(12 optimizer steps, 12 measured; 1 problem," in report.verdict, report.verdict
    [section] = [s for s in report.sections(grouped=True) if s.key == "stalled"]
    assert len(section.rows) == 1 and section.rows[0][0] == "transformer.h.1.mlp"
    assert "transformer.h.1.mlp" in report.table()
