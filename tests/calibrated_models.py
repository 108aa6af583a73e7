"""Tiny real models built from their libraries' configs, trained the way each library's docs show, for the
calibrated-alert tests (tests/test_calibrated.py). No downloads: configs only, data made here.

Each builder returns a `Trainee`: the model, its optimizer, and `step(i) -> loss` that runs forward and
backward (the caller steps the optimizer, so gradlog sees every step exactly as in a user's loop).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass
class Trainee:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss: Callable[[int], torch.Tensor]


def _tokens(gen: torch.Generator, batch: int, length: int, vocab: int, used: int) -> torch.Tensor:
    """Learnable token streams: each row counts up from a random start, modulo `used` (ids >= used never occur)."""
    start = torch.randint(0, used, (batch, 1), generator=gen)
    step = torch.randint(1, 3, (batch, 1), generator=gen)
    return (start + step * torch.arange(length)) % used


def gpt2(lr: float = 1e-3, planted: float | None = None, block: int = 1) -> Trainee:
    """GPT-2 with labels=input_ids at full block size (the documented causal-LM recipe), AdamW.
    `planted`: block `block` trains at this multiple of lr (its own param group)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=4, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0)
    cfg.attn_pdrop = 0.0
    model = GPT2LMHeadModel(cfg)
    if planted is None:
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
    else:
        odd = {id(p) for p in model.transformer.h[block].parameters()}
        rest = [p for p in model.parameters() if id(p) not in odd]
        opt = torch.optim.AdamW(
            [{"params": rest}, {"params": list(model.transformer.h[block].parameters()), "lr": lr * planted}], lr=lr
        )
    gen = torch.Generator().manual_seed(1)

    def loss(i: int) -> torch.Tensor:
        ids = _tokens(gen, 8, cfg.n_positions, cfg.vocab_size, 100)
        out: Any = model(input_ids=ids, labels=ids)
        return out.loss  # type: ignore[no-any-return]

    return Trainee(model, opt, loss)


def mixtral(lr: float = 1e-3) -> Trainee:
    """A tiny Mixtral (untied embeddings, 4 experts, top-2), labels=input_ids, AdamW."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    model = MixtralForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(1)

    def loss(i: int) -> torch.Tensor:
        ids = _tokens(gen, 8, 32, cfg.vocab_size, 100)
        out: Any = model(input_ids=ids, labels=ids)
        return out.loss  # type: ignore[no-any-return]

    return Trainee(model, opt, loss)


def _images(gen: torch.Generator, n: int, size: int, classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Noisy images of one fixed pattern per class: learnable in a few dozen steps."""
    patterns = torch.randn(classes, 3, size, size, generator=torch.Generator().manual_seed(7))
    y = torch.randint(0, classes, (n,), generator=gen)
    x = patterns[y] + 0.5 * torch.randn(n, 3, size, size, generator=gen)
    return x, y


def vit(lr: float = 1e-3) -> Trainee:
    """A ViT classifier (transformers.ViTForImageClassification), AdamW."""
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    cfg = ViTConfig(
        image_size=32,
        patch_size=8,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        num_labels=8,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = ViTForImageClassification(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(1)

    def loss(i: int) -> torch.Tensor:
        x, y = _images(gen, 16, 32, 8)
        out: Any = model(pixel_values=x, labels=y)
        return out.loss  # type: ignore[no-any-return]

    return Trainee(model, opt, loss)


def resnet(lr: float = 0.1) -> Trainee:
    """A ResNet (transformers.ResNetForImageClassification) with SGD, momentum 0.9 (torchvision's recipe)."""
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    cfg = ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=8, layer_type="basic")
    model = ResNetForImageClassification(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    gen = torch.Generator().manual_seed(1)

    def loss(i: int) -> torch.Tensor:
        x, y = _images(gen, 16, 32, 8)
        out: Any = model(pixel_values=x, labels=y)
        return out.loss  # type: ignore[no-any-return]

    return Trainee(model, opt, loss)


def lora(lr: float = 1e-3) -> Trainee:
    """peft LoRA on GPT-2 (attention and MLP projections), AdamW over the trainable parameters (peft's loop)."""
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0)
    base = GPT2LMHeadModel(cfg)
    model = get_peft_model(
        base, LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True)
    )
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    gen = torch.Generator().manual_seed(1)

    def loss(i: int) -> torch.Tensor:
        ids = _tokens(gen, 8, 32, cfg.vocab_size, 100)
        out: Any = model(input_ids=ids, labels=ids)
        return out.loss  # type: ignore[no-any-return]

    return Trainee(model, opt, loss)


def markov_text(n: int, vocab: int, seed: int = 1337) -> torch.Tensor:
    """A token stream with structure to learn: a Markov chain whose rows draw Zipf ranks (p ~ 1/rank^1.1)
    over a per-row shuffled vocabulary. Slow to learn, so attention comes to matter only after ~100 steps."""
    gen = torch.Generator().manual_seed(seed)
    p = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64) ** 1.1
    rows = torch.stack([torch.randperm(vocab, generator=gen) for _ in range(vocab)]).tolist()
    draws = torch.multinomial(p / p.sum(), n, replacement=True, generator=gen).tolist()
    out, cur = [], 0
    for d in draws:
        cur = rows[cur][d]
        out.append(cur)
    return torch.tensor(out)


def llama_lora(total_steps: int = 1500) -> Trainee:
    """peft LoRA (r=8 on q/k/v/o) on a tiny LlamaForCausalLM, AdamW with warmup + cosine over `total_steps`
    (transformers' schedule, stepped inside `loss` after the first call), labels=input_ids. Its q/k LoRA
    gradients rise ~20x around step 100-150 and stay there: attention starting to matter."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM, get_cosine_schedule_with_warmup

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=65,
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    lora_cfg = LoraConfig(r=8, lora_alpha=16, target_modules=targets, lora_dropout=0.05)
    model = get_peft_model(LlamaForCausalLM(cfg), lora_cfg)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.01)
    sched = get_cosine_schedule_with_warmup(opt, 20, total_steps)
    data = markov_text(60000, cfg.vocab_size)
    gen = torch.Generator().manual_seed(1)

    def loss(i: int) -> torch.Tensor:
        if i > 0:
            sched.step()  # after the previous optimizer step, as a loop calls it
        starts = torch.randint(0, len(data) - 64, (8,), generator=gen).tolist()
        ids = torch.stack([data[s : s + 64] for s in starts])
        out: Any = model(input_ids=ids, labels=ids)
        return out.loss  # type: ignore[no-any-return]

    return Trainee(model, opt, loss)


BUILDERS: dict[str, Callable[[], Trainee]] = {
    "gpt2": gpt2,
    "mixtral": mixtral,
    "vit": vit,
    "resnet": resnet,
    "lora": lora,
}
