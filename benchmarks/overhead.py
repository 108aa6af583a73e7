"""What does monitoring cost? gradlog against the baseline, the device-work floor and other tools.

    PYTHONPATH=$PWD python benchmarks/overhead.py            # full run (< 20 min on 2 idle CPU cores)
    PYTHONPATH=$PWD python benchmarks/overhead.py --quick    # < 4 minutes on 2 idle cores
    PYTHONPATH=$PWD python benchmarks/overhead.py --device cuda   # on a GPU, with a ~350M-parameter GPT

Models: gpt, mlp (every configuration), mlp100 (issue 30's 100-tensor MLP: the W&B writer against
wandb.watch), frozen (a frozen backbone under a small trainable head),
head (that head alone, the backbone run outside the model: the frozen tensors' own cost is the difference),
big (one huge tensor), deep (5,000 small tensors); the last four run the configurations their
targets need. After the model tables: fingerprint cost against sum(), the targets checked from this
run, and the growth of a logged step's cost with trainable parameters and with tensor count.

Everything runs in ONE process. Every configuration trains its own copy of the model (same seed,
same batch) and they take turns in rounds, in a rotating order, so machine drift (other jobs,
thermal, turbo) lands on all of them alike. Each step is timed alone; each round's times are
divided by that round's baseline median before any statistic is taken.

Wall clock through close() (models with wandb.watch and a W&B or TensorBoard writer; `--paid-only` runs just
this): a writer on a thread of its own (W&B's, TensorBoard's) and wandb's own process (wandb-core) keep working
after a step is timed, so in the per-step table their backlog lands on whichever configuration runs next. This
table gives each configuration a fresh monitor per round and times `--paid-steps` steps and its close() as one
window (a W&B run's finish() included, its wandb.init not), with the CPU time of the training thread, of the
process's other threads and of its child processes over the window. Overhead: the window's ms per step minus
the baseline's of the same round, median over `--paid-rounds`. The W&B and TensorBoard targets (1/3 and 1/4 of
wandb.watch's overhead) are read from it. On a machine shared with other jobs the CPU columns are the steadier
reading: the wall clock is what the machine's load left to each window.

Columns:
- median step ms: median over all timed steps (logged or not).
- ratio: amortised step time over the baseline, ((every-1) * unlogged + logged) / every, from the
  medians of the normalised unlogged and logged step times (robust to stray slow steps). A
  configuration that logs less often than once per round is fast-forwarded at the start of each
  round (gradlog's step counter is advanced; nothing else changes) so that every round times
  one of its logged steps.
- ms per logged step: what a logged step costs over a baseline step, timed around the optimizer
  step and the monitor's work before and after it (the median of that window on logged steps
  minus the baseline's), which leaves forward/backward's noise out; for wandb.watch, whose hooks
  work inside forward/backward, from whole steps instead.
- peak MB over baseline: memory growth during one logged step minus the same for a baseline
  step, in two windows, the larger reported: the whole step, and the optimizer step with the
  monitor's work around it (activations are gone by then, so a parameter snapshot shows there
  even when it does not raise the step's overall peak), the minimum of 4 rounds in which every
  configuration takes its turn with the baseline. Measured after all timing, each model in a fresh
  process of this script (`--memory-only`, same flags). CPU: glibc is told to serve every block
  above 64 KiB by mmap (so freed memory leaves RSS at once) and
  trimmed first; a thread samples RSS from /proc/self/statm every 0.2 ms. CUDA:
  torch.cuda.max_memory_allocated. Memory a monitor keeps between steps (a snapshot buffer it
  reuses) is there before the step starts, so it is added to both windows.
- largest repeat MB, and its share of the trainable weights' bytes: the same growth from the largest of
  the `--memory-repeats` samples (the baseline's still its minimum). Under a snapshot budget smaller than the
  model (issue 40: max(10% of the trainable bytes, 64 MB)) successive measured steps copy different tensors
  in rotation, so the minimum is the rotation's smallest step; the budget is a bound on the largest.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import inspect
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# --------------------------------------------------------------------------- models


class ResidualMLP(nn.Module):
    """`x + 0.1 * gelu(Linear(layer_norm(x)))`, repeated: many mid-sized tensors (2 per block)."""

    def __init__(self, blocks: int = 200, width: int = 256) -> None:
        super().__init__()
        self.width = width
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + 0.1 * F.gelu(layer(F.layer_norm(x, (self.width,))))
        return x


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    """A small GPT: token + position embeddings, pre-norm blocks, untied head."""

    def __init__(self, layers: int, d: int, heads: int, vocab: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        out: torch.Tensor = self.head(self.ln(x))
        return out


class FrozenBackbone(nn.Module):
    """Fine-tuning: a frozen stack of Linear(d, d) layers (the backbone) under a small trainable head."""

    def __init__(self, layers: int, d: int, head_out: int) -> None:
        super().__init__()
        self.backbone = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))
        self.backbone.requires_grad_(False)
        self.head = nn.Linear(d, head_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.backbone:
            x = F.relu(layer(x))
        out: torch.Tensor = self.head(x)
        return out


class BigTable(nn.Module):
    """One huge tensor: an embedding table (its dense gradient is as big as it is) and a tiny head."""

    def __init__(self, rows: int, d: int) -> None:
        super().__init__()
        self.table = nn.Embedding(rows, d)
        self.head = nn.Linear(d, 1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.table(idx).mean(1))
        return out


Built = tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    """AdamW over the trainable tensors (what fine-tuning code passes), torch's default implementation."""
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)


@dataclass
class ModelSpec:
    """A model, its batch and its loss; `build` returns a fresh (model, loss_fn) with a fixed seed.

    `configs`: the configurations this model runs by default (None: all); `shared`: every configuration
    trains the one model (each with its own optimizer), for models too big to copy per configuration;
    `steps`: timed steps per round instead of --steps (slow models); `growth`: only in the growth table.
    """

    name: str
    describe: str
    build: Callable[[torch.device], Built]
    optimizer: Callable[[nn.Module], torch.optim.Optimizer] = adamw
    configs: tuple[str, ...] | None = None
    shared: bool = False
    steps: int | None = None


def _mlp(device: torch.device, blocks: int = 200, width: int = 256, batch: int = 64) -> Built:
    torch.manual_seed(0)
    model = ResidualMLP(blocks, width).to(device)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch, width, generator=gen).to(device)
    y = torch.randn(batch, width, generator=gen).to(device)
    return model, lambda m: F.mse_loss(m(x), y)


def _gpt(device: torch.device, layers: int, d: int, heads: int, vocab: int, seq: int, batch: int) -> Built:
    torch.manual_seed(0)
    model = GPT(layers, d, heads, vocab, seq).to(device)
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(vocab, (batch, seq + 1), generator=gen).to(device)
    inp, tgt = idx[:, :-1], idx[:, 1:]
    return model, lambda m: F.cross_entropy(m(inp).reshape(-1, vocab), tgt.reshape(-1))


def _frozen_parts(
    device: torch.device, backbone_params: float, d: int, batch: int
) -> tuple[FrozenBackbone, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    layers = max(1, round(backbone_params / (d * d + d)))
    model = FrozenBackbone(layers, d, head_out=d).to(device)  # head: d*d + d ~ 1M parameters at d 1024
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch, d, generator=gen).to(device)
    y = torch.randn(batch, d, generator=gen).to(device)
    return model, x, y


def _frozen(device: torch.device, backbone_params: float, d: int = 1024, batch: int = 16) -> Built:
    model, x, y = _frozen_parts(device, backbone_params, d, batch)
    return model, lambda m: F.mse_loss(m(x), y)


def _head_alone(device: torch.device, backbone_params: float, d: int = 1024, batch: int = 16) -> Built:
    """The frozen model's head on its own: the backbone still runs every step (under no_grad, as in the
    frozen model, whose backbone builds no graph either) so the memory traffic and cache state are the
    same, but it is not part of the model gradlog is given. The difference to `frozen` is then what the
    frozen tensors themselves cost, not what a 40 MB forward pass does to the cache (a backbone computed
    once read the head's logged step 0.5-1 ms cheaper, the floor's too)."""
    model, x, y = _frozen_parts(device, backbone_params, d, batch)
    backbone = model.backbone
    head = nn.Sequential(model.head)
    del model

    def loss(m: nn.Module) -> torch.Tensor:
        with torch.no_grad():
            feats = x
            for layer in backbone:
                feats = F.relu(layer(feats))
        return F.mse_loss(m(feats), y)

    return head, loss


def _big(device: torch.device, numel: float, d: int = 256, batch: int = 64) -> Built:
    torch.manual_seed(0)
    rows = max(1, round(numel / d))
    model = BigTable(rows, d).to(device)
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(rows, (batch, 8), generator=gen).to(device)
    y = torch.randn(batch, 1, generator=gen).to(device)
    return model, lambda m: F.mse_loss(m(idx), y)


