"""Issue 39: one traced step points at the cause. Each planted bug (a `.detach()`, a `torch.no_grad()` region,
`.data`, an argmax into a codebook, a `round()`, layers in a Python list, a module made in forward, a loss
rebuilt from `.item()`, a generator trained on `fake.detach()`, a misplaced `zero_grad()`) on hand-written and
Hugging Face / peft models, each beside its healthy twin (a straight-through VQ autoencoder, an EMA teacher, a
stop-gradient branch, layers in an nn.ModuleList). The expected file and line come from a marker comment on
the planted statement (`catalogue.planted_site`), and are read back from the report's text."""

from __future__ import annotations

import re
import time
from typing import Any

import pytest
import torch
from catalogue import (
    CutEncoder,
    EMATeacher,
    MadeInForward,
    RoundedCode,
    SimSiam,
    Stacked,
    VQAutoencoder,
    planted_site,
    site_in,
)
from torch import nn

import gradlog
from gradlog import Reason
from gradlog.measure.trace import StepTrace


def _check(model: nn.Module, batch: Any, loss_fn: Any = None, lr: float = 0.1) -> gradlog.CheckReport:
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    return gradlog.check(model, opt, batch, loss_fn=loss_fn, print_report=False)


def _rows(report: gradlog.Report, reason: Reason) -> dict[str, str]:
    """name -> the row of the report's text that names it, for the records of `reason`. The console prints one
    row per cause (a module's tensors with one reason: `gradlog.verdict.causes`), named by its tensor, or by
    its module with the tensors it touches listed at the start of its detail ("2 tensors (enc.weight,
    enc.bias): ..."); a wide table prints the detail under the row, wrapped at spaces. A row is read back
    with its detail unwrapped (its lines joined by one space), and each tensor must be named by one row."""
    text = report.table()
    section = next(s for s in text.split("\n\n") if s.startswith("Never updated ("))
    blocks: list[list[str]] = []  # [the row's name cell, the row and its detail]
    for line in section.splitlines()[3:]:  # the heading, the column names and the rule
        if line.startswith(" "):  # the detail under a row, or its wrapped continuation
            blocks[-1][1] += " " + line.strip()
        else:
            blocks.append([re.sub(r" \(= .*\)$", "", re.split(r"\s{2,}", line)[0]), line])  # less its aliases
    named: dict[str, list[str]] = {}
    for cell, row in blocks:
        listed = re.search(r"\s(\d+) tensors \((.*?)\): ", row)
        tensors = listed.group(2).split(", ") if listed else [cell]
        assert not listed or len(tensors) == int(listed.group(1)) > 1, row
        for t in tensors:
            named.setdefault(t, []).append(row)
    names = [r.name for r in report.never_updated if r.reason == reason]
    assert all(len(named.get(n, [])) == 1 for n in names), (names, text)
    return {n: named[n][0] for n in names}


def _site_here(marker: str) -> str:
    """This test file's line marked `# planted: <marker>` (a GAN's or a loss function's planted statement)."""
    return site_in(__file__, marker)


def _no_trace_left(model: nn.Module) -> None:
    """The trace left nothing behind: no hook on a weight, no mode pushed, no attribute set."""
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())
    assert not torch.overrides._get_current_function_mode_stack()


@pytest.mark.parametrize(
    ("cut", "words"),
    [
        ("detach", "by `.detach()`; fix: remove the .detach()"),
        ("no_grad", "run under torch.no_grad(); fix: move this call out of the torch.no_grad() block"),
        ("inference", "run under torch.inference_mode(); fix: move this call out of the torch.inference_mode()"),
        ("data", "by `.data`; fix: use the tensor itself"),
    ],
)
def test_the_cut_is_named_with_its_line_and_fix(cut: str, words: str) -> None:
    torch.manual_seed(0)
    model = CutEncoder(cut)
    report = _check(model, torch.randn(16, 8))
    rows = _rows(report, Reason.NO_GRAD)
    assert set(rows) == {"enc.weight", "enc.bias"}
    assert len(set(rows.values())) == 1 and rows["enc.weight"].startswith("enc ")  # one cause: enc's row
    site = planted_site(CutEncoder, cut)
    for line in rows.values():
        assert f"{site} (`" in line and words in line, line
    _no_trace_left(model)


