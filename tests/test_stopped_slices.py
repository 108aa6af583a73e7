"""Slices that stop learning mid-run: units killed at step k in a real transformers GPT-2 (Conv1D layout),
a Mixtral whose router collapses at step k, and the cases where nothing can be told.

Every expected index set and stop step comes from the gradients the test reads itself at every step (the
last step each slice's gradient was non-zero), never from gradlog.
"""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
import torch
from catalogue import SparseDyingUnit, lm_loss, tiny_gpt2, train
from torch import nn

import gradlog
from gradlog import Reason
from gradlog.verdict.records import format_ranges
from gradlog.verdict.stopped_slices import MIN_QUIET_FRACTION, MIN_QUIET_STEPS

transformers = pytest.importorskip("transformers")

KILLED = list(range(8, 24))  # 16 units of block 0's MLP


class LastNonzero:
    """Reference: per tensor and dim, the last measured step at which each slice's gradient was non-zero
    (-1: never), from the gradients the test reads at the measured steps (every `every`-th)."""

    def __init__(self, model: nn.Module, dims: dict[str, int | None], every: int = 1) -> None:
        self.params = dict(model.named_parameters())
        self.dims, self.every, self.measured = dims, every, 0
        self.last = {n: torch.full((self.params[n].shape[d or 0],), -1) for n, d in dims.items()}
        self.hits = {n: torch.zeros(v.shape, dtype=torch.int64) for n, v in self.last.items()}

    def __call__(self, step: int) -> None:
        if step % self.every:
            return
        self.measured += 1
        for n, d in self.dims.items():
            g = self.params[n].grad
            assert g is not None
            nz = (g != 0) if d is None else (g != 0).movedim(d, 0).reshape(g.shape[d], -1).any(1)
            self.last[n][nz] = step
            self.hits[n] += nz

    def stopped(self) -> set[tuple[str, int | None, tuple[int, ...], int]]:
        """(name, dim, indices, since step) of the slices quiet on at least max(4, 20% of the measured steps)
        measured steps after their last non-zero gradient, up to the tensor's last one (the policy's bar,
        `gradlog.verdict.stopped_slices.MIN_QUIET_*`), whose c non-zero steps all falling in the first m of the
        m + n a random order would give with chance C(m, c) / C(m + n, c) < 1e-3, grouped by stop step."""
        need = max(MIN_QUIET_STEPS, math.ceil(MIN_QUIET_FRACTION * self.measured))
        out = set()
        for n, last in self.last.items():
            top = int(last.max())
            total = top // self.every + 1  # every measured step up to the tensor's last non-zero one
            for v in sorted(set(last[(last >= 0) & (last < top)].tolist())):
                if (top - v) // self.every < need:
                    continue
                before = v // self.every + 1
                idx = [
                    i
                    for i in (last == v).nonzero().flatten().tolist()
                    if math.comb(before, int(self.hits[n][i])) / math.comb(total, int(self.hits[n][i])) < 1e-3
                ]
                if idx:
                    out.add((n, self.dims[n], tuple(idx), v + self.every))
        return out


def mlp_dims(model: nn.Module) -> dict[str, int | None]:
    """Every MLP weight and bias of the GPT-2 blocks, with the dim its units are along (Conv1D: (in, out))."""
    return {
        n: (1 if n.endswith("c_fc.weight") else 0) if p.dim() == 2 else None
        for n, p in model.named_parameters()
        if ".mlp." in n and not n.endswith("c_proj.bias")
    }


MLP = "transformer.h.0.mlp."
GPT_DIMS: dict[str, int | None] = {MLP + "c_fc.weight": 1, MLP + "c_fc.bias": None, MLP + "c_proj.weight": 0}


def train_gpt2(
    model: nn.Module, steps: int, kill_at: int | None, every: int, ref: LastNonzero | None, lr: float = 1e-3
) -> tuple[gradlog.Report, gradlog.MemoryWriter]:
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    mem = gradlog.MemoryWriter()
    gl = gradlog.GradLogger(model, opt, writer=mem, every=every, print_report=False)
    gen = torch.Generator().manual_seed(0)
    bias = dict(model.named_parameters())[MLP + "c_fc.bias"]

    def loss(step: int) -> torch.Tensor:
        if step == kill_at:
            with torch.no_grad():
                bias[KILLED] = -100.0  # a bad update: these ReLU units never fire again
        return lm_loss(model, gen)

    return train(opt, gl, steps, loss, after_backward=ref), mem