def _llama(
    device: torch.device, layers: int, hidden: int, mlp: int, heads: int, vocab: int, seq: int, batch: int
) -> Built:
    """A Llama-shaped decoder built from a transformers `LlamaConfig` (RMSNorm, rotary attention, SwiGLU MLP,
    untied head), next-token loss on a fixed random batch."""
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=seq,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(device)
    idx = torch.randint(vocab, (batch, seq), generator=torch.Generator().manual_seed(1)).to(device)
    return model, lambda m: m(idx, labels=idx).loss


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    """Plain SGD: no optimizer state, so the huge table costs its weights and its gradient only."""
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)


def adamw_foreach(model: nn.Module) -> torch.optim.Optimizer:
    """AdamW(foreach=True): torch's CPU default steps 5,000 tensors one by one, which would dwarf everything."""
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, foreach=True)


#: configurations of the models added for issue 17: what their targets need.
FOCUSED = ("baseline", "floor", "scalars-1", "hist-1", "default")
#: issue 40's large model: gradlog at its defaults and with histograms every step, against the other tools;
#: scalars-1 beside hist-1 splits a measured step into its scalars and its histograms (the growth table)
LARGE = ("baseline", "default", "scalars-1", "hist-1", "tb-1", "wandb-1", "watch-1", "lightning")


def model_specs(args: argparse.Namespace | None = None) -> dict[str, ModelSpec]:
    """Every model, sized by the command line (--frozen-params, --big-numel, --deep-tensors)."""
    frozen = float(getattr(args, "frozen_params", 50e6))
    big = float(getattr(args, "big_numel", 200e6))
    deep = int(getattr(args, "deep_tensors", 5000))
    layers = int(getattr(args, "llama_layers", 20))
    seq = int(getattr(args, "llama_seq", 128))
    return {
        "gpt": ModelSpec(
            "gpt",
            "GPT-like: 6 layers, d 256, vocab 4096, seq 128, batch 8, AdamW",
            lambda dev: _gpt(dev, layers=6, d=256, heads=4, vocab=4096, seq=128, batch=8),
        ),
        "mlp": ModelSpec(
            "mlp",
            "residual pre-norm MLP: 200 blocks x + 0.1*gelu(Linear(256,256)(layer_norm(x))), batch 64, AdamW",
            lambda dev: _mlp(dev),
        ),
        "mlp100": ModelSpec(
            "mlp100",
            "residual pre-norm MLP: 50 blocks x + 0.1*gelu(Linear(256,256)(layer_norm(x))) (100 tensors), batch 64, "
            "AdamW: the model of issue 30 (W&B writer against wandb.watch)",
            lambda dev: _mlp(dev, blocks=50),
            configs=("baseline", "scalars-1", "hist-1", "tb-1", "wandb-scalars-1", "wandb-1", "watch-1"),
        ),
        "frozen": ModelSpec(
            "frozen",
            f"frozen backbone: {frozen / 1e6:.0f}M frozen parameters in Linear(1024,1024)+ReLU layers, "
            "a trainable Linear(1024,1024) head (1M), batch 16, AdamW over the head",
            lambda dev: _frozen(dev, frozen),
            configs=FOCUSED,
        ),
        "head": ModelSpec(
            "head",
            "the frozen model's head alone: the same Linear(1024,1024) fed the same backbone, run each step "
            "under no_grad outside the model gradlog is given (no frozen tensor in it), batch 16, AdamW",
            lambda dev: _head_alone(dev, frozen),
            configs=("baseline", "floor", "scalars-1"),
        ),
        "big": ModelSpec(
            "big",
            f"one huge tensor: Embedding({max(1, round(big / 256))}, 256) ({big / 1e6:.0f}M elements) + "
            "Linear(256,1), batch 64 x 8 indices, SGD; one model shared by all configurations",
            lambda dev: _big(dev, big),
            optimizer=sgd,
            configs=FOCUSED,
            shared=True,
            steps=3,
        ),
        "deep": ModelSpec(
            "deep",
            f"deep residual MLP of {deep // 2} blocks Linear(32,32) ({deep} small tensors), batch 16, "
            "AdamW(foreach=True)",
            lambda dev: _mlp(dev, blocks=deep // 2, width=32, batch=16),
            optimizer=adamw_foreach,
            configs=FOCUSED,
        ),
        "llama": ModelSpec(
            "llama",
            f"Llama-shaped decoder (transformers LlamaConfig): {layers} layers, hidden 1024, MLP 2816, 16 heads, "
            f"vocab 32000, untied (~{(layers * 12.85e6 + 65.5e6) / 1e6:.0f}M parameters), seq {seq}, batch 1, SGD "
            "(no optimizer state: every configuration steps the one model; wandb.watch, whose hooks are on the model, "
            "a copy of its own)",
            lambda dev: _llama(dev, layers=layers, hidden=1024, mlp=2816, heads=16, vocab=32000, seq=seq, batch=1),
            optimizer=sgd,
            configs=LARGE,
            shared=True,
            steps=2,
        ),
        "gpt350m": ModelSpec(
            "gpt350m",
            "GPT: 24 layers, d 1024, vocab 50304, seq 1024, batch 8, AdamW (for --device cuda)",
            lambda dev: _gpt(dev, layers=24, d=1024, heads=16, vocab=50304, seq=1024, batch=8),
        ),
    }


MODELS: dict[str, ModelSpec] = model_specs()

# --------------------------------------------------------------------------- monitors


class Skip(Exception):
    """A configuration that cannot run here (a writer not merged yet, a package missing)."""


class Monitor:
    """One way of watching training. `logged(i)` says which optimizer steps do the work."""

    every: int | None = None  # None: never logs (the baseline)
    offset: int = 0
    works_in_backward = False  # True: its cost is in forward/backward hooks, outside the optimizer window

    def logged(self, i: int) -> bool:
        return self.every is not None and (i - self.offset) % self.every == 0

    def before_step(self, i: int) -> None:
        pass

    def after_step(self, i: int, loss: torch.Tensor) -> None:
        pass

    def fast_forward(self, i: int) -> int:
        """Jump the schedule to the next logged step (memory phase only); returns the new step index."""
        return i

    def held_bytes(self) -> int:
        """Memory the monitor keeps between steps (counted in its peak: it is there during every step)."""
        return 0

    def close(self) -> None:
        pass


class Baseline(Monitor):
    pass


class Floor(Monitor):
    """The unavoidable tensor math of scalars + update ratio, as plain torch: no bookkeeping, no writing.

    One copy of the trainable parameters before the step; after it, fused norms of the gradients,
    the weights and the update (computed in place in the copy), and one device-to-host copy. Frozen
    tensors are left out: nothing about them changes, so the floor owes them no work. The copy's
    buffers are kept from step to step (as gradlog keeps its snapshot on the CPU when it measures
    often): a fresh copy each step made glibc fault pages in again, 1-2.5 ms on the frozen model's
    4 MB head, which is the allocator's cost, not device work.
    """

    every = 1

    def __init__(self, model: nn.Module) -> None:
        self.raw = [p for p in model.parameters() if p.requires_grad]
        self.params = [p.detach() for p in self.raw]
        self.snap: list[torch.Tensor] = []
        self.host: torch.Tensor | None = None

    def held_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.snap)

    def before_step(self, i: int) -> None:
        if not self.snap:
            self.snap = [p.clone() for p in self.params]
            return
        for s, p in zip(self.snap, self.params):
            s.copy_(p)

    def after_step(self, i: int, loss: torch.Tensor) -> None:
        grads = [p.grad for p in self.raw if p.grad is not None]
        g = torch._foreach_norm(grads, 2)
        w = torch._foreach_norm(self.params, 2)
        torch._foreach_sub_(self.snap, self.params)
        u = torch._foreach_norm(self.snap, 2)
        self.host = torch.stack([*g, *w, *u]).cpu()


