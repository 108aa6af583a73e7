"""The calibration zoo through optimizers, parameter-efficient methods and training styles no other zoo run
uses (issue 38, part three): orthogonalised updates (Muon beside AdamW), an optimizer whose model weights are
not its iterate (schedule-free AdamW), weights perturbed and restored around a second backward (SAM), slow
weights copied into the model (Lookahead), trust-ratio scaling (LAMB), torch's rarer optimizers (Adadelta,
ASGD, Rprop, Adamax, RAdam), several evaluations per step (LBFGS with a closure); peft's adapters other than
LoRA (DoRA, AdaLoRA with its rank pruning, VeRA, LoHa, LoKr, OFT, IA3, prompt and prefix tuning); and
distillation from a frozen teacher, DPO against a frozen reference, MoCo's momentum key encoder, parameter
groups whose learning rates differ 1000x, gradient noise and gradient centralisation hooks.

Every family is a `zoo.Setup` and runs through `zoo.run`, so the evidence of health is the zoo's own (training
metric and a fixed held-out evaluation fall >= 15%, every trainable tensor ends different from its start),
measured on the same run gradlog watched; `UNCHANGED_BY_DESIGN` names the tensors that end where they started
by design (AdaLoRA's `lora_E` of a module pruned to rank 0), which the test leaves out of that check.
`python tests/zoo_styles.py [family,...]` prints the JSON lines of `zoo.main` for these families (`MEASURED`
included: runs documented, not asserted OK).
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import zoo
from torch import nn
from torch.nn import functional as F

Batch = zoo.Batch


# --- the shared task: a ReLU MLP classifying clustered vectors ---------------------------------------------
def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def _clusters() -> tuple[Callable[[int], tuple[torch.Tensor, ...]], tuple[torch.Tensor, ...]]:
    """A stream of training batches (its own generator) and the fixed held-out 256 of `zoo`'s clustered task."""
    _, data = zoo._mlp_classifier_data()
    gen = torch.Generator().manual_seed(1)
    return (lambda n: data(gen, n)), zoo.held_out(lambda g: data(g, 256))


def _optimizer_on_mlp(make: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer], steps: int = 150) -> zoo.Setup:
    """The MLP trained by `make(model.parameters())` in zoo's hand-written loop (`zoo._fit_clusters`)."""
    model = _mlp()
    return zoo._fit_clusters(model, make(model.parameters()), steps)


# --- optimizers -----------------------------------------------------------------------------------------------
def muon_adamw() -> zoo.Setup:
    """`torch.optim.Muon` (lr 0.02, momentum 0.95, Newton-Schulz orthogonalised updates) on the two hidden 2-D
    weights, `AdamW` (lr 3e-3) on the biases and the head, as Muon's authors pair them; two optimizers, one
    `GradLogger` each over the whole model. Healthy: cross-entropy falls (train, held-out)."""
    model = _mlp()
    hidden = [model[0].weight, model[2].weight]
    rest = [p for p in model.parameters() if all(p is not h for h in hidden)]
    muon = torch.optim.Muon(hidden, lr=0.02, weight_decay=0.01)
    adamw = torch.optim.AdamW(rest, lr=3e-3)
    batch, (tx, ty) = _clusters()

    def step(i: int) -> float:
        model.train()
        x, y = batch(32)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        muon.step()
        adamw.step()
        muon.zero_grad()
        adamw.zero_grad()
        return float(loss.detach())

    test = zoo._evaluator(model, lambda: F.cross_entropy(model(tx), ty))
    return zoo.Setup(model, 150, test, step, [(model, muon), (model, adamw)])