class TwoCuts(nn.Module):
    """One layer whose weight and bias are cut off the loss on two lines, by two different means."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.dec = nn.Linear(8, 6), nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.enc.weight.detach()  # planted: weight
        b = self.enc.bias.data  # planted: bias
        out: torch.Tensor = self.dec(torch.relu(nn.functional.linear(x, w, b)))
        return out


def test_one_layer_cut_at_two_lines_is_two_findings() -> None:
    """The weight and the bias of one layer, no gradient for the same reason, yet cut at two lines: two lines
    to fix, so two findings, each row naming its own line and fix (grouped by module, the bias's line was
    not printed)."""
    torch.manual_seed(0)
    report = _check(TwoCuts(), torch.randn(16, 8))
    rows = _rows(report, Reason.NO_GRAD)
    assert set(rows) == {"enc.weight", "enc.bias"} and rows["enc.weight"] != rows["enc.bias"]
    assert f"{_site_here('weight')} (`w = self.enc.weight.detach()`) by `.detach()`" in rows["enc.weight"]
    assert f"{_site_here('bias')} (`b = self.enc.bias.data`) by `.data`; fix: use the tensor" in rows["enc.bias"]
    assert _site_here("bias") not in rows["enc.weight"]
    assert report.verdict.endswith("(1 optimizer step, 1 measured; 2 problems)"), report.verdict


def test_healthy_twins_report_nothing() -> None:
    """Straight-through estimators, an EMA teacher, a stop-gradient branch and registered layers cut the graph
    (or hold plain lists) on purpose: every weight still learns, so nothing is reported."""
    torch.manual_seed(0)
    x = torch.randn(16, 8)
    models = (
        CutEncoder("none"),
        VQAutoencoder(True),
        RoundedCode(True),
        EMATeacher(),
        SimSiam(),
        Stacked("modulelist"),
    )
    for model in models:
        report = _check(model, x)
        assert report.never_updated == [], (type(model).__name__, report.table())  # the teacher moves (EMA)
        assert report.healthy and report.verdict.startswith("gradlog OK")


def test_argmin_into_a_codebook_without_straight_through() -> None:
    torch.manual_seed(0)
    report = _check(VQAutoencoder(straight_through=False), torch.randn(16, 8))
    rows = _rows(report, Reason.NO_GRAD)
    assert set(rows) == {"enc.weight", "enc.bias"}
    site = planted_site(VQAutoencoder, "argmin")
    for line in rows.values():
        assert f"cut at {site}" in line.replace("tests/", "") or site in line
        assert "by `argmin` (returns integers/booleans: not differentiable)" in line
        assert "straight-through estimator" in line


def test_round_gives_a_zero_gradient_and_is_named() -> None:
    torch.manual_seed(0)
    report = _check(RoundedCode(), torch.randn(16, 8))
    rows = _rows(report, Reason.ZERO_GRAD)
    assert set(rows) == {"enc.weight", "enc.bias"}
    site = planted_site(RoundedCode, "round")
    for line in rows.values():
        assert site in line and "`round` (its gradient is zero everywhere)" in line
        assert "x + (x.round() - x).detach()" in line


def test_layers_in_a_python_list_are_not_registered() -> None:
    torch.manual_seed(0)
    model = Stacked("list")
    assert len(list(model.parameters())) == 2  # what gradlog tracked before: "all 2 tracked tensors were updated"
    report = _check(model, torch.randn(16, 8))
    rows = _rows(report, Reason.NOT_REGISTERED)
    assert set(rows) == {f"layers[{i}].{w}" for i in range(3) for w in ("weight", "bias")}
    for line in rows.values():
        assert "layers is a Python list of 3 Linear" in line and "fix: hold them in nn.ModuleList" in line
    assert not report.healthy
    assert "6 of 8 tensors never updated (not_registered 6)" in report.verdict


def test_a_module_made_in_forward_and_a_plain_tensor_attribute() -> None:
    torch.manual_seed(0)
    report = _check(MadeInForward(), torch.randn(16, 8))
    rows = _rows(report, Reason.NOT_REGISTERED)
    site = planted_site(MadeInForward, "made")
    made = {n: line for n, line in rows.items() if n.startswith("<Parameter")}
    assert sorted(made) == ["<Parameter (8, 8)>", "<Parameter (8,)>"]
    for line in made.values():
        assert site in line and "created inside forward()" in line and "create it once in __init__" in line
    assert "scale" in rows and "fix: make it an nn.Parameter (self.scale = nn.Parameter(...))" in rows["scale"]
    assert not report.healthy


def test_generator_trained_on_detached_fakes() -> None:
    """A GAN's generator step written with the discriminator step's ``fake.detach()``: the loss never reaches
    the generator. The hint says so (not "is zero_grad() misplaced?") and names the line."""
    torch.manual_seed(0)
    gen, disc = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8)), nn.Linear(8, 1)

    def g_loss(g: nn.Module, z: torch.Tensor) -> torch.Tensor:
        fake = g(z)
        return nn.functional.softplus(-disc(fake.detach())).mean()  # planted: gan

    report = _check(gen, torch.randn(16, 4), loss_fn=g_loss)
    site = _site_here("gan")
    assert {r.reason for r in report.never_updated} == {Reason.NO_GRAD} and len(report.never_updated) == 4
    assert report.hint is not None and "zero_grad" not in report.hint
    assert "the loss never reached them" in report.hint and site in report.hint and "`.detach()`" in report.hint
    assert all(site in line for line in _rows(report, Reason.NO_GRAD).values())


def test_loss_rebuilt_from_item() -> None:
    torch.manual_seed(0)

    def rebuilt(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        loss = m(x).pow(2).mean()
        return torch.tensor(loss.item(), requires_grad=True)  # planted: item

    report = _check(CutEncoder(), torch.randn(16, 8), loss_fn=rebuilt)
    assert report.hint is not None and "the loss never reached them" in report.hint
    assert _site_here("item") in report.hint and "`.item()`" in report.hint and "keep the loss a tensor" in report.hint
    assert not any(r.reason == Reason.NOT_REGISTERED for r in report.never_updated)  # the rebuilt loss is no weight


def _run(model: nn.Module, zero_between: bool = False, steps: int = 25) -> gradlog.Report:
    """A run of `steps` steps measured every 10th, with zero_grad() between backward() and step() when
    `zero_between` (the bug), after step() otherwise."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gl = gradlog.GradLogger(model, opt, writer="memory", every=10, print_report=False)
    for step in range(steps):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        if zero_between:
            opt.zero_grad()  # the bug
        opt.step()
        gl.log(step)
        opt.zero_grad()
    return gl.close()


