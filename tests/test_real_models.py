"""Real third-party models built from configs (no downloads): healthy runs say OK, planted bugs are found.

A timm ViT runs in a second venv (`.venv-timm`, built by the `timm_python` fixture): every timm release imports
torchvision at `import timm`, and PyPI's torchvision wheel cannot load beside the project's CPU torch pin.
That test is marked `heavy`: not in the default run, selected with `-m heavy` (.ci/run does).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

import catalogue
import pytest
import torch
from catalogue import ConvNet, hf_args
from torch import nn

import gradlog
from gradlog import Reason
from gradlog.cli.entry import main

transformers = pytest.importorskip("transformers")
pytest.importorskip("tensorboard")


def gpt2() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(cfg)


def gpt2_loss(model: nn.Module, step: int) -> torch.Tensor:
    """A target at every position, as nanoGPT trains (x = chunk[:-1], y = chunk[1:]). With `labels=ids`
    alone HF shifts inside, the last position has no target and its position-embedding row never gets a
    gradient: gradlog rightly reports that row, so a healthy-run test must not train that way."""
    ids = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(step))
    x, y = ids[:, :-1], ids[:, 1:].contiguous()
    return model(input_ids=x, labels=x, shift_labels=y).loss  # type: ignore[no-any-return]


def vit() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.ViTConfig(
        image_size=16,
        patch_size=4,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=3,
    )
    return transformers.ViTForImageClassification(cfg)


def vit_loss(model: nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return model(
        pixel_values=torch.randn(4, 3, 16, 16, generator=g), labels=torch.randint(0, 3, (4,), generator=g)
    ).loss  # type: ignore[no-any-return]


def conv_loss(model: nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 5, (4,), generator=g)
    return nn.functional.cross_entropy(model(x), y)


def train(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, int], torch.Tensor],
    log_dir: Path,
    steps: int = 8,
    lr: float = 1e-3,
    optimizer: torch.optim.Optimizer | None = None,
    clip: float | None = None,
    spike_at: int | None = None,
    between: Callable[[int], None] | None = None,
    clip_fn: Callable[..., torch.Tensor] = gradlog.clip_grad_norm_,
    **kw: Any,
) -> gradlog.Report:
    opt = optimizer or torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    gl = gradlog.GradLogger(model, opt, every=1, log_dir=str(log_dir), print_report=False, **kw)

    def clip_grads(step: int) -> None:
        if clip is not None:
            clip_fn(model.parameters(), clip)

    def loss(step: int) -> torch.Tensor:
        return loss_fn(model, step) * (1000.0 if step == spike_at else 1.0)

    return catalogue.train(opt, gl, steps, loss, after_backward=clip_grads, after_zero=between)


def report_exit(log_dir: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(["report", str(log_dir)])
    return code, capsys.readouterr().out


def assert_healthy(report: gradlog.Report, log_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert report.healthy and report.verdict.startswith("gradlog OK"), report.table()
    code, out = report_exit(log_dir, capsys)
    assert code == 0, out
    verdict = out.strip().splitlines()[-1]
    assert verdict.startswith("gradlog OK")
    # the same warnings as close(), by kind and count
    for kind, n in report.warnings().items():
        assert f"{kind} {n}" in verdict


def test_gpt2_healthy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = gpt2()
    report = train(model, gpt2_loss, tmp_path / "run")
    assert_healthy(report, tmp_path / "run", capsys)
    zero_init_or_1d = [n for n, p in model.named_parameters() if p.dim() == 1 or not p.detach().any()]
    assert len(zero_init_or_1d) >= 16  # biases and LayerNorms: the tensors a fixed band used to flag
    flagged = {a.name for a in report.alerts}
    assert not flagged & set(zero_init_or_1d), flagged


def test_vit_healthy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = train(vit(), vit_loss, tmp_path / "run")
    assert_healthy(report, tmp_path / "run", capsys)


def test_frozen_backbone_conv_net_healthy_and_grouped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = ConvNet()
    model.stem.requires_grad_(False)
    model.layer1.requires_grad_(False)
    report = train(model, conv_loss, tmp_path / "run")
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert {r.name for r in report.never_updated} == set(frozen) and len(frozen) == 12
    assert all(r.intentional for r in report.never_updated)
    assert_healthy(report, tmp_path / "run", capsys)
    table = report.table().splitlines()
    assert len(table) < 2 + len(frozen)  # grouped: one line per module subtree
    assert any(line.startswith("layer1.*") and "9 tensors" in line for line in table)


@pytest.mark.parametrize("include", [None, "*lora_*"])
def test_lora_healthy_with_and_without_include(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], include: str | None
) -> None:
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(gpt2(), peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True))
    report = train(model, gpt2_loss, tmp_path / "run", include=include)
    assert_healthy(report, tmp_path / "run", capsys)
    lora_b = [a for a in report.alerts if "lora_B" in a.name and a.kind.startswith("update_ratio")]
    assert lora_b == []  # zero-initialised: its ratio falls like 1/t, no finding
    if include is None:
        assert len(report.never_updated) == 28 and all(r.intentional for r in report.never_updated)
        # 28 frozen base tensors in a few lines: at most 4 rows (wte, wpe and two module subtrees), each with
        # its detail printed under it (the aliased name makes the table wider than the console)
        text = report.table()
        never = next(s for s in text.split("\n\n") if s.startswith("Never updated ("))
        assert len([line for line in never.splitlines()[3:] if not line.startswith(" ")]) <= 4, text
        assert len(never.splitlines()) <= 3 + 2 * 4 and len(text.splitlines()) < 28, text
    else:
        assert report.tracked_tensors == 4 and report.never_updated == []


def test_planted_accidental_freeze_is_a_finding(tmp_path: Path) -> None:
    model = gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.transformer.h[1].requires_grad_(False)  # by mistake, after the optimizer was built
    report = train(model, gpt2_loss, tmp_path / "run", optimizer=opt)
    suspects = [r for r in report.never_updated if r.suspect]
    assert len(suspects) == 12 and all(r.name.startswith("transformer.h.1.") for r in suspects)
    assert not report.healthy and report.verdict.startswith("gradlog PROBLEM")


def test_planted_optimizer_built_before_the_adapters(tmp_path: Path) -> None:
    peft = pytest.importorskip("peft")
    base = gpt2()
    opt = torch.optim.AdamW(base.parameters(), lr=1e-3)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True))
    report = train(model, gpt2_loss, tmp_path / "run", optimizer=opt)
    lora = {r.name: r.reason for r in report.never_updated if "lora_" in r.name}
    assert len(lora) == 4 and set(lora.values()) == {Reason.NOT_IN_OPTIMIZER}
    assert report.hint is not None and "before the adapters were added" in report.hint
    assert "another copy" not in report.hint and not report.healthy


def test_planted_disabled_scaler_is_no_scaler(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scaler = torch.cuda.amp.GradScaler(enabled=False)  # type: ignore[attr-defined]  # nanoGPT's line
    report = train(gpt2(), gpt2_loss, tmp_path / "run", scaler=scaler)
    assert_healthy(report, tmp_path / "run", capsys)


def test_planted_spike_hidden_by_clipping_is_found(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = train(gpt2(), gpt2_loss, tmp_path / "run", steps=10, clip=1.0, spike_at=8)
    spikes = [a for a in report.alerts if a.kind == "grad_norm_spike"]
    assert spikes and all(a.step == 8 for a in spikes), report.alerts
    assert report.healthy  # a warning, not a problem
    code, out = report_exit(tmp_path / "run", capsys)
    assert code == 0 and "grad_norm_spike" in out
    # with torch's own clip_grad_norm_ the norms gradlog reads are the clipped ones: the spike is hidden
    hidden = train(
        gpt2(), gpt2_loss, tmp_path / "hidden", steps=10, clip=1.0, spike_at=8, clip_fn=torch.nn.utils.clip_grad_norm_
    )
    assert not [a for a in hidden.alerts if a.kind == "grad_norm_spike"]


class _Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 64, (17,), generator=torch.Generator().manual_seed(i))
        # a target at every position (see gpt2_loss): the last position-embedding row learns too
        return {"input_ids": ids[:-1], "labels": ids[:-1], "shift_labels": ids[1:].contiguous()}


def test_planted_block_frozen_by_mistake_in_an_hf_trainer_run(tmp_path: Path) -> None:
    """The Trainer builds its optimizer from the trainable tensors only, so the frozen block is neither in
    the optimizer nor trainable at start: it is found because a lower block trains the same tensors."""
    from gradlog.integrations.huggingface import GradlogCallback

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=3, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0
    )
    model = transformers.GPT2LMHeadModel(cfg)
    model.transformer.h[1].requires_grad_(False)  # meant model.transformer.h[:1], say
    cb = GradlogCallback(writer="memory", every=1, print_report=False)
    args = hf_args(
        str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=3,
        seed=0,
        remove_unused_columns=False,  # keep shift_labels
    )
    transformers.Trainer(model=model, args=args, train_dataset=_Tokens(), callbacks=[cb]).train()
    assert cb.report is not None
    suspects = [r for r in cb.report.never_updated if r.suspect]
    assert len(suspects) == 12 and all(r.name.startswith("transformer.h.1.") for r in suspects)
    assert "transformer.h.0." in suspects[0].detail and not cb.report.healthy
    # freezing a prefix of the layers is intentional
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    model.transformer.h[:2].requires_grad_(False)
    cb = GradlogCallback(writer="memory", every=1, print_report=False)
    transformers.Trainer(model=model, args=args, train_dataset=_Tokens(), callbacks=[cb]).train()
    assert cb.report is not None and cb.report.healthy, cb.report.table()
    assert len(cb.report.never_updated) == 24 and not any(r.suspect for r in cb.report.never_updated)


# --- timm, in a venv of its own -------------------------------------------------------------------------------

REPO = Path(__file__).resolve().parent.parent
TIMM_VENV = REPO / ".venv-timm"  # in .gitignore; ruff, mypy and pytest look only at gradlog/, tests/, ...
#: torch and torchvision builds that load together, per machine (timm itself: any release).
TIMM_PINS = {
    "x86_64": ["torch==2.14.1", "torchvision==0.29.1"],
    "AMD64": ["torch==2.14.1", "torchvision==0.29.1"],
    "aarch64": ["torch==2.9.1", "torchvision==0.24.1"],
    "arm64": ["torch==2.9.1", "torchvision==0.24.1"],
}
TIMM_PACKAGES = ["timm", "tensorboard", "crc32c"]  # gradlog's TensorBoard writer needs the last two


def _venv_python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def _imports_timm(python: Path) -> bool:
    if not python.exists():
        return False
    probe = subprocess.run(
        [str(python), "-c", "import timm, tensorboard, crc32c"], capture_output=True, timeout=600, check=False
    )
    return probe.returncode == 0


def _no_timm(why: str) -> None:
    """CI must run the timm test; elsewhere a machine that cannot build the venv skips it."""
    if os.environ.get("CI"):
        pytest.fail(f"the timm venv {TIMM_VENV} could not be built: {why}")
    pytest.skip(f"the timm venv {TIMM_VENV} could not be built: {why}")


@pytest.fixture(scope="session")
def timm_python() -> Path:
    """The python of `.venv-timm`, built on first use (about 5.5 GB: torchvision needs its own torch build,
    a CUDA one that also runs on the CPU) and reused while it still imports timm."""
    python = _venv_python(TIMM_VENV)
    if _imports_timm(python):
        return python
    pins = TIMM_PINS.get(platform.machine())
    if pins is None:
        _no_timm(f"no torch/torchvision pair known for machine {platform.machine()!r} (TIMM_PINS)")
    steps = [
        [sys.executable, "-m", "venv", "--clear", str(TIMM_VENV)],
        [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *pins, *TIMM_PACKAGES],
    ]
    for cmd in steps:
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=3000, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            _no_timm(f"{' '.join(cmd[:4])}: {exc}")
        if done.returncode != 0:
            _no_timm(f"{' '.join(cmd[:4])} exited {done.returncode}: {done.stderr[-2000:]}")
    if not _imports_timm(python):
        _no_timm("it was built but cannot import timm, tensorboard and crc32c")
    return python


def _timm_run(python: Path, log_dir: Path, mode: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [str(python), str(REPO / "tests" / "timm_child.py"), str(log_dir), mode],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.heavy  # opt-in (-m heavy): the second venv is 5.5 GB and minutes to build; .ci/run runs it
@pytest.mark.slow
@pytest.mark.timeout(3600)  # the first run builds the venv (minutes)
def test_timm_vit_healthy_and_an_accidental_freeze(
    timm_python: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """timm's own ViT (`vit_tiny_patch16_224`, 2 blocks, 32x32 images), random data, AdamW, gradlog's
    TensorBoard writer, trained under the second venv's torch; `gradlog report` here reads the run back."""
    healthy = _timm_run(timm_python, tmp_path / "healthy", "healthy")
    assert healthy["healthy"] and healthy["verdict"].startswith("gradlog OK"), healthy["verdict"]
    assert len(healthy["tensors"]) == 32 and healthy["never_updated"] == []
    code, out = report_exit(tmp_path / "healthy", capsys)
    assert code == 0, out
    assert out.strip().splitlines()[-1] == healthy["verdict"]  # the same verdict and warnings as close()

    # planted: blocks.1 frozen after the optimizer was built (it stays in the optimizer): a finding
    frozen = _timm_run(timm_python, tmp_path / "frozen", "frozen")
    block1 = [n for n in frozen["tensors"] if n.startswith("blocks.1.")]
    assert len(block1) == 12
    assert frozen["never_updated"] == [[n, "frozen", True] for n in block1]
    assert not frozen["healthy"] and frozen["verdict"].startswith("gradlog PROBLEM: 12 of 32 tensors never updated")
    code, out = report_exit(tmp_path / "frozen", capsys)
    assert code == 1, out
    assert out.strip().splitlines()[-1] == frozen["verdict"]
    # one finding per module (its tensors listed once), and the words say why the freeze looks like a mistake
    assert all(n in out for n in block1) and "in a lower layer trains" in out