class ScheduleFreeAdamW(torch.optim.Optimizer):
    """Schedule-free AdamW (Defazio et al. 2024, "The road less scheduled"), written from the paper: the
    gradient is taken at y = (1 - b1) z + b1 x, z takes an Adam-normalised SGD step, x is the running average of
    the z's (weights c = 1 / t), and the model holds y while training. `eval()` puts x (the point to evaluate
    at) into the model and `train()` puts y back, outside `step()`, as the schedulefree package does."""

    def __init__(self, params: Any, lr: float = 1e-2, betas: tuple[float, float] = (0.9, 0.999), wd: float = 0.0):
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": wd, "eps": 1e-8})
        self.training = True

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                s = self.state[p]
                if not s:
                    s["t"], s["z"], s["v"] = 0, p.clone(), torch.zeros_like(p)
                s["t"] += 1
                t, z, v = s["t"], s["z"], s["v"]
                v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                denom = (v / (1 - b2**t)).sqrt_().add_(group["eps"])
                x = (p - (1 - b1) * z) / b1  # the average, recovered from y and z
                z.addcdiv_(p.grad, denom, value=-group["lr"]).add_(p, alpha=-group["lr"] * group["weight_decay"])
                x.lerp_(z, 1 / t)
                p.copy_(x.lerp(z, 1 - b1))  # y = (1 - b1) z + b1 x

    @torch.no_grad()
    def _swap(self, training: bool) -> None:
        if training == self.training:
            return
        b1 = self.param_groups[0]["betas"][0]
        for group in self.param_groups:
            for p in group["params"]:
                if "z" in self.state[p]:  # y -> x is a lerp away from z by 1 - 1/b1, x -> y back toward it
                    p.lerp_(self.state[p]["z"], 1 - b1 if training else 1 - 1 / b1)
        self.training = training

    def eval(self) -> None:
        self._swap(False)

    def train(self) -> None:
        self._swap(True)


def schedule_free() -> zoo.Setup:
    """Schedule-free AdamW (lr 3e-3, no schedule) on the MLP, with an evaluation every 25 steps at the averaged
    point: `opt.eval()` swaps x into the model and `opt.train()` swaps y back, both outside `step()`, and the
    final evaluation is at x. Healthy: cross-entropy falls (train at y, held-out at x)."""
    model = _mlp()
    opt = ScheduleFreeAdamW(model.parameters(), lr=3e-3)
    batch, (tx, ty) = _clusters()
    scores = []

    def evaluate() -> float:
        opt.eval()
        was = model.training
        model.eval()
        with torch.no_grad():
            value = float(F.cross_entropy(model(tx), ty))
        model.train(was)
        return value

    def step(i: int) -> float:
        opt.train()
        model.train()
        x, y = batch(32)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if i % 25 == 24:
            scores.append(evaluate())
        return float(loss.detach())

    return zoo.Setup(model, 150, evaluate, step, [(model, opt)])