def test_a_run_traces_one_step_after_the_first_measured_step_shows_no_gradient() -> None:
    """In a run the cut is located once: the first measured step shows grad None, the next step is traced
    (named with its number and cost in the detail), and the records end with the fix."""
    torch.manual_seed(0)
    model = CutEncoder("detach")
    report = _run(model)
    rows = _rows(report, Reason.NO_GRAD)
    assert set(rows) == {"enc.weight", "enc.bias"}
    site = planted_site(CutEncoder, "detach")
    for line in rows.values():
        assert "traced step (optimizer step 1; " in line and " torch calls): cut at " in line
        assert f"{site} (`h = self.enc(x).detach()`) by `.detach()`; fix: remove the .detach()" in line
    _no_trace_left(model)
    healthy = _run(CutEncoder("none"))
    assert healthy.healthy and "traced step" not in healthy.table()


def test_a_run_tells_a_misplaced_zero_grad_from_a_loss_that_never_reached() -> None:
    """zero_grad() between backward() and step(): every tensor had grad None. The traced step sees backward
    write the gradients (post-accumulate-grad hooks) and step() find none: the hint says they were cleared.
    A loss that never reached the weights (a generator trained on detached fakes) says that instead."""
    torch.manual_seed(0)
    model = CutEncoder()
    report = _run(model, zero_between=True)
    assert report.hint is not None and "zero_grad() called between backward() and step() cleared them" in report.hint
    assert "never reached" not in report.hint
    for rec in report.never_updated:
        assert rec.reason == Reason.NO_GRAD and "backward() wrote its gradient and it was None at step()" in rec.detail
    _no_trace_left(model)
    with StepTrace(model, None) as trace:  # the same, traced by hand without an optimizer: read at stop()
        model(torch.randn(4, 8)).pow(2).mean().backward()
        model.zero_grad()
    result = trace.result()
    assert all(result.cleared(id(p)) for p in model.parameters())


def test_a_run_names_layers_in_a_python_list_from_the_first_step() -> None:
    torch.manual_seed(0)
    report = _run(Stacked("list"))
    rows = _rows(report, Reason.NOT_REGISTERED)
    assert set(rows) == {f"layers[{i}].{w}" for i in range(3) for w in ("weight", "bias")}
    assert "6 of 8 tensors never updated (not_registered 6" in report.verdict and not report.healthy
    assert _run(Stacked("modulelist")).never_updated == []