class Lightning(Monitor):
    """What a LightningModule's `on_before_optimizer_step` does with Lightning's own `grad_norm` (per-tensor
    gradient 2-norms and their total) and a TensorBoard logger, called every step in a plain loop; where
    lightning is not installed, the same computation written out (`grad.norm(2)` per tensor, their norm)."""

    every = 1

    def __init__(self, model: nn.Module, tmp: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.model = model
        self.named = [(n, p) for n, p in model.named_parameters()]
        self.writer = SummaryWriter(os.path.join(tmp, "lightning"))
        try:
            from lightning.pytorch.utilities import grad_norm
        except ImportError:
            self.grad_norm: Callable[[nn.Module, float], dict[str, Any]] | None = None
        else:
            self.grad_norm = grad_norm

    def norms(self) -> dict[str, Any]:
        if self.grad_norm is not None:
            return self.grad_norm(self.model, 2)
        norms = {f"grad_2.0_norm/{n}": p.grad.detach().norm(2) for n, p in self.named if p.grad is not None}
        norms["grad_2.0_norm_total"] = torch.stack(list(norms.values())).norm(2)
        return norms

    def before_step(self, i: int) -> None:
        for tag, v in self.norms().items():
            self.writer.add_scalar(tag, float(v), i)

    def close(self) -> None:
        self.writer.close()


class Gradlog(Monitor):
    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer, tmp: str, **kwargs: Any) -> None:
        import gradlog
        from gradlog.run.logger import DEFAULT_EVERY
        from gradlog.writers import REGISTRY

        writer = kwargs.get("writer", inspect.signature(gradlog.GradLogger).parameters["writer"].default)
        if isinstance(writer, str) and writer not in REGISTRY:
            raise Skip(f"gradlog.writers.REGISTRY has no {writer!r} writer yet (its branch is not merged)")
        self.every = kwargs.get("every", DEFAULT_EVERY)
        if "count_zeros" in kwargs:  # the configuration tables' spelling: HistogramOptions carries it
            on = kwargs.pop("histograms", True)
            kinds = gradlog.HistogramOptions().kinds if on else ()
            kwargs["histograms"] = gradlog.HistogramOptions(kinds=kinds, count_zeros=kwargs.pop("count_zeros"))
        if "writer_options" in kwargs:  # the writer's own keyword arguments go through gradlog.Output
            kwargs["writer"] = gradlog.Output(writer, options=kwargs.pop("writer_options"))
        if writer != "memory":
            kwargs.setdefault("log_dir", os.path.join(tmp, f"gradlog-{writer}"))
        try:
            self.gl = gradlog.GradLogger(model, opt, print_report=False, **kwargs)
        except ImportError as exc:
            raise Skip(f"{writer} writer needs a package: {exc}") from exc

    def after_step(self, i: int, loss: torch.Tensor) -> None:
        self.gl.log(i)

    def held_bytes(self) -> int:
        return self.gl.meter.kept_bytes

    def fast_forward(self, i: int) -> int:
        assert self.every is not None
        ahead = -i % self.every
        self.gl.pipeline.optimizer_steps += ahead  # gradlog measures when its own step counter hits a multiple
        return i + ahead

    def close(self) -> None:
        self.gl.close()


class WandbWatch(Monitor):
    """`wandb.watch(model, log="all", log_freq=k)` in offline mode, with the loss logged every step.

    wandb's hooks write to the global `wandb.run`, so every watched model shares one offline run.
    """

    _run: Any = None
    _users = 0
    _owned = False

    def __init__(self, model: nn.Module, k: int, tmp: str) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise Skip("wandb is not installed") from exc
        self.every, self.offset = k, k - 1  # wandb's hooks fire on the k-th, 2k-th, ... call
        self.works_in_backward = True
        if WandbWatch._run is None and wandb.run is not None:  # e.g. the one gradlog's W&B writer started
            WandbWatch._run, WandbWatch._owned = wandb.run, False
        if WandbWatch._run is None:
            WandbWatch._owned = True
            WandbWatch._run = wandb.init(
                project="gradlog-bench",
                dir=tmp,
                mode="offline",
                settings=wandb.Settings(silent=True, console="off", x_disable_stats=True),
            )
        WandbWatch._users += 1
        self.run = WandbWatch._run
        self.model = model
        self.run.watch(model, log="all", log_freq=k)

    def after_step(self, i: int, loss: torch.Tensor) -> None:
        self.run.log({"loss": float(loss)})

    def close(self) -> None:
        with contextlib.suppress(Exception):  # its hooks go with it: a model watched again gets one set
            self.run.unwatch(self.model)
        WandbWatch._users -= 1
        if WandbWatch._users == 0:
            if WandbWatch._owned:  # a run gradlog's writer started is finished by that writer
                self.run.finish()
            WandbWatch._run = None


@dataclass
class ConfigSpec:
    """`hooks_model`: the monitor hooks the model itself (wandb.watch's forward and gradient hooks), so on a model
    shared by the configurations it gets a copy of its own: its hooks would otherwise fire on every configuration's
    steps (the baseline's included). Monitors that hook the optimizer or read `.grad` share the model."""

    key: str
    label: str
    make: Callable[[nn.Module, torch.optim.Optimizer, str], Monitor]
    hooks_model: bool = False


def _gl(**kw: Any) -> Callable[[nn.Module, torch.optim.Optimizer, str], Monitor]:
    return lambda m, o, tmp: Gradlog(m, o, tmp, **kw)


CONFIGS: list[ConfigSpec] = [
    ConfigSpec("baseline", "baseline (no monitoring)", lambda m, o, tmp: Baseline()),
    ConfigSpec("floor", "device-work floor (plain torch)", lambda m, o, tmp: Floor(m)),
    ConfigSpec(
        "scalars-1", "gradlog scalars, flags, ratio (histograms=False)", _gl(every=1, histograms=False, writer="memory")
    ),
    ConfigSpec(
        "zeros-1",
        "gradlog scalars + grad_zero_frac (histograms=False, count_zeros=True)",
        _gl(every=1, histograms=False, count_zeros=True, writer="memory"),
    ),
    ConfigSpec(
        "scalars-10",
        "gradlog scalars, flags, ratio (histograms=False)",
        _gl(every=10, histograms=False, writer="memory"),
    ),
    ConfigSpec(
        "scalars-100",
        "gradlog scalars, flags, ratio (histograms=False)",
        _gl(every=100, histograms=False, writer="memory"),
    ),
    ConfigSpec("hist-1", "gradlog + grad/weight/update histograms, MemoryWriter", _gl(every=1, writer="memory")),
    ConfigSpec("hist-10", "gradlog + grad/weight/update histograms, MemoryWriter", _gl(every=10, writer="memory")),
    ConfigSpec("default", "gradlog default: GradLogger(model, opt)", _gl()),
    ConfigSpec("tb-1", "gradlog full metrics -> TensorBoard writer", _gl(every=1, writer="tensorboard")),
    ConfigSpec(
        "wandb-scalars-1",
        "gradlog scalars, flags, ratio -> W&B writer (offline, histograms=False)",
        _gl(every=1, histograms=False, writer="wandb"),
    ),
    ConfigSpec("wandb-1", "gradlog full metrics -> W&B writer (offline)", _gl(every=1, writer="wandb")),
    ConfigSpec("watch-1", 'wandb.watch(log="all") offline', lambda m, o, tmp: WandbWatch(m, 1, tmp), hooks_model=True),
    ConfigSpec(
        "watch-10", 'wandb.watch(log="all") offline', lambda m, o, tmp: WandbWatch(m, 10, tmp), hooks_model=True
    ),
    ConfigSpec(
        "lightning",
        "Lightning grad_norm(model, 2) + SummaryWriter.add_scalar",
        lambda m, o, tmp: Lightning(m, tmp),
    ),
]

# --------------------------------------------------------------------------- timing


@dataclass
class Run:
    spec: ConfigSpec
    model: nn.Module
    opt: torch.optim.Optimizer
    loss_fn: Callable[[nn.Module], torch.Tensor]
    mon: Monitor
    step: int = 0
    times: list[tuple[int, int, float, float]] = field(default_factory=list)  # (round, step, step s, window s)
    peak_mb: float | None = None
    peak_max_mb: float | None = None  # the largest repeat's (a snapshot rotation's largest step), not the minimum
    make_s: float = 0.0  # constructing the monitor (gradlog: its fingerprint pass)
    close_s: float = 0.0  # closing it (gradlog: fingerprints again, the diagnosis, the writers)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_step(run: Run, device: torch.device | None = None) -> float:
    """One step; returns the seconds spent from just before the monitor's pre-step work to the end
    of its post-step work (the optimizer step included), synchronised when `device` is given."""
    loss = run.loss_fn(run.model)
    loss.backward()
    if device is not None:
        _sync(device)
    t0 = time.perf_counter()
    run.mon.before_step(run.step)
    run.opt.step()
    run.mon.after_step(run.step, loss.detach())
    if device is not None:
        _sync(device)
    window = time.perf_counter() - t0
    run.opt.zero_grad(set_to_none=True)
    run.step += 1
    return window


def timed_step(run: Run, rnd: int, device: torch.device) -> None:
    _sync(device)
    t0 = time.perf_counter()
    window = train_step(run, device)
    _sync(device)
    run.times.append((rnd, run.step - 1, time.perf_counter() - t0, window))


# --------------------------------------------------------------------------- memory


class RssSampler:
    """Peak resident memory while a block runs, sampled from /proc/self/statm by a thread."""

    def __init__(self, period_s: float = 0.0002) -> None:
        self.period = period_s
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.peak = self.window_peak = 0
        self._stop = threading.Event()

    def rss(self) -> int:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * self.page

    def _loop(self) -> None:
        while not self._stop.is_set():
            r = self.rss()
            self.peak = max(self.peak, r)
            self.window_peak = max(self.window_peak, r)
            time.sleep(self.period)

    def mark(self) -> int:
        """Start a sub-window (its peak is `window_peak`); returns the RSS now."""
        r = self.rss()
        self.window_peak = r
        return r

    @contextlib.contextmanager
    def measure(self) -> Iterator[None]:
        self.peak = self.rss()
        self._stop.clear()
        th = threading.Thread(target=self._loop, daemon=True)
        th.start()
        try:
            yield
        finally:
            self._stop.set()
            th.join()
            self.peak = max(self.peak, self.rss())