class SAM(torch.optim.Optimizer):
    """Sharpness-aware minimisation (Foret et al. 2021) in the form its most used PyTorch implementation has: an
    Optimizer holding its `base_optimizer` (sharing its param groups), with `first_step` (climb to
    w + rho g/|g|, remembering w) and `second_step` (put w back, then the base optimizer's step with the
    gradient taken at the climbed point); the training loop calls the two, never `step` itself."""

    def __init__(self, params: Any, base: type[torch.optim.Optimizer], rho: float = 0.05, **kwargs: Any) -> None:
        super().__init__(params, {"rho": rho, **kwargs})
        self.base_optimizer = base(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups

    @torch.no_grad()
    def first_step(self) -> None:
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                e = p.grad * (group["rho"] / (norm + 1e-12))
                self.state[p]["old_p"] = p.detach().clone()
                p.add_(e)

    @torch.no_grad()
    def second_step(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if "old_p" in self.state[p]:
                    p.copy_(self.state[p]["old_p"])
        self.base_optimizer.step()

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        assert closure is not None, "SAM needs a closure that recomputes the loss"
        self.first_step()
        with torch.enable_grad():
            closure()
        self.second_step()


def sam() -> zoo.Setup:
    """SAM (rho 0.05) around SGD with momentum 0.9 (lr 0.05): two forward/backward passes a step, the weights
    climbed and restored outside the base optimizer around the second (`first_step`, `second_step`); the
    `GradLogger` is given the SAM optimizer, as a user would. Healthy: cross-entropy falls (train, held-out)."""
    model = _mlp()
    opt = SAM(model.parameters(), torch.optim.SGD, lr=0.05, momentum=0.9)
    batch, (tx, ty) = _clusters()

    def step(i: int) -> float:
        model.train()
        x, y = batch(32)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.first_step()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.second_step()
        opt.zero_grad()
        return float(loss.detach())

    test = zoo._evaluator(model, lambda: F.cross_entropy(model(tx), ty))
    return zoo.Setup(model, 150, test, step, [(model, opt)])


class Lookahead(torch.optim.Optimizer):
    """Lookahead (Zhang et al. 2019) as the common PyTorch wrappers write it: it holds the inner `optimizer`
    and shares its param groups without running `Optimizer.__init__`; every `k` steps the slow weights move
    `alpha` of the way to the fast ones and are copied back into the model."""

    def __init__(self, optimizer: torch.optim.Optimizer, k: int = 5, alpha: float = 0.5) -> None:
        self.optimizer = optimizer
        self.param_groups = optimizer.param_groups
        self.k, self.alpha, self.count = k, alpha, 0
        self.slow = [p.detach().clone() for g in self.param_groups for p in g["params"]]

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self.optimizer.step()
        self.count += 1
        if self.count % self.k == 0:
            fast = [p for g in self.param_groups for p in g["params"]]
            for slow, p in zip(self.slow, fast):
                slow.lerp_(p, self.alpha)
                p.copy_(slow)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)


def lookahead() -> zoo.Setup:
    """Lookahead (k 5, alpha 0.5) around Adam (lr 3e-3): the slow weights are copied into the model every 5th
    step, after the inner step (gradlog unwraps the wrapper to the inner Adam, whose hooks fire). Healthy:
    cross-entropy falls (train, held-out)."""
    model = _mlp()
    return zoo._fit_clusters(model, Lookahead(torch.optim.Adam(model.parameters(), lr=3e-3)), 150)


class LAMB(torch.optim.Optimizer):
    """LAMB (You et al. 2020), from the paper: Adam's bias-corrected direction plus decoupled weight decay,
    scaled per tensor by the trust ratio |w| / |direction| (1 where either norm is 0)."""

    def __init__(self, params: Any, lr: float = 1e-2, betas: tuple[float, float] = (0.9, 0.999), wd: float = 0.01):
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": wd, "eps": 1e-6})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                s = self.state[p]
                if not s:
                    s["t"], s["m"], s["v"] = 0, torch.zeros_like(p), torch.zeros_like(p)
                s["t"] += 1
                s["m"].lerp_(p.grad, 1 - b1)
                s["v"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                m_hat = s["m"] / (1 - b1 ** s["t"])
                v_hat = s["v"] / (1 - b2 ** s["t"])
                direction = m_hat / (v_hat.sqrt() + group["eps"]) + group["weight_decay"] * p
                w_norm, d_norm = torch.linalg.vector_norm(p), torch.linalg.vector_norm(direction)
                trust = float(w_norm / d_norm) if w_norm > 0 and d_norm > 0 else 1.0
                p.add_(direction, alpha=-group["lr"] * trust)


def lamb() -> zoo.Setup:
    """LAMB (lr 1e-2, weight decay 0.01; each tensor's step scaled by its trust ratio, so a tensor's update is
    about lr x its norm, biases included). Healthy: cross-entropy falls (train, held-out)."""
    return _optimizer_on_mlp(lambda ps: LAMB(ps, lr=1e-2))


def adadelta() -> zoo.Setup:
    """`torch.optim.Adadelta` (lr 1.0, rho 0.9: its step is the ratio of two running RMS, no lr scale of its
    own). Healthy: cross-entropy falls (train, held-out)."""
    return _optimizer_on_mlp(lambda ps: torch.optim.Adadelta(ps, lr=1.0))


def asgd() -> zoo.Setup:
    """`torch.optim.ASGD` (lr 0.05, averaging from step 50; the average is kept in the optimizer's state, the
    model holds the iterate). Healthy: cross-entropy falls (train, held-out)."""
    return _optimizer_on_mlp(lambda ps: torch.optim.ASGD(ps, lr=0.05, t0=50))


def rprop() -> zoo.Setup:
    """`torch.optim.Rprop` (lr 1e-3: per-entry step sizes that grow x1.2 while the gradient's sign holds and
    shrink x0.5 when it flips; only the gradient's sign is used) full-batch, as Rprop is meant to run: the same
    2,048 training points at every step, 40 steps. Healthy: cross-entropy falls (train, held-out)."""
    model = _mlp()
    opt = torch.optim.Rprop(model.parameters(), lr=1e-3)
    batch, (tx, ty) = _clusters()
    x, y = batch(2048)
    return zoo._plain(model, opt, lambda i: F.cross_entropy(model(x), y), 40, lambda: F.cross_entropy(model(tx), ty))


def adamax() -> zoo.Setup:
    """`torch.optim.Adamax` (lr 2e-3: Adam with the infinity norm). Healthy: cross-entropy falls (train,
    held-out)."""
    return _optimizer_on_mlp(lambda ps: torch.optim.Adamax(ps, lr=2e-3))


def radam_decoupled() -> zoo.Setup:
    """`torch.optim.RAdam` (lr 1e-3, decoupled weight decay 0.01): its first 5 steps are un-normalised SGD
    with momentum (the variance is not yet trusted), the rest Adam-like. Healthy: cross-entropy falls (train,
    held-out)."""
    return _optimizer_on_mlp(lambda ps: torch.optim.RAdam(ps, lr=1e-3, weight_decay=0.01, decoupled_weight_decay=True))


def lbfgs_closure() -> zoo.Setup:
    """`torch.optim.LBFGS` (lr 0.5, up to 4 evaluations a step, strong-Wolfe line search) with a closure that
    zeroes the gradients, recomputes the loss and backwards it: gradients exist only inside `step`. Batches of
    256. Healthy: cross-entropy falls (train, held-out)."""
    model = _mlp()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4, history_size=10, line_search_fn="strong_wolfe")
    batch, (tx, ty) = _clusters()

    def step(i: int) -> float:
        model.train()
        x, y = batch(256)

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            return loss

        return float(opt.step(closure).detach())  # type: ignore[union-attr, arg-type]

    test = zoo._evaluator(model, lambda: F.cross_entropy(model(tx), ty))
    return zoo.Setup(model, 60, test, step, [(model, opt)])


# --- peft methods other than LoRA ---------------------------------------------------------------------------------
def _lm_batch(g: torch.Generator, n: int) -> Batch:
    return {"input_ids": (ids := zoo.counting(g, n, 16, 64)[0]), "labels": ids}


def _by_three(g: torch.Generator, n: int) -> Batch:
    """The adapters' new task: streams that count up by 3 (the base learned steps of 1 and 2)."""
    ids = (torch.randint(0, 64, (n, 1), generator=g) + 3 * torch.arange(16)) % 64
    return {"input_ids": ids, "labels": ids}


@functools.cache
def _pretrained() -> dict[str, torch.Tensor]:
    """A tiny Llama (2 layers, d 32) trained 100 steps (AdamW 3e-3) on the counting streams, its own seed and
    stream: the base the adapters fine-tune further (an adapter on a random base barely learns; zoo.py's IA3
    note). Cached: built once per process, each family loads a copy."""
    with torch.random.fork_rng():  # the caller's global seed stream as if this never ran (cached or not)
        torch.manual_seed(100)
        model = _llama()
        gen = torch.Generator().manual_seed(101)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        step = zoo.hf_step(model, opt, lambda i: _lm_batch(gen, 8))
        for i in range(100):
            step(i)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=48,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


def _base() -> nn.Module:
    model = _llama()
    model.load_state_dict(_pretrained())
    return model


def _peft(config: Any, steps: int = 100, lr: float = 1e-2) -> zoo.Setup:
    """The pretrained base wrapped by `peft.get_peft_model(base, config)` and fine-tuned on a new task, streams
    counting by 3 (`_by_three`; AdamW `lr` over the adapter's trainable tensors, zoo's hand-written HF loop);
    the `GradLogger` watches the PeftModel, as a user passes it."""
    from peft import get_peft_model

    model = get_peft_model(_base(), config)
    gen = torch.Generator().manual_seed(1)
    test = zoo.held_out(lambda g: _by_three(g, 32))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    step = zoo.hf_step(model, opt, lambda i: _by_three(gen, 8))
    return zoo.Setup(model, steps, zoo.eval_loss(model, test), step, [(model, opt)])


_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def peft_dora() -> zoo.Setup:
    """peft DoRA (`LoraConfig(use_dora=True)`, r 4 on every linear): each weight split into a magnitude vector
    (`lora_magnitude_vector`, trainable) and a LoRA-updated direction. Healthy: LM loss (train, held-out)
    falls."""
    from peft import LoraConfig

    return _peft(LoraConfig(r=4, lora_alpha=8, target_modules=_LINEAR, use_dora=True, task_type="CAUSAL_LM"))


def peft_adalora() -> zoo.Setup:
    """peft AdaLoRA (init rank 6, target rank 2 on q/v/up/down: SVD-form P diag(E) Q; `update_and_allocate`
    after every optimizer step, before `zero_grad`, as peft's docs show; the budget falls from step 60 to 110
    and ranks are pruned every 10 steps by zeroing E's entries in place, outside the optimizer, then held at
    zero to the end). Healthy: LM loss (train, held-out) falls; every trainable tensor changes except the
    `lora_E` of a module whose every rank was pruned (zero-initialised, zero again at the end: by design,
    `UNCHANGED_BY_DESIGN`)."""
    from peft import AdaLoraConfig, get_peft_model

    steps = 150
    cfg = AdaLoraConfig(
        init_r=6, target_r=2, tinit=60, tfinal=40, deltaT=10, total_step=steps,
        target_modules=["q_proj", "v_proj", "up_proj", "down_proj"], task_type="CAUSAL_LM",
    )  # fmt: skip
    model = get_peft_model(_base(), cfg)
    gen = torch.Generator().manual_seed(1)
    test = zoo.held_out(lambda g: _by_three(g, 32))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)

    def step(i: int) -> float:
        model.train()
        loss = model(**_by_three(gen, 8)).loss
        loss.backward()
        opt.step()
        model.base_model.update_and_allocate(i)
        opt.zero_grad()
        return float(loss.detach())

    return zoo.Setup(model, steps, zoo.eval_loss(model, test), step, [(model, opt)])