@pytest.mark.parametrize("every", [1, 4])
def test_gpt2_units_killed_at_step_k_are_reported_with_their_step(every: int) -> None:
    # every=4: 20 measured steps, as 8 (4 before the kill, 4 after) are no evidence: a unit firing at random put
    # its 4 non-zero steps in the first 4 of 8 with chance 1 / C(8, 4) = 1/70
    k, steps = (16, 32) if every == 1 else (32, 80)
    model = tiny_gpt2(activation="relu")
    ref = LastNonzero(model, mlp_dims(model), every)
    report, _ = train_gpt2(model, steps=steps, kill_at=k, every=every, ref=ref)
    # the reference sees the planted bug: 16 units of block 0 last had a gradient at the measured step before k
    killed = {(n, d, tuple(KILLED), since) for n, d in GPT_DIMS.items() for since in [k + (-k) % every]}
    want = ref.stopped()
    assert killed <= want
    # ...and units of block 1 that died on their own (a real ReLU MLP at lr 1e-3): gradlog finds exactly these
    got = {(r.name, r.dim, r.indices, r.since_step) for r in report.stopped_slices}
    assert got == want
    for r in report.stopped_slices:
        assert r.last_grad_step < r.since_step <= r.last_grad_step + every
        if r.name.startswith(MLP):
            assert r.since_step - every < k <= r.since_step and r.reason is Reason.DEAD_UNITS
    fc = next(r for r in report.stopped_slices if r.name == MLP + "c_fc.weight")
    assert "output units 8-23 (16 of 128)" in fc.detail  # Conv1D: its columns are the units
    # the verdict counts one per cause (a layer's units that stopped at one step, in its 3 tensors), not per record
    assert not report.healthy
    counted = r"slices that stopped learning \((?:\d+ causes?: )?([a-z_]+ \d+(?:, [a-z_]+ \d+)*)\)"
    said = re.search(counted, report.verdict)
    assert said is not None, report.verdict
    counts = {k: int(v) for k, v in (kv.split() for kv in said.group(1).split(", "))}
    assert "dead_units" in counts and sum(counts.values()) == len({(n.split(".mlp.")[0], i, s) for n, _, i, s in want})
    assert "Stopped slices (" in report.table()


def test_gelu_gpt2_has_no_stopped_slices_as_its_gradients_say() -> None:
    model = tiny_gpt2(activation="relu")
    for block in model.transformer.h:
        block.mlp.act = nn.GELU()  # no unit of a GELU MLP ever gets an exactly zero gradient
    dims = {n: (d if p.dim() == 2 else None) for n, p in model.named_parameters() for d in [0] if p.dim() <= 2}
    dims = {n: d for n, d in dims.items() if not n.startswith("transformer.w")}  # embeddings: rows not judged
    ref = LastNonzero(model, dims)
    report, _ = train_gpt2(model, steps=24, kill_at=None, every=1, ref=ref)
    assert ref.stopped() == set()
    assert report.stopped_slices == []


def test_stopped_slices_table_reads_back_through_tensorboard(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """Read back, and named by `gradlog report` (its text and --json), as the verdict it prints counts them."""
    import json

    from gradlog.cli.entry import main
    from gradlog.readers.run import closed_report, load

    model = tiny_gpt2(activation="relu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gl = gradlog.GradLogger(model, opt, every=2, print_report=False, log_dir=str(tmp_path / "tb"))
    gen = torch.Generator().manual_seed(0)
    bias = dict(model.named_parameters())[MLP + "c_fc.bias"]

    def loss(step: int) -> torch.Tensor:
        if step == 12:
            with torch.no_grad():
                bias[KILLED] = -100.0
        return lm_loss(model, gen)

    report = train(opt, gl, 30, loss)
    assert {r.name for r in report.stopped_slices if r.name.startswith(MLP)} == set(GPT_DIMS)
    back = closed_report(load(str(tmp_path / "tb")))
    assert back is not None
    assert back.stopped_slices == report.stopped_slices
    assert "slices that stopped learning" in back.verdict and back.status == report.status == "PROBLEM"
    capsys.readouterr()
    main(["report", str(tmp_path / "tb")])
    text = capsys.readouterr().out
    assert "Stopped slices (" in text
    # one row per cause (a layer's units, in its tensors), then the tensors it touches, each record's name
    words = " ".join(text.split())
    lines = text.splitlines()  # a name too long for one line of the table has its cells on the next line
    rows = [f"{a} {b}" if len(a.split()) == 1 else a for a, b in zip(lines, [*lines[1:], ""])]
    for r in report.stopped_slices:  # each record's row: its layer, its units and the step it stopped from
        layer = r.name.split(".mlp.")[0] + ".mlp.c_fc"
        assert any(
            line.split()[:1] == [layer] and str(r.since_step) in line.split() and format_ranges(list(r.indices)) in line
            for line in rows
        ), (r, text)
        assert r.name in words
    main(["report", str(tmp_path / "tb"), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["stopped_slices"] == report.to_dict()["stopped_slices"]


def test_one_measured_step_or_every_beyond_the_run_tells_nothing_and_does_not_crash() -> None:
    for every, steps in ((100, 20), (1, 1)):
        model = tiny_gpt2(activation="relu")
        report, _ = train_gpt2(model, steps=steps, kill_at=0, every=every, ref=None)
        assert report.measured_steps == 1
        assert report.stopped_slices == []


def test_sparse_zero_element_tensors_and_a_dying_unit() -> None:
    torch.manual_seed(0)
    model = SparseDyingUnit()
    dense = [p for n, p in model.named_parameters() if n != "emb.weight"]
    opts = [torch.optim.SGD(dense, lr=0.05), torch.optim.SparseAdam([model.emb.weight], lr=0.01)]
    gl = gradlog.GradLogger(model, opts[0], writer=gradlog.MemoryWriter(), every=1, print_report=False)
    ref = LastNonzero(model, {"fc.weight": 0, "fc.bias": None, "out.weight": 1})
    gen = torch.Generator().manual_seed(0)
    for step in range(20):
        if step == 5:
            with torch.no_grad():
                model.fc.bias[2] = -100.0
        model(torch.randint(0, 10, (8, 3), generator=gen)).pow(2).mean().backward()
        ref(step)
        for o in opts:
            o.step()
        gl.log(step)
        for o in opts:
            o.zero_grad()
    report = gl.close()
    want = ref.stopped()
    assert {("fc.weight", 0, (2,), 5), ("fc.bias", None, (2,), 5), ("out.weight", 1, (2,), 5)} <= want
    assert {(r.name, r.dim, r.indices, r.since_step) for r in report.stopped_slices} == want