def _glibc() -> Any:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim  # noqa: B018 - glibc only
        return libc
    except (OSError, AttributeError):
        return None


def peak_growth_mb(run: Run, device: torch.device, sampler: RssSampler, libc: Any) -> tuple[float, float]:
    """Peak memory growth during one step (the next logged one, or any step for the baseline).

    Two windows: the whole step, and optimizer-step-plus-monitor only (where activations are gone,
    so a snapshot of the parameters shows even when it does not raise the step's overall peak).
    """
    if run.mon.every is not None:
        run.step = run.mon.fast_forward(run.step)
        while not run.mon.logged(run.step):
            train_step(run)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        loss = run.loss_fn(run.model)
        loss.backward()
        whole = torch.cuda.max_memory_allocated(device) - start
        torch.cuda.reset_peak_memory_stats(device)
        window_start = torch.cuda.memory_allocated(device)
        run.mon.before_step(run.step)
        run.opt.step()
        run.mon.after_step(run.step, loss.detach())
        torch.cuda.synchronize(device)
        window = torch.cuda.max_memory_allocated(device) - window_start
        whole = max(whole, torch.cuda.max_memory_allocated(device) - start)
        run.opt.zero_grad(set_to_none=True)
        run.step += 1
        held = run.mon.held_bytes()
        return (whole + held) / 2**20, (window + held) / 2**20
    if libc is not None:
        libc.malloc_trim(0)
    start = sampler.rss()
    with sampler.measure():
        loss = run.loss_fn(run.model)
        loss.backward()
        window_start = sampler.mark()
        run.mon.before_step(run.step)
        run.opt.step()
        run.mon.after_step(run.step, loss.detach())
        window = sampler.window_peak - window_start
        run.opt.zero_grad(set_to_none=True)
        run.step += 1
    held = run.mon.held_bytes()  # kept from the step before, so not part of this step's growth
    return (sampler.peak - start + held) / 2**20, (window + held) / 2**20


def check_sync(model: ModelSpec, device: torch.device, steps: int = 20) -> str:
    """CUDA only: host syncs per step under gradlog full metrics every 10, from torch's sync debug mode."""
    import gradlog

    net, loss_fn = model.build(device)
    opt = model.optimizer(net)
    gl = gradlog.GradLogger(net, opt, every=10, print_report=False)
    run = Run(CONFIGS[0], net, opt, loss_fn, Baseline())
    measured: list[int] = []
    unmeasured: list[int] = []
    for i in range(steps):
        torch.cuda.synchronize(device)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                train_step(run)
                gl.log(i)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        n = sum("synchroniz" in str(w.message) for w in caught)
        (measured if i % 10 == 0 else unmeasured).append(n)
    gl.close()
    return (
        f"host syncs per step ({model.name}, gradlog full metrics every 10, torch.cuda.set_sync_debug_mode): "
        f"unmeasured steps {sorted(set(unmeasured))}, measured steps {sorted(set(measured))} "
        "(training itself, without gradlog, is included in both)"
    )


# --------------------------------------------------------------------------- statistics


@dataclass
class Row:
    key: str
    label: str
    every: str
    median_ms: float
    ratio: float
    logged_ms: float | None
    peak_mb: float | None
    peak_max_mb: float | None = None


def summarise(runs: list[Run], base: Run) -> list[Row]:
    by_round: dict[int, list[float]] = {}
    for rnd, _, t, _ in base.times:
        by_round.setdefault(rnd, []).append(t)
    base_med = {r: statistics.median(ts) for r, ts in by_round.items()}
    base_ms = statistics.median(t for _, _, t, _ in base.times) * 1e3
    base_window_ms = statistics.median(w for _, _, _, w in base.times) * 1e3
    rows = []
    for run in runs:
        norm_logged = [t / base_med[r] for r, i, t, _ in run.times if run.mon.logged(i)]
        norm_plain = [t / base_med[r] for r, i, t, _ in run.times if not run.mon.logged(i)]
        every = run.mon.every
        if every is None:
            ratio, logged = statistics.median(norm_plain), None
        else:
            lg = statistics.median(norm_logged) if norm_logged else math.nan
            pl = statistics.median(norm_plain) if norm_plain else lg
            ratio = ((every - 1) * pl + lg) / every
            if run.mon.works_in_backward:
                logged = (lg - 1) * base_ms
            else:  # the optimizer window alone: the same cost without forward/backward's noise
                windows = [w for _, i, _, w in run.times if run.mon.logged(i)]
                logged = statistics.median(windows) * 1e3 - base_window_ms if windows else math.nan
        rows.append(
            Row(
                run.spec.key,
                run.spec.label,
                "-" if every is None else str(every),
                statistics.median(t for _, _, t, _ in run.times) * 1e3,
                ratio,
                logged,
                run.peak_mb,
                run.peak_max_mb,
            )
        )
    return rows