@pytest.mark.parametrize("in_init", [False, True])
def test_a_run_names_a_module_made_in_forward(in_init: bool, caplog: pytest.LogCaptureFixture) -> None:
    """A Linear built inside forward() at every call, with nothing in the model's attributes to give it away and
    every tensor of the model getting its gradient: before, the run said "gradlog OK: all 2 tracked tensors
    were updated". The parameters registered during the model's first forward arm the one traced step, which
    names them with the planted line. The healthy twin (the Linear built in __init__) traces nothing."""
    torch.manual_seed(0)
    model = MadeInForward(scale=False, in_init=in_init)
    with caplog.at_level("INFO", logger="gradlog"):
        report = _run(model)
    traced = [r.getMessage() for r in caplog.records if "traced optimizer step" in r.getMessage()]
    _no_trace_left(model)
    if in_init:
        assert report.never_updated == [] and report.healthy and traced == []
        return
    rows = _rows(report, Reason.NOT_REGISTERED)
    assert sorted(rows) == ["<Parameter (8, 8)>", "<Parameter (8,)>"]
    site = planted_site(MadeInForward, "made")
    for line in rows.values():
        assert site in line and "created inside forward()" in line and "create it once in __init__" in line
    assert not report.healthy and "not_registered 2" in report.verdict
    assert len(traced) == 1 and "traced optimizer step 1 " in traced[0]
    print(traced[0])  # the traced step's cost (noisy on a shared CPU)


# --- third-party models ------------------------------------------------------------------------------------
transformers = pytest.importorskip("transformers")


def _bert() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16,
    )  # fmt: skip
    return transformers.BertModel(cfg, add_pooling_layer=False)


class BertClassifier(nn.Module):
    """BERT and a head; `frozen_features=True` plants the bug: the hidden states are detached (marked)."""

    def __init__(self, frozen_features: bool) -> None:
        super().__init__()
        self.bert = _bert()
        self.head = nn.Linear(16, 3)
        self.frozen_features = frozen_features

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.bert(input_ids=ids).last_hidden_state
        if self.frozen_features:
            h = h.detach()  # planted: bert
        return nn.functional.cross_entropy(self.head(h[:, 0]), labels)