def peft_vera() -> zoo.Setup:
    """peft VeRA (r 16 on every linear): one pair of frozen random matrices shared by all layers (buffers), only
    the per-layer scaling vectors `vera_lambda_d` and `vera_lambda_b` train (lambda_b starts at 0). Healthy:
    LM loss (train, held-out) falls."""
    from peft import VeraConfig

    return _peft(VeraConfig(r=16, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"]), lr=2e-2)


def peft_loha() -> zoo.Setup:
    """peft LoHa (r 4 on every linear: the update is the Hadamard product of two low-rank products, w1b/w2b
    zero-free, one factor initialised to 0). Healthy: LM loss (train, held-out) falls."""
    from peft import LoHaConfig

    return _peft(LoHaConfig(r=4, alpha=8, target_modules=_LINEAR))


def peft_lokr() -> zoo.Setup:
    """peft LoKr (r 4 on every linear: the update is a Kronecker product of a small full factor and a low-rank
    one). Healthy: LM loss (train, held-out) falls."""
    from peft import LoKrConfig

    return _peft(LoKrConfig(r=4, alpha=8, target_modules=_LINEAR))


def peft_oft() -> zoo.Setup:
    """peft OFT (blocks of 8 on every linear: each weight multiplied by a learned block-diagonal orthogonal
    matrix, the Cayley transform of a skew-symmetric `oft_R` that starts at 0). Healthy: LM loss (train,
    held-out) falls."""
    from peft import OFTConfig

    return _peft(OFTConfig(r=0, oft_block_size=8, target_modules=_LINEAR))


def peft_ia3() -> zoo.Setup:
    """peft IA3 (learned rescaling vectors on k, v and the MLP's down projection's input, starting at 1) on the
    pretrained base, lr 3e-2. Healthy: LM loss (train, held-out) falls."""
    from peft import IA3Config

    cfg = IA3Config(target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"])
    return _peft(cfg, lr=3e-2)


def peft_prompt_tuning() -> zoo.Setup:
    """peft prompt tuning (8 virtual tokens, randomly initialised, prepended to every input; the base entirely
    frozen, the only trainable tensor the prompt embedding), lr 3e-2. Healthy: LM loss (train, held-out)
    falls."""
    from peft import PromptTuningConfig

    return _peft(PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=8), lr=3e-2)


def peft_prefix_tuning() -> zoo.Setup:
    """peft prefix tuning (8 virtual key/value pairs per layer through a reparametrising MLP,
    `prefix_projection=True`: the prefix embedding and the MLP train, the base is frozen), lr 1e-2. Healthy:
    LM loss (train, held-out) falls."""
    from peft import PrefixTuningConfig

    cfg = PrefixTuningConfig(
        task_type="CAUSAL_LM", num_virtual_tokens=8, prefix_projection=True, encoder_hidden_size=32
    )
    return _peft(cfg)


def peft_p_tuning() -> zoo.Setup:
    """peft P-tuning (`PromptEncoderConfig`: 8 virtual tokens produced by an MLP prompt encoder from their
    embeddings), lr 1e-2. Healthy: LM loss (train, held-out) falls."""
    from peft import PromptEncoderConfig

    return _peft(PromptEncoderConfig(task_type="CAUSAL_LM", num_virtual_tokens=8, encoder_hidden_size=32))


# --- training styles -----------------------------------------------------------------------------------------
def distillation() -> zoo.Setup:
    """Knowledge distillation (Hinton et al.): a wide teacher MLP trained first (200 steps, outside the run),
    then frozen (`requires_grad_(False)`, eval mode) inside the module the logger watches; a narrow student
    (16-32-4) learns from temperature-2 soft targets (KL x T^2) plus the labels' cross-entropy, Adam 3e-3.
    Healthy: the student's cross-entropy falls (train, held-out)."""
    batch, (tx, ty) = _clusters()
    teacher = _mlp()
    topt = torch.optim.Adam(teacher.parameters(), lr=3e-3)
    tgen = torch.Generator().manual_seed(2)
    _, data = zoo._mlp_classifier_data()
    for _ in range(200):
        x, y = data(tgen, 64)
        F.cross_entropy(teacher(x), y).backward()
        topt.step()
        topt.zero_grad()
    model = nn.ModuleDict({"teacher": teacher.requires_grad_(False).eval(), "student": nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))})  # fmt: skip
    student = model["student"]
    opt = torch.optim.Adam(student.parameters(), lr=3e-3)
    temp = 2.0

    def step(i: int) -> float:
        student.train()
        x, y = batch(32)
        with torch.no_grad():
            soft = F.softmax(model["teacher"](x) / temp, -1)
        logits = student(x)
        ce = F.cross_entropy(logits, y)
        kd = F.kl_div(F.log_softmax(logits / temp, -1), soft, reduction="batchmean") * temp**2
        (0.5 * ce + 0.5 * kd).backward()
        opt.step()
        opt.zero_grad()
        return float(ce.detach())

    test = zoo._evaluator(student, lambda: F.cross_entropy(student(tx), ty))
    return zoo.Setup(model, 150, test, step, [(model, opt)])