def table(bench: Bench, rows: list[Row]) -> str:
    model = bench.model
    frozen = bench.n_params - bench.n_trainable
    out = [
        f"### {model.name}: {model.describe}",
        "",
        f"{bench.n_params / 1e6:.1f}M parameters in {bench.n_tensors} tensors"
        + (f" ({frozen / 1e6:.1f}M frozen)" if frozen else "")
        + f"; one fp32 copy of the trainable ones is {bench.trainable_bytes / 2**20:.0f} MB.",
        "",
        "| configuration | every | median step ms | ratio | ms per logged step | peak MB over baseline | "
        "largest repeat MB | largest / weights' bytes |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    weights_mb = bench.trainable_bytes / 2**20
    for r in rows:
        logged = "-" if r.logged_ms is None else f"{r.logged_ms:.1f}"
        peak = "-" if r.peak_mb is None else f"{r.peak_mb:.0f}"
        top = "-" if r.peak_max_mb is None else f"{r.peak_max_mb:.0f}"
        share = "-" if r.peak_max_mb is None or not weights_mb else f"{max(r.peak_max_mb, 0) / weights_mb:.1%}"
        out.append(
            f"| {r.label} | {r.every} | {r.median_ms:.1f} | {r.ratio:.3f}x | {logged} | {peak} | {top} | {share} |"
        )
    for s in bench.skipped:
        out.append(f"\nskipped: {s}")
    return "\n".join(out)


# --------------------------------------------------------------------------- main


@dataclass
class Bench:
    model: ModelSpec
    runs: list[Run]
    base: Run
    skipped: list[str]
    n_params: int
    n_tensors: int
    n_trainable: int = 0
    trainable_bytes: int = 0
    largest_bytes: int = 0  # the largest trainable tensor's
    n_slices: int = 0  # rows + columns of every trainable tensor with 2+ dims, elements of 1-D ones
    rows: list[Row] = field(default_factory=list)


def count_slices(params: list[torch.Tensor]) -> int:
    """Slices the per-slice evidence keeps (issue 12): dim-0 rows and dim-1 columns, or the elements of 1-D tensors."""
    return sum(p.shape[0] + p.shape[1] if p.dim() >= 2 else p.numel() for p in params)


def model_configs(model: ModelSpec, args: argparse.Namespace) -> list[str]:
    """--configs when given, else the model's own set (trimmed by --quick)."""
    if args.configs_given:
        return list(args.configs)
    keys = list(model.configs) if model.configs is not None else [c.key for c in CONFIGS]
    if args.quick:
        keys = [k for k in keys if k in QUICK_CONFIGS]
    return keys


#: --quick keeps the configurations behind the targets.
QUICK_CONFIGS = (
    "baseline",
    "floor",
    "scalars-1",
    "scalars-100",
    "hist-1",
    "default",
    "tb-1",
    "wandb-scalars-1",
    "wandb-1",
    "watch-1",
)


def bench_model(
    model: ModelSpec,
    args: argparse.Namespace,
    device: torch.device,
    tmp: str,
    configs: list[str] | None = None,
    rounds: int | None = None,
    steps: int | None = None,
    quiet: bool = False,
) -> Bench:
    runs: list[Run] = []
    skipped: list[str] = []
    keys = configs if configs is not None else model_configs(model, args)
    rounds = rounds if rounds is not None else args.rounds
    steps = steps if steps is not None else (min(model.steps, args.steps) if model.steps else args.steps)
    shared = model.build(device) if model.shared else None
    bench = Bench(model, [], None, skipped, 0, 0)  # type: ignore[arg-type]
    for spec in CONFIGS:
        if spec.key not in keys:
            continue
        net, loss_fn = shared if shared is not None and not spec.hooks_model else model.build(device)
        params = list(net.parameters())
        trainable = [p for p in params if p.requires_grad]
        bench.n_params = sum(p.numel() for p in params)
        bench.n_tensors = len(params)
        bench.n_trainable = sum(p.numel() for p in trainable)
        bench.trainable_bytes = sum(p.numel() * p.element_size() for p in trainable)
        bench.largest_bytes = max((p.numel() * p.element_size() for p in trainable), default=0)
        bench.n_slices = count_slices(trainable)
        opt = model.optimizer(net)
        t0 = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mon = spec.make(net, opt, tmp)
        except Skip as exc:
            skipped.append(f"{spec.label}: {exc}")
            continue
        except Exception as exc:  # a backend that fails to start is reported, not fatal
            skipped.append(f"{spec.label}: {type(exc).__name__}: {exc}")
            continue
        runs.append(Run(spec, net, opt, loss_fn, mon, make_s=time.perf_counter() - t0))
    base = next((r for r in runs if r.spec.key == "baseline"), None)
    if base is None:
        raise SystemExit("the baseline configuration is required (it is what every ratio divides by)")
    bench.runs, bench.base = runs, base
    if shared is not None:  # one model, an optimizer per configuration: none replaces another's (gradlog would
        for run in runs:  # otherwise follow the baseline's optimizer, which steps the same parameters)
            gl = getattr(run.mon, "gl", None)
            if gl is not None:
                for other in runs:
                    if other.opt is not run.opt:
                        gl.pipeline._others[id(other.opt)] = weakref.ref(other.opt)
    t0 = time.perf_counter()
    for run in runs:
        for _ in range(args.warmup):
            train_step(run)
    for rnd in range(rounds):
        order = runs[rnd % len(runs) :] + runs[: rnd % len(runs)]
        for run in order:
            if run.mon.every is not None and run.mon.every > steps:
                run.step = run.mon.fast_forward(run.step)  # so that every round times one logged step
            for _ in range(steps):
                timed_step(run, rnd, device)
        if not quiet:
            print(f"  {model.name}: round {rnd + 1}/{rounds} done, {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return bench


def measure_memory(bench: Bench, args: argparse.Namespace, device: torch.device) -> None:
    """After all timing: it changes glibc's malloc settings for the rest of the process."""
    sampler, libc = RssSampler(), _glibc()
    if libc is not None and device.type == "cpu":
        libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD fixed at 64 KiB: big blocks go back to the OS on free
        libc.mallopt(-1, 0)  # M_TRIM_THRESHOLD 0
    # Rounds of every configuration in turn, the baseline included, as the timing does: the allocator's state
    # drifts (the baseline's own optimizer-step window read 3.8-10.6 MB in four samples on the 5,000-tensor
    # model), so each configuration's minimum is taken over the same spread of conditions as the baseline's.
    samples: dict[str, list[tuple[float, float]]] = {run.spec.key: [] for run in bench.runs}
    for _ in range(args.memory_repeats):
        for run in bench.runs:
            samples[run.spec.key].append(peak_growth_mb(run, device, sampler, libc))
    growth = {key: (min(w for w, _ in got), min(o for _, o in got)) for key, got in samples.items()}
    for key, got in samples.items():  # the spread behind each minimum, for whoever reads the log
        print(f"  {bench.model.name} memory {key}: " + " ".join(f"{w:.1f}/{o:.1f}" for w, o in got), file=sys.stderr)
    base_whole, base_window = growth["baseline"]
    for run in bench.runs:
        whole, window = growth[run.spec.key]
        run.peak_mb = max(whole - base_whole, window - base_window)
        # Under a snapshot budget smaller than the model, measured steps copy different tensors in rotation: the
        # minimum is the rotation's smallest step, so the largest repeat is kept too (the budget is a maximum).
        run.peak_max_mb = max(max(w - base_whole, o - base_window) for w, o in samples[run.spec.key])


def memory_phase(bench: Bench, args: argparse.Namespace) -> None:
    """The model's peak memory, measured in a fresh process of this script (`--memory-only`) with the same
    flags: its configurations are built, warmed up and sampled there (`measure_memory`).

    Why a process of its own: the sampling fixes glibc's malloc settings for the rest of the process, so
    models timed after it were timed under them (every block from 64 kB a fresh mmap); and a peak read after
    other models had come and gone depended on that history, not on the model: the 5,000-tensor model's
    default configuration read 11-12 MB on its own and 19-42 MB after the 400-tensor MLP, the same code."""
    keys = [row.key for row in bench.rows]
    cmd = [sys.executable, os.path.abspath(__file__), *args.argv, "--models", bench.model.name]
    cmd += ["--configs", ",".join(keys), "--memory-only", "--no-growth", "--no-fingerprints"]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=False)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        print(f"  {bench.model.name}: the memory process failed (exit {done.returncode})", file=sys.stderr)
        return
    peaks = json.loads(lines[-1])
    for row in bench.rows:
        got = peaks.get(row.key)
        row.peak_mb, row.peak_max_mb = (got[0], got[1]) if isinstance(got, list) else (got, None)


def memory_only(args: argparse.Namespace, models: dict[str, ModelSpec], device: torch.device, tmp: str) -> None:
    """`--memory-only`: one model's configurations built, warmed up and sampled; the peaks as one JSON line."""
    (name,) = args.models
    bench = bench_model(models[name], args, device, tmp, configs=args.configs, rounds=0, quiet=True)
    measure_memory(bench, args, device)
    peaks = {run.spec.key: [run.peak_mb, run.peak_max_mb] for run in bench.runs}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for run in bench.runs:
            run.mon.close()
    print(json.dumps(peaks), flush=True)


def finish(bench: Bench) -> str:
    for run in bench.runs:
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run.mon.close()
        run.close_s = time.perf_counter() - t0
    bench.rows = summarise(bench.runs, bench.base)
    return table(bench, bench.rows)


# --------------------------------------------------------------------------- as the user pays it

#: configurations timed by wall clock through close(): the writers that work on threads and processes of their own
#: (TensorBoard's writer thread; the W&B writer's thread, wandb's own thread and its wandb-core process), the
#: MemoryWriter as the same measurements without a backend, and wandb.watch.
PAID_KEYS = ("baseline", "hist-1", "tb-1", "wandb-scalars-1", "wandb-1", "watch-1")


#: wandb settings of both runs in the wall-clock table: no console capture, no system-metrics sampler (a process
#: of its own), silent. Otherwise each tool runs with its own defaults: wandb's for wandb.watch, gradlog's
#: (`gradlog.writers.wandb.run_settings`) for the run gradlog's writer starts.
QUIET = {"silent": True, "console": "off", "x_disable_stats": True}


def _gradlog_wandb_settings() -> Any:
    import wandb

    try:
        from gradlog.writers.wandb import run_settings
    except ImportError:  # a gradlog from before run_settings: its default was the 0.1 s flush interval alone
        return wandb.Settings(x_transaction_log_flush_interval=0.1, **QUIET)
    return run_settings(wandb, **QUIET)


def _paid_monitor(key: str, model: nn.Module, opt: torch.optim.Optimizer, tmp: str) -> Monitor:
    """A fresh monitor for one wall-clock round: each W&B one starts (and at close finishes) a run of its own."""
    spec = next(c for c in CONFIGS if c.key == key)
    if key in ("wandb-1", "wandb-scalars-1"):
        kw: dict[str, Any] = {"every": 1, "writer": "wandb", "writer_options": {"settings": _gradlog_wandb_settings()}}
        if key == "wandb-scalars-1":
            kw["histograms"] = False
        return Gradlog(model, opt, tmp, **kw)
    if key == "watch-1":
        import wandb

        WandbWatch._run = wandb.init(project="gradlog-bench", dir=tmp, mode="offline", settings=wandb.Settings(**QUIET))
        WandbWatch._owned = True
        return WandbWatch(model, 1, tmp)
    return spec.make(model, opt, tmp)


def _children_cpu_s() -> float:
    """CPU seconds of this process's child processes still running (wandb-core), from /proc (Linux; 0 elsewhere)."""
    me, total = os.getpid(), 0.0
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    try:
        pids = [d for d in os.listdir("/proc") if d.isdigit()]
    except OSError:
        return 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me:
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


@dataclass
class PaidSample:
    """One configuration's wall-clock round: `steps` training steps, then close()."""

    wall_s: float  # first step's start to close() returning
    loop_s: float  # the steps alone
    close_s: float
    step_s: list[float]  # each step
    main_cpu_s: float  # the training thread's CPU time over the window
    threads_cpu_s: float  # every other thread of this process (writer threads, wandb's asyncio thread)
    children_cpu_s: float  # child processes (wandb-core)


@dataclass
class PaidRow:
    key: str
    label: str
    steps: int
    wall_ms: float  # per step, through close()
    overhead_ms: float | None  # wall_ms minus the baseline's, median over the rounds of the same-round difference
    loop_ms: float
    close_ms: float
    median_step_ms: float
    main_cpu_ms: float
    threads_cpu_ms: float
    children_cpu_ms: float


def paid_bench(
    model: ModelSpec, args: argparse.Namespace, device: torch.device, tmp: str
) -> tuple[list[PaidRow], list[str]]:
    """What a user's training loop pays, by wall clock: `--paid-steps` steps with a fresh monitor and its
    close(), from the first step's start until close() returns, so the work a monitor leaves to a thread
    or a process of its own (a writer's backlog, wandb-core) lands in its own window, not the next
    configuration's. Every configuration trains its own copy of the model; an untimed round first (imports,
    allocator, first steps), then `--paid-rounds` rounds in a rotating order; a configuration's overhead
    is the median over rounds of its per-step wall time minus the baseline's in the same round.
    Construction (a W&B run's `wandb.init`) is outside the window; finishing the run (`close()`) is inside."""
    keys = [k for k in model_configs(model, args) if k in PAID_KEYS]
    built: dict[str, tuple[nn.Module, torch.optim.Optimizer, Callable[[nn.Module], torch.Tensor]]] = {}
    skipped: list[str] = []
    shared = model.build(device) if model.shared else None  # one window at a time: they may share it all
    shared_opt = model.optimizer(shared[0]) if shared is not None else None
    for key in keys:
        net, loss_fn = shared if shared is not None else model.build(device)
        built[key] = (net, shared_opt or model.optimizer(net), loss_fn)
    samples: dict[str, list[PaidSample]] = {k: [] for k in keys}
    steps = args.paid_steps
    t_start = time.perf_counter()
    for rnd in range(args.paid_rounds + 1):  # round 0 is the untimed warm-up
        order = keys[rnd % len(keys) :] + keys[: rnd % len(keys)]
        for key in order:
            net, opt, loss_fn = built[key]
            spec = next(c for c in CONFIGS if c.key == key)
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    mon = _paid_monitor(key, net, opt, tmp)
            except Skip as exc:
                if rnd == 0:
                    skipped.append(f"{spec.label}: {exc}")
                continue
            run = Run(spec, net, opt, loss_fn, mon)
            gc.collect()
            _sync(device)
            n = steps if rnd else max(2, args.warmup)
            child0, main0, proc0 = _children_cpu_s(), time.thread_time(), time.process_time()
            t0 = time.perf_counter()
            step_s = []
            for _ in range(n):
                a = time.perf_counter()
                train_step(run, device)
                _sync(device)
                step_s.append(time.perf_counter() - a)
            t1 = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mon.close()
            _sync(device)
            t2 = time.perf_counter()
            main = time.thread_time() - main0
            others = time.process_time() - proc0 - main
            child = _children_cpu_s() - child0
            if rnd:
                samples[key].append(PaidSample(t2 - t0, t1 - t0, t2 - t1, step_s, main, others, child))
        print(
            f"  {model.name} wall clock: round {rnd}/{args.paid_rounds} done, {time.perf_counter() - t_start:.0f} s",
            file=sys.stderr,
        )
    rows = []
    base = samples.get("baseline") or []
    for key in keys:
        got = samples[key]
        if not got:
            continue
        spec = next(c for c in CONFIGS if c.key == key)
        over = (
            statistics.median((g.wall_s - b.wall_s) / steps for g, b in zip(got, base)) * 1e3
            if base and key != "baseline"
            else None
        )
        rows.append(
            PaidRow(
                key,
                spec.label,
                steps,
                statistics.median(g.wall_s for g in got) / steps * 1e3,
                over,
                statistics.median(g.loop_s for g in got) / steps * 1e3,
                statistics.median(g.close_s for g in got) * 1e3,
                statistics.median(t for g in got for t in g.step_s) * 1e3,
                statistics.median(g.main_cpu_s for g in got) / steps * 1e3,
                statistics.median(g.threads_cpu_s for g in got) / steps * 1e3,
                statistics.median(g.children_cpu_s for g in got) / steps * 1e3,
            )
        )
    return rows, skipped


def paid_table(model: ModelSpec, rows: list[PaidRow], skipped: list[str], args: argparse.Namespace) -> str:
    watch = next((r for r in rows if r.key == "watch-1"), None)
    load = os.getloadavg() if hasattr(os, "getloadavg") else (math.nan,) * 3
    out = [
        f"#### {model.name}: as the user pays it (wall clock through close(), {args.paid_steps} steps x "
        f"{args.paid_rounds} rounds, load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} at the end)",
        "",
        "| configuration | ms per step, through close() | overhead ms | / watch's overhead | steps alone ms | "
        "median step ms | close() ms | CPU ms per step: training thread / other threads / child processes | "
        "CPU overhead / watch's |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    base = next((r for r in rows if r.key == "baseline"), None)

    def cpu(r: PaidRow) -> float:
        return r.main_cpu_ms + r.threads_cpu_ms + r.children_cpu_ms

    for r in rows:
        over = "-" if r.overhead_ms is None else f"{r.overhead_ms:.1f}"
        ratio = (
            f"{r.overhead_ms / watch.overhead_ms:.2f}"
            if r.overhead_ms is not None and watch is not None and watch.overhead_ms and watch.overhead_ms > 0
            else "-"
        )
        out.append(
            f"| {r.label} | {r.wall_ms:.1f} | {over} | {ratio} | {r.loop_ms:.1f} | {r.median_step_ms:.1f} | "
            f"{r.close_ms:.0f} | {r.main_cpu_ms:.1f} / {r.threads_cpu_ms:.1f} / {r.children_cpu_ms:.1f} | "
            + (
                f"{(cpu(r) - cpu(base)) / (cpu(watch) - cpu(base)):.2f} |"
                if base is not None and watch is not None and r is not base and cpu(watch) > cpu(base)
                else "- |"
            )
        )
    for s in skipped:
        out.append(f"\nskipped: {s}")
    return "\n".join(out)


# --------------------------------------------------------------------------- fingerprints


def _median_s(work: Callable[[], object], repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        work()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@dataclass
class FingerprintRow:
    model: str
    elements: int
    tensors: int
    sum_ms: float
    take_ms: float  # the pass at construction: per-slice signatures, whole-tensor answer included
    compare_ms: float  # the pass at close: which slices changed since
    make_ms: float
    close_ms: float


def fingerprint_cost(bench: Bench, device: torch.device) -> FingerprintRow:
    """sum() over every tensor against gradlog's fingerprint passes over the same tensors (construction's
    `take_all`, close's `changes_all`), and the logger's construction and close() (median over
    the gradlog configurations of the run)."""
    from gradlog.measure.fingerprint import changes_all, take_all

    params = [p.detach() for p in bench.base.model.parameters()]

    def sums() -> None:
        torch.stack([p.sum() for p in params]).cpu()

    def compare() -> None:
        changed = changes_all(first, params)
        torch.stack([c.any() for c in changed if c is not None]).cpu()  # the answer read back, as close() does

    sum_s = _median_s(sums)
    take_s = _median_s(lambda: take_all(params))
    first = take_all(params)
    compare_s = _median_s(compare)
    _sync(device)
    gl_runs = [r for r in bench.runs if isinstance(r.mon, Gradlog)]
    return FingerprintRow(
        bench.model.name,
        bench.n_params,
        bench.n_tensors,
        sum_s * 1e3,
        take_s * 1e3,
        compare_s * 1e3,
        statistics.median(r.make_s for r in gl_runs) * 1e3 if gl_runs else math.nan,
        statistics.median(r.close_s for r in gl_runs) * 1e3 if gl_runs else math.nan,
    )


def fingerprint_table(rows: list[FingerprintRow]) -> str:
    out = [
        "### fingerprints: construction and close() against a sum() over the same tensors",
        "",
        "`sum()`: `p.sum()` of every parameter, one host copy; fingerprints at construction: `gradlog.measure."
        "fingerprint.take_all` of every parameter (the per-slice signatures; the whole-tensor answer comes from "
        "the same pass); at close: `changes_all` against them, the answer read back; construction "
        "and close(): `GradLogger(...)` and `close()` after training (median over the model's gradlog "
        "configurations; close includes the diagnosis and the writers' close).",
        "",
        "| model | elements | tensors | sum() ms | fingerprints at construction ms (x sum) | at close ms (x sum) | "
        "construction ms (x sum) | close() ms (x sum) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def x(ms: float | None, ref: float) -> str:
        return "-" if ms is None or math.isnan(ms) else f"{ms:.0f} ({ms / ref:.1f}x)"

    for r in rows:
        out.append(
            f"| {r.model} | {r.elements / 1e6:.1f}M | {r.tensors} | {r.sum_ms:.1f} | {x(r.take_ms, r.sum_ms)} | "
            f"{x(r.compare_ms, r.sum_ms)} | {x(r.make_ms, r.sum_ms)} | {x(r.close_ms, r.sum_ms)} |"
        )
    return "\n".join(out)


# --------------------------------------------------------------------------- targets


def _row(bench: Bench | None, key: str) -> Row | None:
    if bench is None:
        return None
    return next((r for r in bench.rows if r.key == key), None)


def targets_table(benches: list[Bench], fps: list[FingerprintRow], paid: dict[str, list[PaidRow]] | None = None) -> str:
    """Issue 17's targets, from the tables above (ratios of one process's interleaved runs)."""
    by = {b.model.name: b for b in benches}
    out = ["### against the targets", "", "| target | model | measured | limit | met |", "|---|---|---:|---:|---|"]

    def add(target: str, model: str, value: float | None, limit: float, fmt: str = "{:.2f}") -> None:
        if value is None or math.isnan(value):
            return
        met = "yes" if value <= limit else "NO"
        out.append(f"| {target} | {model} | {fmt.format(value)} | {fmt.format(limit)} | {met} |")

    def logged(b: Bench | None, key: str) -> float | None:
        r = _row(b, key)
        return None if r is None else r.logged_ms

    def over(b: Bench | None, key: str, ref: str) -> float | None:
        a, f = logged(b, key), logged(b, ref)
        return None if a is None or f is None or f <= 0 else a / f

    add(
        "measured step (scalars every 1) / floor of the trainable part",
        "frozen",
        over(by.get("frozen"), "scalars-1", "floor"),
        1.5,
    )
    # The intent behind the frozen target, checked directly: the same head costs gradlog the same with or
    # without 50M frozen parameters beside it (noise allowance 10%).
    fz, hd = logged(by.get("frozen"), "scalars-1"), logged(by.get("head"), "scalars-1")
    if fz is not None and hd is not None and hd > 0:
        add(
            "measured step (scalars every 1): frozen model / its head alone (frozen tensors' own cost)",
            "frozen",
            fz / hd,
            1.1,
        )
    add("measured step (scalars every 1) / floor", "big", over(by.get("big"), "scalars-1", "floor"), 2.0)
    for name, b in by.items():
        d, base = _row(b, "default"), _row(b, "baseline")
        if d is not None and base is not None:
            limit = 1.03 if name.startswith("gpt") or name == "llama" else 1.02 if name == "frozen" else 1.10
            add("default GradLogger(model, opt) / no monitoring", name, d.ratio, limit, "{:.3f}")
            if d.logged_ms is not None and d.every.isdigit():
                # the steadier estimate: one logged step's cost spread over `every` baseline steps
                spread = 1 + d.logged_ms / int(d.every) / base.median_ms
                add("default, from its logged-step cost: 1 + ms / every / baseline ms", name, spread, limit, "{:.3f}")
    deep, mlp = by.get("deep"), by.get("mlp")
    for key in ("scalars-1", "hist-1"):
        a, m = logged(deep, key), logged(mlp, key)
        if deep is not None and mlp is not None and a is not None and m is not None:
            per_deep, per_mlp = a / deep.n_tensors, m / mlp.n_tensors
            add(f"ms per logged step per tensor ({key}), deep / mlp", "deep", per_deep / per_mlp, 2.0)
    for name, rows in (paid or {}).items():
        # as the user pays it: wall clock through close(), the writers' threads and wandb-core included
        watch = next((r for r in rows if r.key == "watch-1"), None)
        if watch is None or watch.overhead_ms is None or watch.overhead_ms <= 0:
            continue
        for key, what, limit in (("wandb-1", "W&B", 1 / 3), ("tb-1", "TensorBoard", 1 / 4)):
            r = next((r for r in rows if r.key == key), None)
            if r is not None and r.overhead_ms is not None:
                add(
                    f"{what} writer overhead / wandb.watch(log='all') overhead, every step, wall clock through close()",
                    name,
                    r.overhead_ms / watch.overhead_ms,
                    limit,
                )
    for b in benches:
        gl_peaks = [r.peak_mb for r in b.rows if r.peak_mb is not None and r.key in GRADLOG_KEYS]
        if gl_peaks:
            # "One copy" as this instrument reads it: the floor holds exactly one copy of the trainable
            # parameters and nothing else, so its own reading (RSS pages, the norms' outputs) is the copy's;
            # where it reads more than the copy's bytes, that reading is the allowance.
            floor = _row(b, "floor")
            copy = b.trainable_bytes / 2**20
            if floor is not None and floor.peak_mb is not None:
                copy = max(copy, floor.peak_mb)
            limit = max(copy + 32 * b.n_slices / 2**20, 1.0)
            add(
                "peak MB of a measured step over baseline <= one trainable copy (or the floor's reading) + 32 B/slice",
                b.model.name,
                max(gl_peaks),
                limit,
                "{:.2f}" if limit < 10 else "{:.0f}",
            )
    for b in benches:
        d = _row(b, "default")
        if d is not None and d.peak_max_mb is not None:
            # issue 40: a measured step at the defaults holds at most the snapshot budget over the un-monitored run;
            # a tensor larger than the budget is copied alone on its turn, so the bound is the larger of the two
            limit = _budget_mb(b) + 32 * b.n_slices / 2**20
            add(
                "peak MB of a default measured step over baseline (largest repeat) <= snapshot budget "
                "(max(10% of trainable bytes, 64 MB), or the largest tensor) + 32 B/slice",
                b.model.name,
                d.peak_max_mb,
                limit,
                "{:.0f}",
            )
    for fp in fps:
        add("fingerprints at construction / sum()", fp.model, fp.take_ms / fp.sum_ms, 5.0, "{:.1f}")
        add("fingerprints at close / sum()", fp.model, fp.compare_ms / fp.sum_ms, 5.0, "{:.1f}")
        add("construction / sum()", fp.model, fp.make_ms / fp.sum_ms, 5.0, "{:.1f}")
        if fp.model == "deep":
            add("close() minus the fingerprint pass, s", "deep", (fp.close_ms - fp.compare_ms) / 1e3, 1.0)
    return "\n".join(out)


def _budget_mb(bench: Bench) -> float:
    """MB one default measured step may copy: gradlog's "auto" snapshot budget, or the largest tensor (copied alone)."""
    from gradlog.measure.meter import budget_bytes

    budget = budget_bytes("auto", bench.trainable_bytes) or 0
    return max(budget, bench.largest_bytes) / 2**20


#: the measured steps the memory target is about: scalars, and the default configuration (histograms through
#: the TensorBoard writer). MemoryWriter rows are left out: that writer keeps every value of the run in memory.
GRADLOG_KEYS = ("scalars-1", "zeros-1", "scalars-10", "scalars-100", "default", "tb-1")


# --------------------------------------------------------------------------- growth


def growth_table(args: argparse.Namespace, device: torch.device, tmp: str, benches: list[Bench] | None = None) -> str:
    """Logged-step ms against trainable parameters (tensor count fixed) and against tensor count (size fixed),
    split into the scalars (norms, flags, update ratio: every element read, so they follow the parameters) and
    the histograms (hist-1 minus scalars-1: a tensor above `HistogramOptions.sample` entries is binned from a
    sample of that size, so this part should follow the tensor count and stay flat in parameters), then the
    models benchmarked above in this process (the large one included) that ran both configurations."""
    import gradlog

    sample = gradlog.HistogramOptions().sample
    widths = (256, 512, 1024) if args.quick else (512, 1024, 2048)
    counts = (500, 2000, 5000)
    specs = [
        ModelSpec(f"params-{w}", "", lambda dev, w=w: _mlp(dev, blocks=8, width=w, batch=16), optimizer=adamw_foreach)
        for w in widths
    ] + [
        ModelSpec(
            f"tensors-{n}", "", lambda dev, n=n: _mlp(dev, blocks=n // 2, width=32, batch=16), optimizer=adamw_foreach
        )
        for n in counts
    ]
    out = [
        "### growth: ms per logged step against trainable parameters and against tensor count",
        "",
        f"Residual MLPs: 8 blocks of width {'/'.join(map(str, widths))} (16 tensors), then width 32 with "
        "250/1,000/2,500 blocks; AdamW(foreach=True), batch 16; gradlog every step, MemoryWriter; then the models "
        f"above. Histogram part: hist-1 minus scalars-1 (three histograms a tensor; a tensor over {sample or 0:,} "
        "entries is binned from a sample of that size), split into the gradients' zero count a histogram step makes "
        "(zeros-1 minus scalars-1; NaN where zeros-1 did not run) and the histograms alone (hist-1 minus zeros-1). "
        "Sampled: tensors above the sample size.",
        "",
        "| model | trainable parameters | tensors | sampled | scalars ms | per M params | per 1k tensors | "
        "histogram part ms | per M params | per 1k tensors | of which the zero count ms | histograms alone ms | "
        "per M params | scalars + histograms ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def line(name: str, n_trainable: int, n_tensors: int, sampled: int, s: float, h: float, z: float) -> str:
        """`z`: zeros-1's ms (scalars + the zero count a histogram step makes): the histogram part's split into
        the gradients' zero count (a verdict input, every entry read by design) and the histograms alone."""
        mp, kt, part, zero = n_trainable / 1e6, n_tensors / 1e3, h - s, z - s
        return (
            f"| {name} | {mp:.2f}M | {n_tensors} | {sampled} | {s:.1f} | {s / mp:.2f} | {s / kt:.1f} | "
            f"{part:.1f} | {part / mp:.3f} | {part / kt:.1f} | {zero:.1f} | {h - z:.1f} | {(h - z) / mp:.3f} | "
            f"{h:.1f} |"
        )

    def n_sampled(model: nn.Module) -> int:
        return sum(p.numel() > (sample or math.inf) for p in model.parameters() if p.requires_grad)

    for spec in specs:
        bench = bench_model(
            spec,
            args,
            device,
            tmp,
            configs=["baseline", "scalars-1", "zeros-1", "hist-1"],
            rounds=args.growth_rounds,
            steps=3,
            quiet=True,
        )
        rows = summarise(bench.runs, bench.base)
        for run in bench.runs:
            run.mon.close()
        s, h, z = _row_of(rows, "scalars-1"), _row_of(rows, "hist-1"), _row_of(rows, "zeros-1")
        out.append(line(spec.name, bench.n_trainable, bench.n_tensors, n_sampled(bench.base.model), s, h, z))
        print(f"  growth: {spec.name} done", file=sys.stderr)
    for b in benches or []:
        s, h, z = _row_of(b.rows, "scalars-1"), _row_of(b.rows, "hist-1"), _row_of(b.rows, "zeros-1")
        if not (math.isnan(s) or math.isnan(h)):
            out.append(line(b.model.name, b.n_trainable, b.n_tensors, n_sampled(b.base.model), s, h, z))
    return "\n".join(out)


def _row_of(rows: list[Row], key: str) -> float:
    r = next((r for r in rows if r.key == key), None)
    return math.nan if r is None or r.logged_ms is None else r.logged_ms


# --------------------------------------------------------------------------- command line


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    keys = [c.key for c in CONFIGS]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--models", default=None, help="comma-separated, from: " + ", ".join(MODELS))
    p.add_argument(
        "--configs", default=None, help="comma-separated, from: " + ", ".join(keys) + " (default: each model's own set)"
    )
    p.add_argument("--rounds", type=int, default=None, help="rounds of interleaved configurations")
    p.add_argument("--steps", type=int, default=None, help="timed steps per configuration per round")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per configuration first")
    p.add_argument("--memory-repeats", type=int, default=4, help="logged steps sampled for memory (min taken)")
    p.add_argument("--no-memory", dest="memory", action="store_false", help="skip the memory measurement")
    p.add_argument("--quick", action="store_true", help="smaller models, fewer configurations, rounds and steps")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--no-check-sync", dest="check_sync", action="store_false", help="cuda: skip the sync count")
    p.add_argument("--frozen-params", type=float, default=None, help="frozen backbone size (default 50e6; quick 10e6)")
    p.add_argument(
        "--big-numel", type=float, default=None, help="elements of the huge tensor (default 200e6; quick 20e6)"
    )
    p.add_argument("--deep-tensors", type=int, default=5000, help="tensors of the deep model (default 5000)")
    p.add_argument("--llama-layers", type=int, default=20, help="layers of the llama model (default 20: ~320M)")
    p.add_argument(
        "--llama-seq", type=int, default=128, help="tokens per step of the llama model (default 128; batch 1)"
    )
    p.add_argument("--no-fingerprints", dest="fingerprints", action="store_false", help="skip the fingerprint table")
    p.add_argument("--no-growth", dest="growth", action="store_false", help="skip the growth table")
    p.add_argument("--growth-rounds", type=int, default=None, help="rounds per growth model (default 3; quick 2)")
    p.add_argument("--no-paid", dest="paid", action="store_false", help="skip the wall-clock-through-close() table")
    p.add_argument(
        "--paid-only", action="store_true", help="only the wall-clock-through-close() tables and their targets"
    )
    p.add_argument("--paid-steps", type=int, default=20, help="steps per wall-clock window (default 20)")
    p.add_argument("--paid-rounds", type=int, default=None, help="wall-clock rounds per model (default 3; quick 2)")
    p.add_argument("--out", default=None, help="also write the tables to this markdown file")
    p.add_argument("--memory-only", action="store_true", help=argparse.SUPPRESS)  # see memory_phase
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.configs_given = args.configs is not None
    args.configs = [c.strip() for c in (args.configs or ",".join(keys)).split(",") if c.strip()]
    bad = [c for c in args.configs if c not in keys]
    if bad:
        p.error(f"unknown configurations {bad}; choose from {keys}")
    if "baseline" not in args.configs:
        args.configs.insert(0, "baseline")
    if args.frozen_params is None:
        args.frozen_params = 10e6 if args.quick else 50e6
    if args.big_numel is None:
        args.big_numel = 20e6 if args.quick else 200e6
    if args.growth_rounds is None:
        args.growth_rounds = 2 if args.quick else 3
    if args.paid_rounds is None:
        args.paid_rounds = 2 if args.quick else 3
    models = model_specs(args)
    default_models = "gpt350m,mlp" if args.device.startswith("cuda") else "gpt,mlp,mlp100,frozen,head,big,deep"
    args.models = [m.strip() for m in (args.models or default_models).split(",") if m.strip()]
    bad = [m for m in args.models if m not in models]
    if bad:
        p.error(f"unknown models {bad}; choose from {list(models)}")
    if args.rounds is None:
        args.rounds = 4 if args.quick else 8
    if args.steps is None:
        args.steps = 4 if args.quick else 10
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    models = model_specs(args)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device here")
    if args.threads:
        torch.set_num_threads(args.threads)
    command = "python benchmarks/overhead.py " + " ".join(sys.argv[1:] if argv is None else argv)
    tmp = tempfile.mkdtemp(prefix="gradlog-bench-")
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_DIR", tmp)
    os.environ.setdefault("WANDB_SILENT", "true")
    import gradlog

    header = (
        f"`{command.strip()}` - gradlog {gradlog.__version__}, torch {torch.__version__}, {args.device}, "
        f"{torch.get_num_threads()} threads, {args.rounds} rounds x {args.steps} steps (+{args.warmup} warm-up)"
    )
    if args.memory_only:
        memory_only(args, models, device, tmp)
        return
    print(header, file=sys.stderr)
    parts = [header]
    if device.type == "cuda" and args.check_sync:
        for name in args.models:
            line = check_sync(models[name], device)
            print(line, flush=True)
            parts.append(line)
    benches: list[Bench] = []
    fps: list[FingerprintRow] = []
    texts: list[str] = []
    # One model at a time, closed before the next is built: the big ones do not fit in memory together.
    # W&B: monitors of one model may share one run, owned by the first; finish() closes in order.
    paid: dict[str, list[PaidRow]] = {}
    paid_texts: dict[str, str] = {}
    for name in args.models:
        if not args.paid_only:
            bench = bench_model(models[name], args, device, tmp)
            finish(bench)
            if args.fingerprints:
                fps.append(fingerprint_cost(bench, device))
            bench.runs = [bench.base]  # drop the other models' copies; the rows are kept
            benches.append(bench)
            gc.collect()
        keys = model_configs(models[name], args)
        if args.paid and "watch-1" in keys and ("wandb-1" in keys or "tb-1" in keys):
            rows, skipped = paid_bench(models[name], args, device, tmp)
            paid[name] = rows
            paid_texts[name] = paid_table(models[name], rows, skipped, args)
            print(paid_texts[name] + "\n", file=sys.stderr, flush=True)
            gc.collect()
    if args.paid_only:
        texts = [*paid_texts.values(), targets_table([], [], paid)]
        print("\n\n".join(texts) + "\n", flush=True)
        if args.out:
            with open(args.out, "w") as f:
                f.write("\n\n".join([header, *texts]) + "\n")
        return
    growth = growth_table(args, device, tmp, benches) if args.growth else None
    # Memory last, each model in a process of its own (`memory_phase`).
    for bench in benches:
        if args.memory:
            memory_phase(bench, args)
        text = table(bench, bench.rows)
        if bench.model.name in paid_texts:
            text += "\n\n" + paid_texts[bench.model.name]
        print(text + "\n", flush=True)
        texts.append(text)
    parts += texts
    if fps:
        text = fingerprint_table(fps)
        print(text + "\n", flush=True)
        parts.append(text)
    text = targets_table(benches, fps, paid)
    print(text + "\n", flush=True)
    parts.append(text)
    if growth is not None:
        print(growth + "\n", flush=True)
        parts.append(growth)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n\n".join(parts) + "\n")


if __name__ == "__main__":
    main()