def test_a_compiled_model_compiles_as_often_with_gradlog_as_without() -> None:
    """torch.compile(model) with an Embedding, gradlog on the optimizer: the first forward's hooks (which watch
    for modules made inside `forward`) are traced into the compiled forward; registering or removing a hook there
    was a graph break and 7 compiled frames against 1 without gradlog. Now the same frames, no graph break, and
    the run is measured (every tensor learned)."""
    from torch._dynamo.utils import counters

    def run(with_gradlog: bool) -> tuple[int, int, gradlog.Report | None]:
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(50, 16), nn.Flatten(), nn.Linear(64, 8), nn.Tanh(), nn.Linear(8, 2))
        compiled = torch.compile(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        gl = gradlog.GradLogger(model, opt, every=2, writer="memory", print_report=False) if with_gradlog else None
        gen = torch.Generator().manual_seed(1)
        for i in range(6):
            x, y = torch.randint(0, 50, (32, 4), generator=gen), torch.randint(0, 2, (32,), generator=gen)
            opt.zero_grad()
            nn.functional.cross_entropy(compiled(x), y).backward()
            opt.step()
            if gl is not None:
                gl.log(i)
        report = gl.close() if gl is not None else None
        return int(counters["frames"]["total"]), sum(counters["graph_break"].values()), report

    try:
        base, base_breaks, _ = run(False)
        frames, breaks, report = run(True)
    finally:  # a compiled frame left behind turns the write watch off for the later tests of this process
        torch._dynamo.reset()
    assert (frames, breaks) == (base, base_breaks) == (1, 0), (frames, breaks, base, base_breaks)
    assert report is not None and not report.never_updated and report.measured_steps == 3


def test_bert_detached_features_and_its_healthy_twin() -> None:
    g = torch.Generator().manual_seed(0)
    batch = (torch.randint(0, 64, (4, 16), generator=g), torch.randint(0, 3, (4,), generator=g))
    healthy = _check(BertClassifier(False), batch)
    assert not [r for r in healthy.never_updated if r.reason in (Reason.NO_GRAD, Reason.NOT_REGISTERED)]
    assert "traced step" not in healthy.table()
    report = _check(BertClassifier(True), batch)
    rows = _rows(report, Reason.NO_GRAD)
    bert = [n for n, _ in BertClassifier(True).named_parameters() if n.startswith("bert.")]
    assert set(rows) == set(bert) and len(bert) > 30
    site = planted_site(BertClassifier, "bert")
    assert all(f"{site} (`h = h.detach()`) by `.detach()`" in line for line in rows.values())


class GPT2Heads(nn.Module):
    """GPT-2's hidden states read by two extra heads. `bug="list"` keeps the heads in a Python list (marked);
    `bug="no_grad"` runs the transformer under torch.no_grad() (marked); None is the healthy twin."""

    def __init__(self, bug: str | None) -> None:
        super().__init__()
        import catalogue

        self.gpt = catalogue.tiny_gpt2()
        self.bug = bug
        heads = [nn.Linear(32, 4) for _ in range(2)]
        if bug == "list":
            self.heads = heads  # planted: list
        else:
            self.heads = nn.ModuleList(heads)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.bug == "no_grad":
            with torch.no_grad():
                h = self.gpt.transformer(input_ids=ids).last_hidden_state  # planted: no_grad
        else:
            h = self.gpt.transformer(input_ids=ids).last_hidden_state
        return sum((head(h).pow(2).mean() for head in self.heads), torch.zeros(()))


def test_gpt2_heads_in_a_list_and_under_no_grad() -> None:
    ids = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(0))
    healthy = _check(GPT2Heads(None), ids)
    assert not [r for r in healthy.never_updated if r.reason in (Reason.NO_GRAD, Reason.NOT_REGISTERED)]
    listed = _check(GPT2Heads("list"), ids)
    rows = _rows(listed, Reason.NOT_REGISTERED)
    assert set(rows) == {f"heads[{i}].{w}" for i in range(2) for w in ("weight", "bias")}
    assert all("heads is a Python list of 2 Linear" in line and "nn.ModuleList" in line for line in rows.values())
    cut = _check(GPT2Heads("no_grad"), ids)
    rows = _rows(cut, Reason.NO_GRAD)
    # lm_head is tied to wte and not in the forward: the transformer's tensors all get grad None
    assert {n for n in rows} == {
        n for n, _ in GPT2Heads(None).gpt.transformer.named_parameters(prefix="gpt.transformer")
    }
    site = planted_site(GPT2Heads, "no_grad")
    assert all(site in line and "run under torch.no_grad()" in line for line in rows.values())


def test_peft_lora_loss_rebuilt_from_item() -> None:
    peft = pytest.importorskip("peft")
    import catalogue

    ids = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(0))
    model = peft.get_peft_model(
        catalogue.tiny_gpt2(), peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True)
    )

    def rebuilt(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
        out = m(input_ids=b, labels=b)
        return torch.tensor(out.loss.item(), requires_grad=True)  # planted: lora

    healthy = _check(model, ids, loss_fn=lambda m, b: m(input_ids=b, labels=b).loss, lr=1e-3)
    assert "traced step" not in healthy.table()
    assert not [r for r in healthy.never_updated if r.reason in (Reason.NO_GRAD, Reason.NOT_REGISTERED)]
    report = _check(model, ids, loss_fn=rebuilt, lr=1e-3)
    lora = {n for n, p in model.named_parameters() if p.requires_grad}
    assert {r.name for r in report.never_updated if r.reason == Reason.NO_GRAD} == lora
    assert report.hint is not None and _site_here("lora") in report.hint and "`.item()`" in report.hint


@pytest.mark.parametrize("size", ["small", "mid"])
def test_traced_step_cost(size: str, record_property: Any) -> None:
    """The one traced step's cost over the same step untraced (printed for the docs; noisy on a shared CPU)."""
    import catalogue

    model = catalogue.tiny_gpt2() if size == "small" else _mid_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    step()
    t = time.perf_counter()
    step()
    plain = time.perf_counter() - t
    with StepTrace(model, opt) as trace:
        step()
    result = trace.result()
    print(f"{size}: plain {plain * 1e3:.0f} ms, {result.cost()}")
    assert result.calls > 100 and result.cut_of == {} and result.foreign == []
    _no_trace_left(model)


def _mid_gpt2() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=6, n_embd=256, n_head=4, vocab_size=64, n_positions=16)
    return transformers.GPT2LMHeadModel(cfg)