def _sequence_logp(model: nn.Module, ids: torch.Tensor, start: int) -> torch.Tensor:
    """The summed log-probability `model` gives each row's tokens from position `start` on."""
    logits = model(input_ids=ids).logits[:, start - 1 : -1]
    return torch.gather(F.log_softmax(logits, -1), 2, ids[:, start:, None]).squeeze(2).sum(1)


def dpo() -> zoo.Setup:
    """Direct preference optimisation (Rafailov et al. 2023) of the pretrained tiny Llama against a frozen copy
    of itself (the reference, `requires_grad_(False)`, outside the watched policy): prompts are 8 ids of a
    counting stream, the chosen completion its next 8, the rejected one 8 ids counting down; loss
    -log sigmoid(beta (policy - reference log-ratio margin)), beta 0.1, AdamW 1e-3. Healthy: the DPO loss falls
    (train, held-out pairs)."""
    policy = _base()
    reference = copy.deepcopy(policy).requires_grad_(False).eval()
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)

    def pairs(g: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids, _ = zoo.counting(g, n, 16, 64)
        down = (ids[:, 7:8] - (1 + torch.arange(8))) % 64
        return ids, torch.cat([ids[:, :8], down], 1)

    def loss_of(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            ref = _sequence_logp(reference, chosen, 8) - _sequence_logp(reference, rejected, 8)
        margin = _sequence_logp(policy, chosen, 8) - _sequence_logp(policy, rejected, 8)
        return -F.logsigmoid(0.1 * (margin - ref)).mean()

    test = zoo.held_out(lambda g: pairs(g, 64))

    def step(i: int) -> float:
        policy.train()
        loss = loss_of(*pairs(gen, 16))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return float(loss.detach())

    return zoo.Setup(policy, 60, zoo._evaluator(policy, lambda: loss_of(*test)), step, [(policy, opt)])


class MoCo(nn.Module):
    """MoCo v2 (He et al. 2020; Chen et al. 2020) on vectors: a query encoder trained by the optimizer, a key
    encoder that follows it by momentum (k = m k + (1 - m) q after each step, under `no_grad`, never in the
    optimizer; left `requires_grad=True`, as many re-implementations leave it), a queue of past keys as the
    negatives of an InfoNCE loss (temperature 0.2)."""

    def __init__(self, dim: int = 16, out: int = 32, queue: int = 256, m: float = 0.99) -> None:
        super().__init__()
        self.query = nn.Sequential(nn.Linear(dim, 64), nn.ReLU(), nn.Linear(64, out))
        self.key = copy.deepcopy(self.query)
        self.m = m
        start = torch.randn(queue, out, generator=torch.Generator().manual_seed(3))
        self.register_buffer("queue", F.normalize(start, dim=1))
        self.pointer = 0

    def loss(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """InfoNCE of the queries of `a` against the keys of `b` (positives) and the queue, and those keys."""
        q = F.normalize(self.query(a), dim=1)
        with torch.no_grad():
            k = F.normalize(self.key(b), dim=1)
        logits = torch.cat([(q * k).sum(1, keepdim=True), q @ self.queue.T], 1) / 0.2
        return F.cross_entropy(logits, torch.zeros(len(a), dtype=torch.long)), k

    @torch.no_grad()
    def enqueue(self, k: torch.Tensor) -> None:
        """The newest keys replace the oldest (after backward: the loss read the queue)."""
        self.queue[self.pointer : self.pointer + len(k)] = k
        self.pointer = (self.pointer + len(k)) % len(self.queue)

    @torch.no_grad()
    def momentum_update(self) -> None:
        for k, q in zip(self.key.parameters(), self.query.parameters()):
            k.mul_(self.m).add_(q.detach(), alpha=1 - self.m)


def moco() -> zoo.Setup:
    """MoCo on 16-d points of 8 clusters, two views by noise (0.1) and random feature scaling (0.9-1.1), SGD
    momentum 0.9 (lr 0.05, weight decay 1e-4) on the query encoder only, the key encoder by momentum after each
    step; the logger watches the whole module. Healthy: InfoNCE falls (train against the queue; held-out with each
    point's other view among the 256, eval mode); the key encoder changes by momentum alone."""
    centres = 2 * torch.randn(8, 16, generator=torch.Generator().manual_seed(7))
    model = MoCo()
    gen = torch.Generator().manual_seed(1)

    def views(g: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, _ = zoo._clusters(g, centres, n, 0.5)

        def view() -> torch.Tensor:
            return x * (0.9 + 0.2 * torch.rand(n, 16, generator=g)) + 0.1 * torch.randn(n, 16, generator=g)

        return view(), view()

    a, b = zoo.held_out(lambda g: views(g, 256))
    opt = torch.optim.SGD(model.query.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)

    def held_out() -> torch.Tensor:  # InfoNCE within the held-out set: each point's other view among all 256
        q, k = F.normalize(model.query(a), dim=1), F.normalize(model.key(b), dim=1)
        return F.cross_entropy(q @ k.T / 0.2, torch.arange(len(a)))

    def step(i: int) -> float:
        model.train()
        loss, keys = model.loss(*views(gen, 64))
        loss.backward()
        opt.step()
        opt.zero_grad()
        model.momentum_update()
        model.enqueue(keys)
        return float(loss.detach())

    return zoo.Setup(model, 200, zoo._evaluator(model, held_out), step, [(model, opt)])


def lr_groups_1000x() -> zoo.Setup:
    """One AdamW with parameter groups whose learning rates differ 1000x: the first layer at 3e-6 (a
    pretrained feature extractor barely nudged), the rest at 3e-3. Healthy: cross-entropy falls (train,
    held-out); the first layer's weights change, by little."""
    model = _mlp()
    groups = [{"params": model[0].parameters(), "lr": 3e-6}, {"params": [*model[2:].parameters()], "lr": 3e-3}]
    return zoo._fit_clusters(model, torch.optim.AdamW(groups), 150)


def grad_noise_centralized() -> zoo.Setup:
    """Gradient hooks (`Tensor.register_hook`) on every weight: gradient centralisation (Yong et al. 2020: each
    output row's gradient has its mean over the inputs removed) on the 2-D weights, then annealed Gaussian
    gradient noise (Neelakantan et al. 2015: variance 0.01 / (1 + t)^0.55) on every tensor; SGD momentum 0.9,
    lr 0.05. Healthy: cross-entropy falls (train, held-out)."""
    model = _mlp()
    noise = torch.Generator().manual_seed(5)
    count = [0]

    def hook(p: nn.Parameter) -> Callable[[torch.Tensor], torch.Tensor]:
        def edit(g: torch.Tensor) -> torch.Tensor:
            if g.dim() > 1:
                g = g - g.mean(dim=tuple(range(1, g.dim())), keepdim=True)
            std = math.sqrt(0.01 / (1 + count[0]) ** 0.55)
            return g + std * torch.randn(g.shape, generator=noise)

        return edit

    for p in model.parameters():
        p.register_hook(hook(p))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    setup = zoo._fit_clusters(model, opt, 150)
    inner = setup.step
    assert inner is not None

    def step(i: int) -> float:
        count[0] = i
        return inner(i)

    setup.step = step
    return setup


#: per family, the trainable tensors that end where they started by design (the health check leaves them out)
UNCHANGED_BY_DESIGN: dict[str, Callable[[str], bool]] = {"peft_adalora": lambda name: ".lora_E." in name}

#: every run asserted OK, cheapest first: the first `FAST` run in the default test run, the rest are heavy
FAMILIES: list[Callable[[], zoo.Setup]] = [
    adadelta,
    asgd,
    adamax,
    radam_decoupled,
    lookahead,
    sam,
    schedule_free,
    lbfgs_closure,
    rprop,
    lr_groups_1000x,
    grad_noise_centralized,
    distillation,
    moco,
    muon_adamw,
    peft_prefix_tuning,
    peft_ia3,
    peft_oft,
    peft_lokr,
    peft_vera,
    peft_dora,
    peft_loha,
    peft_adalora,
    dpo,
]
FAST = 12
#: measured and documented, not asserted OK
MEASURED: list[Callable[[], zoo.Setup]] = [lamb, peft_prompt_tuning, peft_p_tuning]

if __name__ == "__main__":
    import sys

    zoo.FAMILIES[:] = FAMILIES + MEASURED
    zoo.main(sys.argv[1:])
