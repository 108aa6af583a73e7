"""The calibration zoo (issue 38): model families no other test of this project trains, each built from a tiny
config, trained the way its library documents, and verified healthy without gradlog before gradlog is judged.

A family is a function that builds a `Setup`: the model (whose trainable tensors the health check copies), the
number of steps, a held-out evaluation on fixed data (lower is better), and either `step(i)` (one complete
training step of a hand-written loop: forward, backward, every optimizer's step, zero_grad; it returns the
step's training metric) with the (module, optimizer) pairs a user would hand to `gradlog.GradLogger` (one per
optimizer), or `fit(gradlog_kwargs)` for a family trained by `transformers.Trainer` with `GradlogCallback`.
`run(family, every)` trains it under gradlog and returns an `Outcome`: the verdict's reports and the
independent evidence (training metric and held-out evaluation before/after, tensors that never changed).

Healthy means, measured without gradlog: the training metric (mean of the first 10 steps vs the last 10) and
the held-out evaluation (before vs after training) both fall by at least `DROP` (15%), and every tensor that
was trainable when training began ends different from its starting copy. Everything is seeded (torch's global
seed before the model is built, one generator per data stream), so a run is the same run every time.

Data is synthetic with learnable structure (nothing is downloaded): token streams that count up by a step of 1
or 2 (`counting`), images made of a class template plus noise (`templates`), tones whose frequency is the class
(audio), clustered vectors.
"""

from __future__ import annotations

import copy
import math
import random
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import gradlog
from gradlog.verdict.policy import Policy
from gradlog.verdict.records import FINDINGS

#: the least relative fall of the training metric and of the held-out evaluation a healthy run shows
DROP = 0.15

Batch = dict[str, torch.Tensor]


@dataclass
class Setup:
    """One family, built and seeded, ready to train (see the module docstring)."""

    model: nn.Module
    steps: int
    evaluate: Callable[[], float]
    step: Callable[[int], float] | None = None
    watch: list[tuple[nn.Module, torch.optim.Optimizer]] = field(default_factory=list)
    fit: Callable[[dict[str, Any]], tuple[list[gradlog.Report], list[float]]] | None = None


@dataclass
class Outcome:
    """A family's run: gradlog's reports (one per logger) and the evidence of health gathered without gradlog."""

    family: str
    every: int | None
    steps: int
    losses: list[float]
    eval_before: float
    eval_after: float
    unchanged: list[str]
    trainable: int
    reports: list[gradlog.Report]
    writers: list[gradlog.MemoryWriter]  # each logger's series, to look a finding up

    @property
    def train_drop(self) -> float:
        first, last = self.losses[:10], self.losses[-10:]
        return 1 - (sum(last) / len(last)) / (sum(first) / len(first))

    @property
    def eval_drop(self) -> float:
        return 1 - self.eval_after / self.eval_before

    @property
    def healthy(self) -> bool:
        return self.train_drop >= DROP and self.eval_drop >= DROP and not self.unchanged

    def evidence(self) -> str:
        """The health numbers as the docs table shows them."""
        first = sum(self.losses[:10]) / 10
        last = sum(self.losses[-10:]) / 10
        return (
            f"train {first:.3g}->{last:.3g} (-{self.train_drop:.0%}), held-out {self.eval_before:.3g}->"
            f"{self.eval_after:.3g} (-{self.eval_drop:.0%}), {self.trainable - len(self.unchanged)}/{self.trainable} "
            "tensors changed"
        )


def findings(report: gradlog.Report) -> list[tuple[str, str, str, str]]:
    """Every finding of `report` as (severity, kind, tensor, detail), the detail being the record's own words:
    every registered kind of record with the kind the verdict judges it by (`Record.judged_kinds`: dead units
    weigh by their share of the layer, a bf16 tensor's rounding by its course), then the counted alerts."""
    policy = report.policy or Policy()
    out = []
    for table in FINDINGS:
        for r, kind in zip(report.records(table), table.judged_kinds(report)):
            if kind is not None and r.weighed(report):
                out.append((policy.severity(kind, r.policy_names()), kind, str(getattr(r, "name", "")), r.detail))
    for a in report.warning_alerts():
        detail = f"step {a.step}: {a.detail}"
        out.append((policy.severity(f"alert.{a.kind}", a.name), f"alert.{a.kind}", a.name, detail))
    return out


def seed(value: int = 0) -> None:
    random.seed(value)
    torch.manual_seed(value)


def run(family: Callable[[], Setup], every: int | None) -> Outcome:
    """Build `family`, evaluate it, train it under gradlog (`every` None: gradlog's default), evaluate again."""
    seed(0)
    s = family()
    model = s.model
    initial = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    before = s.evaluate()
    writers = [gradlog.MemoryWriter() for _ in s.watch or [None]]
    kwargs: dict[str, Any] = {"print_report": False}
    if every is not None:
        kwargs["every"] = every
    if s.fit is not None:
        reports, losses = s.fit({**kwargs, "writer": writers[0]})
    else:
        assert s.step is not None
        loggers = [gradlog.GradLogger(m, opt, writer=w, **kwargs) for (m, opt), w in zip(s.watch, writers)]
        losses = []
        for i in range(s.steps):
            losses.append(s.step(i))
            for gl in loggers:
                gl.log(i)
        reports = [gl.close() for gl in loggers]
    after = s.evaluate()
    unchanged = [n for n, p in model.named_parameters() if n in initial and torch.equal(p.detach(), initial[n])]
    return Outcome(family.__name__, every, s.steps, losses, before, after, unchanged, len(initial), reports, writers)


# --- data -------------------------------------------------------------------------------------------------
def counting(gen: torch.Generator, batch: int, length: int, vocab: int, first: int = 0) -> tuple[torch.Tensor, ...]:
    """Token streams that count up from a random start by a step of 1 or 2, modulo the ids first..vocab-1:
    (ids, step - 1), the second a label for sequence classification."""
    used = vocab - first
    start = torch.randint(0, used, (batch, 1), generator=gen)
    step = torch.randint(1, 3, (batch, 1), generator=gen)
    return first + (start + step * torch.arange(length)) % used, step.squeeze(1) - 1


def first_half(ids: torch.Tensor, first: int, vocab: int) -> torch.Tensor:
    """A sequence label: whether the first id is in the lower half of first..vocab-1."""
    return (ids[:, 0] < (first + vocab) // 2).long()


def masked(gen: torch.Generator, ids: torch.Tensor, mask_id: int, first: int, vocab: int) -> tuple[torch.Tensor, ...]:
    """BERT's masking, as `DataCollatorForLanguageModeling` does it: 15% of positions are chosen (the labels
    elsewhere are -100); of those 80% become the mask id, 10% a random id, 10% stay."""
    labels = ids.clone()
    chosen = torch.rand(ids.shape, generator=gen) < 0.15
    labels[~chosen] = -100
    r = torch.rand(ids.shape, generator=gen)
    inputs = ids.clone()
    inputs[chosen & (r < 0.8)] = mask_id
    swap = chosen & (r >= 0.8) & (r < 0.9)
    inputs[swap] = torch.randint(first, vocab, ids.shape, generator=gen)[swap]
    return inputs, labels


def templates(classes: int, channels: int, size: int, seed_: int = 7) -> torch.Tensor:
    """One smooth image per class (random noise blurred by an average pool), unit scale."""
    gen = torch.Generator().manual_seed(seed_)
    raw = torch.randn(classes, channels, size, size, generator=gen)
    smooth = F.avg_pool2d(F.pad(raw, (1, 1, 1, 1), mode="circular"), 3, stride=1)
    return smooth / smooth.std()


def images(gen: torch.Generator, tmpl: torch.Tensor, batch: int, noise: float = 1.0) -> tuple[torch.Tensor, ...]:
    """A batch of class templates plus Gaussian noise: (pixels, labels)."""
    y = torch.randint(0, tmpl.shape[0], (batch,), generator=gen)
    return tmpl[y] + noise * torch.randn(batch, *tmpl.shape[1:], generator=gen), y


def held_out(make: Callable[[torch.Generator], Any], seed_: int = 12345) -> Any:
    """A fixed evaluation batch drawn by `make` from a generator of its own (never the training stream's)."""
    return make(torch.Generator().manual_seed(seed_))


def eval_loss(model: nn.Module, batch: Batch) -> Callable[[], float]:
    """The held-out evaluation of a Hugging Face model: its `.loss` on a fixed batch, in eval mode."""

    def evaluate() -> float:
        was = model.training
        model.eval()
        with torch.no_grad():
            value = float(model(**batch).loss)
        model.train(was)
        return value

    return evaluate


def hf_step(
    model: nn.Module, opt: torch.optim.Optimizer, batch: Callable[[int], Batch], clip: float = 1.0
) -> Callable[[int], float]:
    """The loop the transformers docs show without Trainer: loss = model(**batch).loss, backward, clip, step."""
    model.train()

    def step(i: int) -> float:
        loss = model(**batch(i)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        return float(loss.detach())

    return step


def trainer_fit(model: nn.Module, data: list[Batch], steps: int, lr: float, **args: Any) -> Callable[..., Any]:
    """`fit` for a family trained by `transformers.Trainer` (its defaults: AdamW, linear decay, clip at 1.0),
    with `GradlogCallback(**gradlog_kwargs)`: returns the callback's report and the logged training losses."""
    import catalogue
    import transformers

    from gradlog.integrations.huggingface import GradlogCallback

    def fit(kwargs: dict[str, Any]) -> tuple[list[gradlog.Report], list[float]]:
        callback = GradlogCallback(**kwargs)
        with tempfile.TemporaryDirectory() as out:
            targs = catalogue.hf_args(
                out, max_steps=steps, learning_rate=lr, per_device_train_batch_size=8, logging_steps=1, seed=0, **args
            )
            trainer = transformers.Trainer(model=model, args=targs, train_dataset=data, callbacks=[callback])
            trainer.train()
        losses = [float(h["loss"]) for h in trainer.state.log_history if "loss" in h]
        assert callback.run.report is not None
        return [callback.run.report], losses

    return fit


def rows(batches: list[Batch]) -> list[Batch]:
    """Batches split into examples, the form a `Trainer`'s dataset hands its collator."""
    return [{k: v[j] for k, v in b.items()} for b in batches for j in range(len(next(iter(b.values()))))]


# --- transformers: causal LMs (labels=input_ids) ------------------------------------------------------------
def _causal_lm(model: nn.Module, vocab: int, steps: int, lr: float = 1e-3, length: int = 16) -> Setup:
    gen = torch.Generator().manual_seed(1)

    def batch(i: int) -> Batch:
        ids, _ = counting(gen, 8, length, vocab)
        return {"input_ids": ids, "labels": ids}

    test = held_out(lambda g: {"input_ids": (ids := counting(g, 32, length, vocab)[0]), "labels": ids})
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    return Setup(model, steps, eval_loss(model, test), hf_step(model, opt, batch), [(model, opt)])


def gpt2() -> Setup:
    """GPT-2 (4 layers, d=32), causal LM with labels=input_ids on counting streams, AdamW 1e-3 in a hand-written
    loop with gradient clipping at 1.0. Healthy: the LM loss on streams and on a fixed held-out set falls."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=4, n_head=4)
    return _causal_lm(GPT2LMHeadModel(cfg), 64, 150)


def llama_trainer() -> Setup:
    """Llama (2 layers, d=32, grouped-query attention, RoPE, SwiGLU) as a causal LM with labels=input_ids,
    trained by `transformers.Trainer` (AdamW 2e-3, linear decay, clipping) with `GradlogCallback`.
    Healthy: the logged training loss and the held-out LM loss fall."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    model = LlamaForCausalLM(cfg)
    gen = torch.Generator().manual_seed(1)
    data = rows([{"input_ids": (ids := counting(gen, 8, 16, 64)[0]), "labels": ids} for _ in range(150)])
    test = held_out(lambda g: {"input_ids": (ids := counting(g, 32, 16, 64)[0]), "labels": ids})
    return Setup(model, 150, eval_loss(model, test), fit=trainer_fit(model, data, 150, 2e-3))


def mixtral() -> Setup:
    """Mixtral (2 layers, 4 experts, top-2 routing, untied embeddings), causal LM with labels=input_ids, AdamW
    1e-3, hand-written loop. Healthy: LM loss (train and held-out) falls; every expert's weights change."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    return _causal_lm(MixtralForCausalLM(cfg), 64, 150)


def qwen2_moe() -> Setup:
    """Qwen2-MoE (2 layers, 4 routed experts top-2 plus a gated shared expert, q/k/v biases), causal LM with
    labels=input_ids, AdamW 1e-3, hand-written loop. Healthy: LM loss (train and held-out) falls."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        decoder_sparse_step=1,
    )
    return _causal_lm(Qwen2MoeForCausalLM(cfg), 64, 150)


def mamba() -> Setup:
    """Mamba (2 layers, d=32, state 8; the pure-PyTorch selective scan on CPU), a state-space causal LM with
    labels=input_ids, AdamW 2e-3, hand-written loop. Healthy: LM loss (train and held-out) falls."""
    from transformers import MambaConfig, MambaForCausalLM

    cfg = MambaConfig(vocab_size=64, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, use_cache=False)
    return _causal_lm(MambaForCausalLM(cfg), 64, 150, lr=2e-3)


# --- transformers: masked LM, classification ----------------------------------------------------------------
MASK, FIRST = 1, 4  # the mask id; data ids are FIRST..vocab-1 (0..3 are special ids, as in every tokenizer)


def _mlm_batch(gen: torch.Generator, batch: int, vocab: int, length: int = 16) -> Batch:
    """Counting streams over 16 of the vocabulary's ids (a language smaller than its tokenizer), BERT-masked."""
    ids, _ = counting(gen, batch, length, FIRST + 16, FIRST)
    inputs, labels = masked(gen, ids, MASK, FIRST, FIRST + 16)
    return {"input_ids": inputs, "labels": labels}


def _mlm(model: nn.Module) -> Setup:
    """A masked LM over a 64-id vocabulary trained 200 steps by AdamW 1e-3 in the hand-written HF loop, batches
    of 16 (`_mlm_batch`), judged on a held-out 64."""
    gen = torch.Generator().manual_seed(1)
    test = held_out(lambda g: _mlm_batch(g, 64, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = hf_step(model, opt, lambda i: _mlm_batch(gen, 16, 64))
    return Setup(model, 200, eval_loss(model, test), step, [(model, opt)])


def bert_mlm() -> Setup:
    """BERT (2 layers, d=32) masked LM: 15% of positions chosen, 80/10/10 mask/random/keep, labels -100
    elsewhere (what `DataCollatorForLanguageModeling` does), AdamW 1e-3, hand-written loop.
    Healthy: masked-LM loss on training batches and on a fixed held-out set falls."""
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=16,
    )  # fmt: skip
    model = BertForMaskedLM(cfg)
    return _mlm(model)


def roberta_mlm_trainer() -> Setup:
    """RoBERTa (2 layers, d=32; positions start after the padding id) masked LM as BERT's, trained by
    `transformers.Trainer` (AdamW 1e-3) with `GradlogCallback`. Healthy: masked-LM loss falls (logged and held-out)."""
    from transformers import RobertaConfig, RobertaForMaskedLM

    cfg = RobertaConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=20, type_vocab_size=1,
    )  # fmt: skip
    model = RobertaForMaskedLM(cfg)
    gen = torch.Generator().manual_seed(1)
    data = rows([_mlm_batch(gen, 8, 64) for _ in range(200)])
    test = held_out(lambda g: _mlm_batch(g, 64, 64))
    return Setup(model, 200, eval_loss(model, test), fit=trainer_fit(model, data, 200, 1e-3))


def distilbert_cls_trainer() -> Setup:
    """DistilBERT (2 layers, d=32) sequence classification (is the first id in the lower half?), trained by
    `transformers.Trainer` (AdamW 1e-3) with `GradlogCallback`. Healthy: cross-entropy falls (logged and held-out)."""
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    cfg = DistilBertConfig(
        vocab_size=64, dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=16, num_labels=2
    )
    model = DistilBertForSequenceClassification(cfg)
    gen = torch.Generator().manual_seed(1)

    def batch(g: torch.Generator, n: int) -> Batch:
        ids, _ = counting(g, n, 16, 64, FIRST)
        return {"input_ids": ids, "labels": first_half(ids, FIRST, 64)}

    data = rows([batch(gen, 8) for _ in range(150)])
    test = held_out(lambda g: batch(g, 64))
    return Setup(model, 150, eval_loss(model, test), fit=trainer_fit(model, data, 150, 1e-3))


# --- transformers: encoder-decoder ---------------------------------------------------------------------------
def _seq2seq_batch(gen: torch.Generator, n: int, vocab: int) -> Batch:
    """Source: 12 ids of a counting stream; target: the stream's next 8 ids."""
    ids, _ = counting(gen, n, 20, vocab, FIRST)
    return {"input_ids": ids[:, :12].contiguous(), "labels": ids[:, 12:].contiguous()}


def _seq2seq(model: nn.Module, steps: int, lr: float = 1e-3) -> Setup:
    gen = torch.Generator().manual_seed(1)
    test = held_out(lambda g: _seq2seq_batch(g, 64, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    step = hf_step(model, opt, lambda i: _seq2seq_batch(gen, 8, 64))
    return Setup(model, steps, eval_loss(model, test), step, [(model, opt)])


def t5() -> Setup:
    """T5 (2+2 layers, d=32, relative position buckets) with labels (the model shifts them into decoder inputs),
    continuing a counting stream, AdamW 1e-3, hand-written loop. Healthy: seq2seq loss falls (train, held-out)."""
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    return _seq2seq(T5ForConditionalGeneration(cfg), 150)


def bart() -> Setup:
    """BART (1+1 layers, d=32, learned positions) with labels, continuing a counting stream, AdamW 1e-3,
    hand-written loop. Healthy: seq2seq loss falls (train, held-out)."""
    from transformers import BartConfig, BartForConditionalGeneration

    cfg = BartConfig(
        vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
    )  # fmt: skip
    return _seq2seq(BartForConditionalGeneration(cfg), 150)


# --- transformers: vision -------------------------------------------------------------------------------------
def _vision(model: nn.Module, steps: int, lr: float = 1e-3, size: int = 16, trainer: bool = False) -> Setup:
    tmpl = templates(4, 3, size)
    gen = torch.Generator().manual_seed(1)

    def batch(g: torch.Generator, n: int) -> Batch:
        x, y = images(g, tmpl, n)
        return {"pixel_values": x, "labels": y}

    test = held_out(lambda g: batch(g, 64))
    if trainer:
        data = rows([batch(gen, 8) for _ in range(steps)])
        return Setup(model, steps, eval_loss(model, test), fit=trainer_fit(model, data, steps, lr))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    return Setup(model, steps, eval_loss(model, test), hf_step(model, opt, lambda i: batch(gen, 16)), [(model, opt)])


def vit_trainer() -> Setup:
    """ViT (2 layers, d=32, 4x4 patches of 16x16 images) image classification of noisy class templates,
    trained by `transformers.Trainer` (AdamW 1e-3) with `GradlogCallback`. Healthy: cross-entropy falls."""
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(
        image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, num_labels=4,
    )  # fmt: skip
    return _vision(ViTForImageClassification(cfg), 120, trainer=True)


def convnext() -> Setup:
    """ConvNeXt (2 stages, depthwise 7x7 convs, LayerNorm, layer scale 1e-6 as configured by default) image
    classification, AdamW 1e-3, hand-written loop. Healthy: cross-entropy falls (train, held-out)."""
    from transformers import ConvNextConfig, ConvNextForImageClassification

    cfg = ConvNextConfig(num_channels=3, patch_size=2, hidden_sizes=[16, 32], depths=[1, 1], num_stages=2, num_labels=4)
    return _vision(ConvNextForImageClassification(cfg), 120)


def swin() -> Setup:
    """Swin (2 stages, window 4, relative position bias tables, shifted windows) image classification, AdamW
    1e-3, hand-written loop. Healthy: cross-entropy falls (train, held-out)."""
    from transformers import SwinConfig, SwinForImageClassification

    cfg = SwinConfig(
        image_size=16, patch_size=2, num_channels=3, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4,
        num_labels=4,
    )  # fmt: skip
    return _vision(SwinForImageClassification(cfg), 120)


def resnet_hf() -> Setup:
    """transformers' ResNet (basic blocks, BatchNorm everywhere) image classification, AdamW 1e-3, hand-written
    loop; evaluated in eval mode (BatchNorm's running statistics). Healthy: cross-entropy falls."""
    from transformers import ResNetConfig, ResNetForImageClassification

    cfg = ResNetConfig(
        num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", num_labels=4
    )
    return _vision(ResNetForImageClassification(cfg), 120, size=32)


# --- transformers: speech --------------------------------------------------------------------------------------
def wav2vec2_trainer() -> Setup:
    """Wav2Vec2 (conv feature encoder, 2 transformer layers, SpecAugment time masking) audio classification of
    noisy tones (the class is the frequency), the feature encoder frozen with `freeze_feature_encoder()` as the
    audio-classification example does, trained by `transformers.Trainer` (AdamW 1e-3) with `GradlogCallback`.
    Healthy: cross-entropy falls (logged and held-out)."""
    from transformers import Wav2Vec2Config, Wav2Vec2ForSequenceClassification

    cfg = Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, conv_dim=(16, 16, 16),
        conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2,
        num_labels=3, classifier_proj_size=16,
    )  # fmt: skip
    model = Wav2Vec2ForSequenceClassification(cfg)
    model.freeze_feature_encoder()
    t = torch.arange(1600) / 1600

    def batch(g: torch.Generator, n: int) -> Batch:
        y = torch.randint(0, 3, (n,), generator=g)
        phase = 2 * math.pi * torch.rand(n, 1, generator=g)
        wave = torch.sin(2 * math.pi * (40 + 60 * y[:, None]) * t + phase) + 0.5 * torch.randn(n, 1600, generator=g)
        return {"input_values": wave, "labels": y}

    gen = torch.Generator().manual_seed(1)
    data = rows([batch(gen, 8) for _ in range(120)])
    test = held_out(lambda g: batch(g, 48))
    return Setup(model, 120, eval_loss(model, test), fit=trainer_fit(model, data, 120, 1e-3))


def whisper_trainer() -> Setup:
    """Whisper (1+1 layers, d=32, 16 mel bins; the encoder's sinusoidal positions frozen by the model itself)
    speech recognition: 4 "words" per utterance, each 8 frames of its own mel pattern plus noise, labels the word
    ids and an end id; trained by `transformers.Trainer` (AdamW 2e-3) with `GradlogCallback`.
    Healthy: seq2seq loss falls (logged and held-out)."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    cfg = WhisperConfig(
        vocab_size=64, num_mel_bins=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, d_model=32, max_source_positions=16,
        max_target_positions=16, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
        suppress_tokens=None, begin_suppress_tokens=None,
    )  # fmt: skip
    model = WhisperForConditionalGeneration(cfg)
    words = torch.randn(8, 16, 8, generator=torch.Generator().manual_seed(7))

    def batch(g: torch.Generator, n: int) -> Batch:
        w = torch.randint(0, 8, (n, 4), generator=g)
        feats = torch.cat([words[w[:, k]] for k in range(4)], dim=2) + 0.5 * torch.randn(n, 16, 32, generator=g)
        labels = torch.cat([w + 3, torch.full((n, 1), 2)], dim=1)
        return {"input_features": feats, "labels": labels}

    gen = torch.Generator().manual_seed(1)
    data = rows([batch(gen, 8) for _ in range(150)])
    test = held_out(lambda g: batch(g, 48))
    return Setup(model, 150, eval_loss(model, test), fit=trainer_fit(model, data, 150, 2e-3))


# --- transformers: contrastive image-text ----------------------------------------------------------------------
def _image_text(model: nn.Module, steps: int, lr: float = 1e-3) -> Setup:
    """Pairs of a class's noisy image template and a caption naming the class among filler ids, in batches of 8
    distinct classes of 16, trained with the model's own contrastive loss (return_loss=True)."""
    tmpl = templates(16, 3, 16)

    def batch(g: torch.Generator, n: int = 8) -> Batch:
        y = torch.randperm(16, generator=g)[:n]
        filler = torch.randint(20, 40, (n, 6), generator=g)
        ids = torch.cat([(y + 3)[:, None], filler, torch.full((n, 1), 63)], dim=1)
        return {"input_ids": ids, "pixel_values": tmpl[y] + 0.5 * torch.randn(n, 3, 16, 16, generator=g),
                "return_loss": torch.tensor(True)}  # fmt: skip

    gen = torch.Generator().manual_seed(1)
    tests = held_out(lambda g: [batch(g) for _ in range(8)])

    def evaluate() -> float:
        model.eval()
        with torch.no_grad():
            value = sum(float(model(**b).loss) for b in tests) / len(tests)
        model.train()
        return value

    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    return Setup(model, steps, evaluate, hf_step(model, opt, lambda i: batch(gen)), [(model, opt)])


def clip() -> Setup:
    """CLIP (text and vision towers of 2 layers, d=32, projections of 16, learned temperature) trained with its
    symmetric InfoNCE loss (return_loss=True), AdamW 1e-3, hand-written loop. Healthy: contrastive loss falls
    (train, and on 8 fixed held-out batches)."""
    from transformers import CLIPConfig, CLIPModel

    common = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}
    cfg = CLIPConfig(
        text_config={"vocab_size": 64, "max_position_embeddings": 8, "eos_token_id": 63, **common},
        vision_config={"image_size": 16, "patch_size": 4, **common},
        projection_dim=16,
    )
    return _image_text(CLIPModel(cfg), 150)


def siglip() -> Setup:
    """SigLIP (text and vision towers of 2 layers, d=32; attention-pooling head; learned scale and bias) trained
    with its pairwise sigmoid loss (return_loss=True), AdamW 1e-3, hand-written loop. Healthy: loss falls."""
    from transformers import SiglipConfig, SiglipModel

    common = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}
    cfg = SiglipConfig(
        text_config={"vocab_size": 64, "max_position_embeddings": 8, **common},
        vision_config={"image_size": 16, "patch_size": 4, **common},
    )
    return _image_text(SiglipModel(cfg), 150)


# --- diffusers ----------------------------------------------------------------------------------------------
def unet2d() -> Setup:
    """diffusers' UNet2DModel (2 resolutions, an attention block at the lower one, GroupNorm) trained as DDPM
    (the docs' unconditional training: noise added by `DDPMScheduler.add_noise` at a random timestep, MSE on the
    predicted noise), AdamW 1e-3, 8x8 one-channel images of 4 smooth patterns. Healthy: the noise-prediction
    MSE falls on training batches and on fixed held-out (image, noise, timestep) triples."""
    from diffusers import DDPMScheduler, UNet2DModel

    model = UNet2DModel(
        sample_size=8, in_channels=1, out_channels=1, layers_per_block=1, block_out_channels=(8, 16),
        down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D"),
        norm_num_groups=4, attention_head_dim=8,
    )  # fmt: skip
    sched = DDPMScheduler(num_train_timesteps=100)
    tmpl = templates(4, 1, 8)

    def batch(g: torch.Generator, n: int) -> tuple[torch.Tensor, ...]:
        x0 = tmpl[torch.randint(0, 4, (n,), generator=g)]
        noise = torch.randn(x0.shape, generator=g)
        t = torch.randint(0, 100, (n,), generator=g)
        return sched.add_noise(x0, noise, t), noise, t

    def loss_of(b: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return F.mse_loss(model(b[0], b[2]).sample, b[1])

    gen = torch.Generator().manual_seed(1)
    test = held_out(lambda g: batch(g, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(i: int) -> float:
        loss = loss_of(batch(gen, 16))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return float(loss.detach())

    return Setup(model, 120, _evaluator(model, lambda: loss_of(test)), step, [(model, opt)])


def _evaluator(model: nn.Module, loss: Callable[[], torch.Tensor]) -> Callable[[], float]:
    def evaluate() -> float:
        was = model.training
        model.eval()
        with torch.no_grad():
            value = float(loss())
        model.train(was)
        return value

    return evaluate


def _plain(model: nn.Module, opt: torch.optim.Optimizer, loss: Callable[[int], torch.Tensor], steps: int,
           test: Callable[[], torch.Tensor], clip: float | None = None) -> Setup:  # fmt: skip
    """A hand-written PyTorch loop: loss(i) on a fresh batch, backward, optional clipping, step, zero_grad."""

    def step(i: int) -> float:
        model.train()
        value = loss(i)
        value.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        return float(value.detach())

    return Setup(model, steps, _evaluator(model, test), step, [(model, opt)])


# --- a graph network ------------------------------------------------------------------------------------------
class GCN(nn.Module):
    """Two graph-convolution layers (Kipf & Welling): H' = D^-1/2 (A + I) D^-1/2 H W, message passing written
    by hand with `index_add_` over the edge list, ReLU and dropout between."""

    def __init__(self, features: int, hidden: int, classes: int) -> None:
        super().__init__()
        self.conv1 = nn.Linear(features, hidden)
        self.conv2 = nn.Linear(hidden, classes)

    @staticmethod
    def propagate(h: torch.Tensor, edges: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
        src, dst = edges
        return torch.zeros_like(h).index_add_(0, dst, h[src] * norm[:, None])

    def forward(self, x: torch.Tensor, edges: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
        h = F.dropout(F.relu(self.propagate(self.conv1(x), edges, norm)), 0.5, self.training)
        return self.propagate(self.conv2(h), edges, norm)


def gcn() -> Setup:
    """A hand-written GCN on a stochastic block model (300 nodes, 4 communities; node features a weak noisy
    community signal, so neighbours help), full-batch node classification on half the nodes, Adam 1e-2 with
    weight decay 5e-4 (Kipf & Welling's recipe). Healthy: cross-entropy falls on the training nodes and on
    the other half (held out)."""
    gen = torch.Generator().manual_seed(3)
    n, k = 300, 4
    y = torch.randint(0, k, (n,), generator=gen)
    p = torch.where(y[:, None] == y[None, :], 0.06, 0.005)
    adj = torch.triu(torch.rand(n, n, generator=gen) < p, diagonal=1)
    adj = adj | adj.T | torch.eye(n, dtype=torch.bool)
    edges = adj.nonzero().T
    deg = adj.sum(1).float()
    norm = (deg[edges[0]] * deg[edges[1]]).rsqrt()
    x = 0.4 * F.one_hot(y, k).float() @ torch.randn(k, 16, generator=gen) + torch.randn(n, 16, generator=gen)
    train_mask = torch.rand(n, generator=gen) < 0.5
    model = GCN(16, 32, k)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=5e-4)

    def loss(i: int) -> torch.Tensor:
        return F.cross_entropy(model(x, edges, norm)[train_mask], y[train_mask])

    return _plain(model, opt, loss, 150, lambda: F.cross_entropy(model(x, edges, norm)[~train_mask], y[~train_mask]))


# --- plain PyTorch classics -----------------------------------------------------------------------------------
class LSTMLM(nn.Module):
    """PyTorch's word_language_model example in small: embedding, 2-layer LSTM, dropout, a decoder whose weight
    is the embedding's (tied)."""

    def __init__(self, vocab: int = 64, dim: int = 32) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.2)
        self.encoder = nn.Embedding(vocab, dim)
        self.rnn = nn.LSTM(dim, dim, 2, dropout=0.2, batch_first=True)
        self.decoder = nn.Linear(dim, vocab)
        self.decoder.weight = self.encoder.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.drop(self.encoder(ids)))
        return self.decoder(self.drop(out))  # type: ignore[no-any-return]


def lstm_lm() -> Setup:
    """An LSTM language model with tied input/output embeddings, trained with plain SGD (lr 5) and gradient
    clipping at 0.25 as PyTorch's word_language_model example does, on counting streams.
    Healthy: next-token cross-entropy falls (train, held-out)."""
    model = LSTMLM()
    gen = torch.Generator().manual_seed(1)

    def lm(ids: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(ids[:, :-1]).reshape(-1, 64), ids[:, 1:].reshape(-1))

    test = held_out(lambda g: counting(g, 64, 20, 64)[0])
    opt = torch.optim.SGD(model.parameters(), lr=5.0)
    return _plain(model, opt, lambda i: lm(counting(gen, 16, 20, 64)[0]), 200, lambda: lm(test), clip=0.25)


class VAE(nn.Module):
    """An MLP variational auto-encoder (Kingma & Welling): encoder to (mu, log-variance) of a 4-d latent, the
    reparameterisation trick, a decoder back to the data."""

    def __init__(self, dim: int = 20, latent: int = 4, hidden: int = 64) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU())
        self.mu = nn.Linear(hidden, latent)
        self.logvar = nn.Linear(hidden, latent)
        self.dec = nn.Sequential(nn.Linear(latent, hidden), nn.ReLU(), nn.Linear(hidden, dim))

    def loss(self, x: torch.Tensor, gen: torch.Generator | None = None) -> torch.Tensor:
        h = self.enc(x)
        mu, logvar = self.mu(h), self.logvar(h)
        eps = torch.randn(mu.shape, generator=gen)
        recon = self.dec(mu + eps * (0.5 * logvar).exp())
        kl = -0.5 * (1 + logvar - mu.pow(2) - logvar.exp()).sum(1)
        return ((recon - x).pow(2).sum(1) + kl).mean()


def vae() -> Setup:
    """A VAE on 20-d data made from a 2-d latent through a fixed random nonlinear map plus noise, Adam 1e-3.
    Healthy: the negative ELBO falls on training batches and on a fixed held-out set (fixed sampling noise)."""
    mix = torch.randn(2, 20, generator=torch.Generator().manual_seed(7))

    def data(g: torch.Generator, n: int) -> torch.Tensor:
        z = torch.randn(n, 2, generator=g)
        return 3 * torch.tanh(z @ mix) + 0.1 * torch.randn(n, 20, generator=g)

    model = VAE()
    gen = torch.Generator().manual_seed(1)
    test = held_out(lambda g: data(g, 256))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return _plain(
        model, opt, lambda i: model.loss(data(gen, 32), gen), 200,
        lambda: model.loss(test, torch.Generator().manual_seed(5)),
    )  # fmt: skip


def _mmd(a: torch.Tensor, b: torch.Tensor) -> float:
    """Maximum mean discrepancy with a Gaussian kernel (bandwidth 1): 0 when the samples' distributions agree."""

    def k(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.exp(-torch.cdist(x, y).pow(2) / 2).mean()

    return float(k(a, a) + k(b, b) - 2 * k(a, b))


def gan() -> Setup:
    """A GAN (MLP generator and discriminator, non-saturating loss) on a ring of 8 Gaussians, each network with
    its own Adam (lr 1e-3, betas 0.5/0.999) and its own GradLogger, as a user logs two optimizers.
    Healthy (gradlog-free): the MMD between generated and real samples falls, per step and on fixed noise."""
    angles = torch.arange(8) * (2 * math.pi / 8)
    centres = 2 * torch.stack([angles.cos(), angles.sin()], 1)

    def real(g: torch.Generator, n: int) -> torch.Tensor:
        return centres[torch.randint(0, 8, (n,), generator=g)] + 0.1 * torch.randn(n, 2, generator=g)

    model = nn.ModuleDict(
        {
            "generator": nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2)),
            "discriminator": nn.Sequential(nn.Linear(2, 64), nn.LeakyReLU(0.2), nn.Linear(64, 64),
                                           nn.LeakyReLU(0.2), nn.Linear(64, 1)),
        }
    )  # fmt: skip
    gnet, dnet = model["generator"], model["discriminator"]
    opt_g = torch.optim.Adam(gnet.parameters(), lr=1e-3, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(dnet.parameters(), lr=1e-3, betas=(0.5, 0.999))
    gen = torch.Generator().manual_seed(1)
    fixed_z = torch.randn(512, 8, generator=torch.Generator().manual_seed(5))
    fixed_real = held_out(lambda g: real(g, 512))
    ones, zeros = torch.ones(64, 1), torch.zeros(64, 1)

    def step(i: int) -> float:
        x = real(gen, 64)
        fake = gnet(torch.randn(64, 8, generator=gen))
        d_loss = F.binary_cross_entropy_with_logits(dnet(x), ones) + F.binary_cross_entropy_with_logits(
            dnet(fake.detach()), zeros
        )
        d_loss.backward()
        opt_d.step()
        opt_d.zero_grad()
        g_loss = F.binary_cross_entropy_with_logits(dnet(fake), ones)
        g_loss.backward()
        opt_g.step()
        opt_g.zero_grad()
        opt_d.zero_grad()  # the generator's backward also reached the discriminator
        return _mmd(fake.detach(), x)

    def evaluate() -> float:
        with torch.no_grad():
            return _mmd(gnet(fixed_z), fixed_real)

    return Setup(model, 250, evaluate, step, [(gnet, opt_g), (dnet, opt_d)])


class ActorCritic(nn.Module):
    """A shared trunk with a policy head (the actor) and a state-value head (the critic)."""

    def __init__(self, dim: int = 8, actions: int = 4, hidden: int = 32) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(dim, hidden), nn.Tanh())
        self.policy = nn.Linear(hidden, actions)
        self.value = nn.Linear(hidden, 1)

    def forward(self, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(s)
        return self.policy(h), self.value(h).squeeze(1)


def actor_critic() -> Setup:
    """Advantage actor-critic on a contextual bandit (one-step episodes of 64 parallel environments: 8-d state,
    4 actions, reward 1 for the action a fixed linear map of the state prefers, else 0): policy gradient with the
    critic's value as baseline, value MSE, an entropy bonus of 0.01, Adam 3e-3. Healthy (gradlog-free): the
    regret (1 - reward) of the sampled actions falls, and so does the expected regret on fixed held-out states."""
    best = torch.randn(8, 4, generator=torch.Generator().manual_seed(7))
    model = ActorCritic()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(1)
    states = torch.randn(512, 8, generator=torch.Generator().manual_seed(5))

    def step(i: int) -> float:
        s = torch.randn(64, 8, generator=gen)
        logits, v = model(s)
        dist = torch.distributions.Categorical(logits=logits)
        a = torch.multinomial(dist.probs, 1, generator=gen).squeeze(1)
        r = (a == (s @ best).argmax(1)).float()
        adv = (r - v).detach()
        loss = -(dist.log_prob(a) * adv).mean() + 0.5 * F.mse_loss(v, r) - 0.01 * dist.entropy().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return float(1 - r.mean())

    def evaluate() -> float:
        with torch.no_grad():
            probs = model(states)[0].softmax(1)
            return float(1 - probs.gather(1, (states @ best).argmax(1, keepdim=True)).mean())

    return Setup(model, 200, evaluate, step, [(model, opt)])


def cnn_bn() -> Setup:
    """A small CNN (conv-BatchNorm-ReLU twice, global pooling, linear) on noisy class templates, SGD with
    momentum 0.9 and weight decay 5e-4 (the classic recipe); evaluated in eval mode (running statistics).
    Healthy: cross-entropy falls (train, held-out)."""
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4),
    )  # fmt: skip
    tmpl = templates(4, 3, 16)
    gen = torch.Generator().manual_seed(1)
    tx, ty = held_out(lambda g: images(g, tmpl, 128))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)

    def loss(i: int) -> torch.Tensor:
        x, y = images(gen, tmpl, 32)
        return F.cross_entropy(model(x), y)

    return _plain(model, opt, loss, 150, lambda: F.cross_entropy(model(tx), ty))


class Encoder(nn.Module):
    """A small transformer encoder classifier (learned positions, 4 `nn.TransformerEncoderLayer`s, the first
    position's state pooled,
    a linear head): what layer-wise learning-rate decay fine-tunes."""

    def __init__(self, vocab: int = 64, dim: int = 32, layers: int = 4, classes: int = 2) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(16, dim)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, 4, 64, dropout=0.1, batch_first=True) for _ in range(layers)
        )
        self.head = nn.Linear(dim, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tokens(ids) + self.positions(torch.arange(ids.shape[1]))
        for layer in self.layers:
            h = layer(h)
        return self.head(h[:, 0])  # type: ignore[no-any-return]


def llrd() -> Setup:
    """Layer-wise learning-rate decay fine-tuning: AdamW with one param group per depth, the head at 1e-3 and each
    layer below at 0.7x the one above (embeddings lowest, 0.7^5), weight decay 0.01; a sequence classifier
    (is the first id in the lower half?). Healthy: cross-entropy falls (train, held-out)."""
    model = Encoder()
    groups: list[dict[str, Any]] = [{"params": model.head.parameters(), "lr": 1e-3}]
    for depth, layer in enumerate(reversed(model.layers), start=1):
        groups.append({"params": layer.parameters(), "lr": 1e-3 * 0.7**depth})
    embeddings = [*model.tokens.parameters(), *model.positions.parameters()]
    groups.append({"params": embeddings, "lr": 1e-3 * 0.7 ** (len(model.layers) + 1)})
    opt = torch.optim.AdamW(groups, weight_decay=0.01)
    gen = torch.Generator().manual_seed(1)
    tx = held_out(lambda g: counting(g, 128, 16, 64)[0])
    ty = first_half(tx, 0, 64)

    def loss(i: int) -> torch.Tensor:
        ids, _ = counting(gen, 16, 16, 64)
        return F.cross_entropy(model(ids), first_half(ids, 0, 64))

    return _plain(model, opt, loss, 150, lambda: F.cross_entropy(model(tx), ty))


def _clusters(g: torch.Generator, centres: torch.Tensor, n: int, noise: float) -> tuple[torch.Tensor, ...]:
    y = torch.randint(0, centres.shape[0], (n,), generator=g)
    return centres[y] + noise * torch.randn(n, centres.shape[1], generator=g), y


class MeanTeacher(nn.Module):
    """A student classifier and its teacher, an exponential moving average of the student's weights (Tarvainen &
    Valpola): the teacher is frozen in `__init__` and only ever changed by `update_teacher`."""

    def __init__(self, decay: float = 0.95) -> None:
        super().__init__()
        self.student = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
        self.teacher = copy.deepcopy(self.student).requires_grad_(False)
        self.decay = decay

    @torch.no_grad()
    def update_teacher(self) -> None:
        for t, s in zip(self.teacher.parameters(), self.student.parameters()):
            t.lerp_(s, 1 - self.decay)


def ema_teacher() -> Setup:
    """Mean teacher: cross-entropy on the labelled quarter of each batch plus a consistency loss (MSE between the
    student's and the EMA teacher's class probabilities under different input noise) on all of it; Adam 1e-3 on
    the student, the teacher updated after each step; the logger watches the whole module (teacher included), as
    a user passes their model. Healthy: the student's cross-entropy falls (train, held-out)."""
    centres = 1.5 * torch.randn(4, 16, generator=torch.Generator().manual_seed(7))
    model = MeanTeacher()
    opt = torch.optim.Adam(model.student.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    tx, ty = held_out(lambda g: _clusters(g, centres, 256, 1.0))

    def step(i: int) -> float:
        x, y = _clusters(gen, centres, 64, 1.0)
        student = model.student(x + 0.3 * torch.randn(x.shape, generator=gen))
        with torch.no_grad():
            teacher = model.teacher(x + 0.3 * torch.randn(x.shape, generator=gen))
        ce = F.cross_entropy(student[:16], y[:16])
        loss = ce + F.mse_loss(student.softmax(1), teacher.softmax(1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        model.update_teacher()
        return float(ce.detach())

    test = _evaluator(model, lambda: F.cross_entropy(model.student(tx), ty))
    return Setup(model, 200, test, step, [(model, opt)])


class SimSiam(nn.Module):
    """SimSiam (Chen & He): an encoder with a BatchNorm projector and a bottleneck predictor; the loss compares
    each view's prediction with the other view's projection behind a stop-gradient (`detach`)."""

    def __init__(self, dim: int = 16, width: int = 64, out: int = 32) -> None:
        super().__init__()
        self.encoder = nn.Sequential(
            nn.Linear(dim, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Linear(width, out), nn.BatchNorm1d(out)
        )
        self.predictor = nn.Sequential(nn.Linear(out, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, out))

    def loss(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        za, zb = self.encoder(a), self.encoder(b)
        pa, pb = self.predictor(za), self.predictor(zb)
        sim = F.cosine_similarity(pa, zb.detach()).mean() + F.cosine_similarity(pb, za.detach()).mean()
        return 1 - sim / 2  # 1 - the mean cosine: 0 when each view predicts the other


def simsiam() -> Setup:
    """SimSiam on 16-d points of 8 clusters, two views by additive noise and random feature scaling; SGD with
    momentum 0.9 (lr 0.05, weight decay 1e-4), as the paper trains it. Healthy: 1 - cosine between a view's
    prediction and the other's projection falls, on training batches and on fixed held-out pairs (eval mode)."""
    centres = 2 * torch.randn(8, 16, generator=torch.Generator().manual_seed(7))
    model = SimSiam()
    gen = torch.Generator().manual_seed(1)

    def views(g: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, _ = _clusters(g, centres, n, 0.5)

        def view() -> torch.Tensor:
            return x * (0.8 + 0.4 * torch.rand(n, 16, generator=g)) + 0.3 * torch.randn(n, 16, generator=g)

        return view(), view()

    test = held_out(lambda g: views(g, 256))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    return _plain(model, opt, lambda i: model.loss(*views(gen, 64)), 200, lambda: model.loss(*test))


# --- new mechanisms (issue 38's second round): shared layers, relative/ALiBi attention, +1 norms, masking,
# --- other optimizers and schedules, accumulation, autocast, parametrizations, layer drop, sparse tables ----
def albert_mlm() -> Setup:
    """ALBERT (one transformer layer's weights shared by all 4 layers, factorized embeddings of size 16) masked
    LM as BERT's, AdamW 1e-3, hand-written loop. Healthy: masked-LM loss falls (train, held-out); the shared
    layer's tensors get the sum of 4 layers' gradients, which is how ALBERT is meant to train."""
    from transformers import AlbertConfig, AlbertForMaskedLM

    cfg = AlbertConfig(
        vocab_size=64, embedding_size=16, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=16,
    )  # fmt: skip
    model = AlbertForMaskedLM(cfg)
    return _mlm(model)


def deberta_v2_cls() -> Setup:
    """DeBERTa-v2 (2 layers, d=32, disentangled relative attention over shared `rel_embeddings`, no absolute
    positions) sequence classification (is the first id in the lower half?), AdamW 1e-3, hand-written loop.
    Healthy: cross-entropy falls (train, held-out)."""
    from transformers import DebertaV2Config, DebertaV2ForSequenceClassification

    cfg = DebertaV2Config(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=16, relative_attention=True, position_buckets=8, max_relative_positions=16,
        pos_att_type=["p2c", "c2p"], position_biased_input=False, num_labels=2,
    )  # fmt: skip
    model = DebertaV2ForSequenceClassification(cfg)
    gen = torch.Generator().manual_seed(1)

    def batch(g: torch.Generator, n: int) -> Batch:
        ids, _ = counting(g, n, 16, 64, FIRST)
        return {"input_ids": ids, "labels": first_half(ids, FIRST, 64)}

    test = held_out(lambda g: batch(g, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return Setup(model, 150, eval_loss(model, test), hf_step(model, opt, lambda i: batch(gen, 16)), [(model, opt)])


def electra() -> Setup:
    """ELECTRA pre-training: a small generator (masked LM) and a discriminator (replaced-token detection) that
    share one embedding module, as the paper ties them; the generator's samples replace the masked ids, the
    loss is generator MLM + 50 x discriminator loss, one AdamW 1e-3 over both. Healthy: the summed loss falls
    (train, held-out with fixed masking and the generator's argmax as the replacement)."""
    from transformers import ElectraConfig, ElectraForMaskedLM, ElectraForPreTraining

    common = dict(vocab_size=64, embedding_size=16, max_position_embeddings=16, num_attention_heads=2)
    gen_cfg = ElectraConfig(hidden_size=16, num_hidden_layers=1, intermediate_size=32, **common)
    dis_cfg = ElectraConfig(hidden_size=32, num_hidden_layers=2, intermediate_size=64, **common)
    model = nn.ModuleDict({"generator": ElectraForMaskedLM(gen_cfg), "discriminator": ElectraForPreTraining(dis_cfg)})
    model["discriminator"].electra.embeddings = model["generator"].electra.embeddings
    gen = torch.Generator().manual_seed(1)

    def loss_of(b: Batch, g: torch.Generator | None) -> torch.Tensor:
        out = model["generator"](**b)
        chosen = b["labels"] != -100
        logits = out.logits.detach()
        if g is None:
            sampled = logits.argmax(-1)
        else:
            sampled = torch.multinomial(logits.softmax(-1).flatten(0, 1), 1, generator=g).view(logits.shape[:2])
        original = torch.where(chosen, b["labels"], b["input_ids"])
        corrupted = torch.where(chosen, sampled, b["input_ids"])
        replaced = (corrupted != original).long()
        disc = model["discriminator"](input_ids=corrupted, labels=replaced).loss
        return out.loss + 50 * disc  # type: ignore[no-any-return]

    test = held_out(lambda g: _mlm_batch(g, 64, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return _plain(model, opt, lambda i: loss_of(_mlm_batch(gen, 16, 64), gen), 200, lambda: loss_of(test, None), 1.0)


def pythia() -> Setup:
    """GPT-NeoX / Pythia (2 layers, d=32, parallel attention and MLP residuals, rotary on a quarter of each
    head) causal LM with labels=input_ids, AdamW 1e-3. Healthy: LM loss (train, held-out) falls."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    cfg = GPTNeoXConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=16, rotary_pct=0.25, use_parallel_residual=True,
    )  # fmt: skip
    return _causal_lm(GPTNeoXForCausalLM(cfg), 64, 150)


def bloom() -> Setup:
    """BLOOM (2 layers, d=32, ALiBi: no position table, a fixed per-head distance penalty; LayerNorm after the
    embeddings) causal LM with labels=input_ids, AdamW 1e-3. Healthy: LM loss (train, held-out) falls."""
    from transformers import BloomConfig, BloomForCausalLM

    cfg = BloomConfig(vocab_size=64, hidden_size=32, n_layer=2, n_head=4)
    return _causal_lm(BloomForCausalLM(cfg), 64, 150)


def gemma() -> Setup:
    """Gemma (2 layers, d=32, tied input/output embeddings scaled by sqrt(d), RMSNorm whose gain is 1 + a weight
    initialised at 0, GeGLU) causal LM with labels=input_ids, AdamW 2e-3. Healthy: LM loss (train, held-out)
    falls; the zero-initialised norm weights move off 0."""
    from transformers import GemmaConfig, GemmaForCausalLM

    cfg = GemmaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=8, max_position_embeddings=32,
    )  # fmt: skip
    return _causal_lm(GemmaForCausalLM(cfg), 64, 150, lr=2e-3)


def patchtst() -> Setup:
    """PatchTST (2 layers, d=32, patches of 8 of a 64-step context, channel-independent) forecasting the next 16
    steps of noisy sums of sines (2 channels), AdamW 1e-3, hand-written loop. Healthy: MSE falls (train,
    held-out)."""
    from transformers import PatchTSTConfig, PatchTSTForPrediction

    cfg = PatchTSTConfig(
        num_input_channels=2, context_length=64, prediction_length=16, patch_length=8, patch_stride=8, d_model=32,
        num_attention_heads=2, num_hidden_layers=2, ffn_dim=64, scaling="std",
    )  # fmt: skip
    model = PatchTSTForPrediction(cfg)
    t = torch.arange(80, dtype=torch.float32)

    def batch(g: torch.Generator, n: int) -> Batch:
        freq = 0.05 + 0.25 * torch.rand(n, 1, 2, generator=g)
        phase = 2 * math.pi * torch.rand(n, 1, 2, generator=g)
        series = torch.sin(freq * t[None, :, None] + phase) + 0.1 * torch.randn(n, 80, 2, generator=g)
        return {"past_values": series[:, :64], "future_values": series[:, 64:]}

    gen = torch.Generator().manual_seed(1)
    test = held_out(lambda g: batch(g, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return Setup(model, 150, eval_loss(model, test), hf_step(model, opt, lambda i: batch(gen, 16)), [(model, opt)])


def adafactor_t5() -> Setup:
    """T5 (the same tiny config as `t5`) trained with transformers' `Adafactor` as its docs recommend for T5:
    relative step sizes min(1e-2, 1/sqrt(t)) scaled by each tensor's RMS, no lr (`lr=None, relative_step=True,
    scale_parameter=True`), factored second moments of the matrices. Healthy: seq2seq loss falls (train, held-out)."""
    from transformers import T5Config, T5ForConditionalGeneration
    from transformers.optimization import Adafactor

    cfg = T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    model = T5ForConditionalGeneration(cfg)
    gen = torch.Generator().manual_seed(1)
    test = held_out(lambda g: _seq2seq_batch(g, 64, 64))
    opt = Adafactor(model.parameters(), lr=None, relative_step=True, scale_parameter=True, warmup_init=False)
    step = hf_step(model, opt, lambda i: _seq2seq_batch(gen, 8, 64))
    return Setup(model, 150, eval_loss(model, test), step, [(model, opt)])


def bitfit_bert() -> Setup:
    """BitFit: a BERT sequence classifier (2 layers, d=32) whose weights are all frozen but the biases (and the
    classifier head), AdamW 1e-2. Healthy: cross-entropy falls (train, held-out); every bias learns, the frozen
    weights are listed as frozen (notes)."""
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=16, num_labels=2,
    )  # fmt: skip
    model = BertForSequenceClassification(cfg)
    for name, p in model.named_parameters():
        p.requires_grad_(name.endswith("bias") or name.startswith("classifier"))
    gen = torch.Generator().manual_seed(1)

    def batch(g: torch.Generator, n: int) -> Batch:
        ids, _ = counting(g, n, 16, 64, FIRST)
        return {"input_ids": ids, "labels": first_half(ids, FIRST, 64)}

    test = held_out(lambda g: batch(g, 64))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return Setup(model, 150, eval_loss(model, test), hf_step(model, opt, lambda i: batch(gen, 16)), [(model, opt)])


def _mlp_classifier_data(dim: int = 16, classes: int = 4) -> tuple[torch.Tensor, Callable[..., Any]]:
    centres = 1.5 * torch.randn(classes, dim, generator=torch.Generator().manual_seed(7))
    return centres, lambda g, n: _clusters(g, centres, n, 1.0)


def _fit_clusters(model: nn.Module, opt: torch.optim.Optimizer, steps: int, judged: nn.Module | None = None) -> Setup:
    """`model` trained by `opt` to classify clustered vectors (batches of 32), judged on a held-out 256 by
    `judged` (default `model`: a compiled model's original module, say)."""
    _, data = _mlp_classifier_data()
    gen = torch.Generator().manual_seed(1)
    tx, ty = held_out(lambda g: data(g, 256))
    evaluated = model if judged is None else judged

    def loss(i: int) -> torch.Tensor:
        x, y = data(gen, 32)
        return F.cross_entropy(model(x), y)

    return _plain(model, opt, loss, steps, lambda: F.cross_entropy(evaluated(tx), ty))


def weight_norm_mlp() -> Setup:
    """An MLP whose linear layers are reparametrized by `torch.nn.utils.parametrizations.weight_norm` (the
    parameters are `parametrizations.weight.original0`, the magnitude g, and `original1`, the direction v),
    RMSprop 1e-3 on clustered vectors. Healthy: cross-entropy falls (train, held-out)."""
    from torch.nn.utils.parametrizations import weight_norm

    model = nn.Sequential(
        weight_norm(nn.Linear(16, 64)), nn.ReLU(),
        weight_norm(nn.Linear(64, 64)), nn.ReLU(),
        weight_norm(nn.Linear(64, 4)),
    )  # fmt: skip
    return _fit_clusters(model, torch.optim.RMSprop(model.parameters(), lr=1e-3), 150)


def compiled_mlp() -> Setup:
    """A ReLU MLP on clustered vectors wrapped in `torch.compile` (the optimizer and the logger get the compiled
    module, whose parameters are the original's under `_orig_mod.`), Adam 1e-3. Healthy: cross-entropy falls
    (train, held-out); one of 64 ReLU units of the second layer stops firing at about step 20 (a few dead units
    are normal: a note)."""
    net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    model = torch.compile(net)
    return _fit_clusters(model, torch.optim.Adam(model.parameters(), lr=1e-3), 150, judged=net)


def spectral_norm_cnn() -> Setup:
    """A CNN whose convolutions and head are reparametrized by `torch.nn.utils.parametrizations.spectral_norm`
    (one power iteration per training forward; `original` is the learned weight), SGD with Nesterov momentum
    0.9, lr 0.05, on noisy class templates. Healthy: cross-entropy falls (train, held-out)."""
    from torch.nn.utils.parametrizations import spectral_norm

    model = nn.Sequential(
        spectral_norm(nn.Conv2d(3, 16, 3, padding=1)), nn.ReLU(),
        spectral_norm(nn.Conv2d(16, 32, 3, stride=2, padding=1)), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), spectral_norm(nn.Linear(32, 4)),
    )  # fmt: skip
    tmpl = templates(4, 3, 16)
    gen = torch.Generator().manual_seed(1)
    tx, ty = held_out(lambda g: images(g, tmpl, 128))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)

    def loss(i: int) -> torch.Tensor:
        x, y = images(gen, tmpl, 32)
        return F.cross_entropy(4 * model(x), y)

    return _plain(model, opt, loss, 150, lambda: F.cross_entropy(4 * model(tx), ty))


class LayerDropNet(nn.Module):
    """Residual MLP blocks each skipped whole with probability `p` while training (LayerDrop, Fan et al.;
    stochastic depth per batch): a skipped block gets no gradient at that step."""

    def __init__(self, dim: int = 16, width: int = 32, blocks: int = 6, classes: int = 4, p: float = 0.3) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU(), nn.Linear(width, width))
            for _ in range(blocks)
        )
        self.out = nn.Linear(width, classes)
        self.p = p
        self.gen = torch.Generator().manual_seed(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            if self.training and float(torch.rand((), generator=self.gen)) < self.p:
                continue
            h = h + block(h)
        return self.out(h)  # type: ignore[no-any-return]


def layerdrop() -> Setup:
    """LayerDrop: 6 residual blocks each skipped whole on 30% of training steps (so each block misses whole
    optimizer steps, up to 5 in a row), NAdam 1e-3 on clustered vectors. Healthy: cross-entropy falls (train,
    held-out in eval mode, every block on)."""
    model = LayerDropNet()
    return _fit_clusters(model, torch.optim.NAdam(model.parameters(), lr=1e-3), 200)


class Recommender(nn.Module):
    """Matrix factorisation with biases: score(user, item) = <u, v> + b_u + b_i; 2,000 items, most of them
    rare (Zipf-like popularity), in `nn.Embedding(sparse=True)` tables."""

    def __init__(self, users: int = 200, items: int = 2000, dim: int = 16) -> None:
        super().__init__()
        self.users = nn.Embedding(users, dim, sparse=True)
        self.items = nn.Embedding(items, dim, sparse=True)
        self.user_bias = nn.Embedding(users, 1, sparse=True)
        self.item_bias = nn.Embedding(items, 1, sparse=True)
        nn.init.normal_(self.users.weight, std=0.1)
        nn.init.normal_(self.items.weight, std=0.1)
        nn.init.zeros_(self.user_bias.weight)
        nn.init.zeros_(self.item_bias.weight)

    def forward(self, u: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        dot = (self.users(u) * self.items(i)).sum(1)
        return dot + self.user_bias(u).squeeze(1) + self.item_bias(i).squeeze(1)


def _implicit_feedback() -> Callable[[torch.Generator, int], tuple[torch.Tensor, ...]]:
    """Batches of (user, item, liked) for 200 users and 2,000 items drawn Zipf-like (most items rare, many never
    drawn): liked when the user's and the item's hidden 4-d tastes agree."""
    taste = torch.randn(200, 4, generator=torch.Generator().manual_seed(7))
    kind = torch.randn(2000, 4, generator=torch.Generator().manual_seed(8))
    popularity = 1.0 / torch.arange(1, 2001, dtype=torch.float32) ** 1.1

    def batch(g: torch.Generator, n: int) -> tuple[torch.Tensor, ...]:
        u = torch.randint(0, 200, (n,), generator=g)
        i = torch.multinomial(popularity, n, replacement=True, generator=g)
        return u, i, ((taste[u] * kind[i]).sum(1) > 0).float()

    return batch


def recommender_sparse() -> Setup:
    """A recommender on implicit feedback: item ids drawn Zipf-like (most of 2,000 items rare, many never seen),
    one positive and one random negative item per user, logistic loss, `nn.Embedding(sparse=True)` tables stepped
    by `torch.optim.SparseAdam` (lr 1e-2), as torch documents for sparse gradients. Healthy: the loss falls on
    training batches and on fixed held-out pairs; the rows of items no batch held never move (notes)."""
    model = Recommender()
    batch = _implicit_feedback()

    def loss_of(b: tuple[torch.Tensor, ...]) -> torch.Tensor:
        u, i, y = b
        return F.binary_cross_entropy_with_logits(model(u, i), y)

    gen = torch.Generator().manual_seed(1)
    test = held_out(lambda g: batch(g, 512))
    opt = torch.optim.SparseAdam(list(model.parameters()), lr=1e-2)
    return _plain(model, opt, lambda i: loss_of(batch(gen, 256)), 200, lambda: loss_of(test))


class NeuMF(nn.Module):
    """Neural collaborative filtering: user and item embeddings in `nn.Embedding(sparse=True)` tables, an MLP over
    their elementwise product and both vectors (dense parameters)."""

    def __init__(self, users: int = 200, items: int = 2000, dim: int = 16) -> None:
        super().__init__()
        self.users = nn.Embedding(users, dim, sparse=True)
        self.items = nn.Embedding(items, dim, sparse=True)
        self.mlp = nn.Sequential(nn.Linear(3 * dim, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, u: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        eu, ei = self.users(u), self.items(i)
        return self.mlp(torch.cat([eu * ei, eu, ei], 1)).squeeze(1)  # type: ignore[no-any-return]


def neumf_two_optimizers() -> Setup:
    """NeuMF on the recommender's Zipf-like implicit feedback, trained as torch documents sparse embeddings: the
    sparse tables stepped by `SparseAdam` (lr 1e-2), the dense MLP by `Adam` (lr 3e-3), two optimizers on one
    model, and one `GradLogger` per optimizer, each watching the whole model (each sees the other's tensors
    stepped by an optimizer it does not follow). Healthy: the logistic loss falls (train, held-out)."""
    model = NeuMF()
    batch = _implicit_feedback()

    def loss_of(b: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(model(b[0], b[1]), b[2])

    gen = torch.Generator().manual_seed(1)
    test = held_out(lambda g: batch(g, 512))
    sparse = torch.optim.SparseAdam([model.users.weight, model.items.weight], lr=1e-2)
    dense = torch.optim.Adam(model.mlp.parameters(), lr=3e-3)

    def step(i: int) -> float:
        model.train()
        loss = loss_of(batch(gen, 256))
        loss.backward()
        sparse.step()
        dense.step()
        sparse.zero_grad()
        dense.zero_grad()
        return float(loss.detach())

    return Setup(model, 300, _evaluator(model, lambda: loss_of(test)), step, [(model, sparse), (model, dense)])


def accumulate_bf16_onecycle() -> Setup:
    """A transformer encoder classifier (1 layer) trained with gradient accumulation over 4 micro-batches (the optimizer
    steps once per 4 backwards, the logger logs once per optimizer step), bf16 autocast on CPU, AdamW under
    OneCycleLR (warm-up from lr/25 to 2e-3, cosine annealing down to ~0). Healthy: cross-entropy falls (train,
    held-out in fp32)."""
    model = Encoder(layers=1)
    gen = torch.Generator().manual_seed(1)
    tx = held_out(lambda g: counting(g, 128, 16, 64)[0])
    ty = first_half(tx, 0, 64)
    steps = 100
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-3, total_steps=steps)

    def step(i: int) -> float:
        model.train()
        total = 0.0
        for _ in range(4):
            ids, _ = counting(gen, 8, 16, 64)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(ids).float(), first_half(ids, 0, 64)) / 4
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        return total

    return Setup(model, steps, _evaluator(model, lambda: F.cross_entropy(model(tx), ty)), step, [(model, opt)])


def _first_half_task(model: nn.Module, opt: torch.optim.Optimizer, steps: int, before: Callable[[int], None]) -> Setup:
    """The `llrd` task (is the first id in the lower half?) in a hand-written loop (`_plain`) that calls
    `before(i)` (an unfreezing) before each step's forward."""
    gen = torch.Generator().manual_seed(1)
    tx = held_out(lambda g: counting(g, 128, 16, 64)[0])
    ty = first_half(tx, 0, 64)

    def loss(i: int) -> torch.Tensor:
        before(i)
        ids, _ = counting(gen, 16, 16, 64)
        return F.cross_entropy(model(ids), first_half(ids, 0, 64))

    return _plain(model, opt, loss, steps, lambda: F.cross_entropy(model(tx), ty))


def cosine_warmup() -> Setup:
    """transformers' `get_cosine_schedule_with_warmup` (20 warm-up steps of 150): the lr is exactly 0 at the
    first step and falls to ~0 at the last, AdamW 1e-3 on a 2-layer encoder classifier. Healthy: cross-entropy
    falls (train, held-out); no tensor moves at step 0 and every one barely moves at the end, all together."""
    from transformers import get_cosine_schedule_with_warmup

    model = Encoder(layers=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = get_cosine_schedule_with_warmup(opt, 20, 150)
    s = _first_half_task(model, opt, 150, lambda i: None)
    inner = s.step
    assert inner is not None

    def step(i: int) -> float:
        value = inner(i)
        sched.step()
        return value

    s.step = step
    return s


def gradual_unfreeze() -> Setup:
    """ULMFiT's gradual unfreezing: only the head trains at first, then every 30 steps one more layer from the
    top (the embeddings last, at step 120), by `requires_grad_(True)`, the optimizer built over every parameter
    from the start (AdamW 1e-3, as the fastai recipe does). Healthy: cross-entropy falls (train, held-out); each
    unfrozen tensor learns from its stage on."""
    model = Encoder(layers=3)
    model.requires_grad_(False)
    model.head.requires_grad_(True)
    stages = [model.layers[2], model.layers[1], model.layers[0], nn.ModuleList([model.tokens, model.positions])]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)

    def unfreeze(i: int) -> None:
        if i and i % 30 == 0 and i // 30 <= len(stages):
            stages[i // 30 - 1].requires_grad_(True)

    return _first_half_task(model, opt, 200, unfreeze)


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023, "Symbolic discovery of optimization algorithms"), as its paper's pseudo-code and
    lion-pytorch write it: the update is lr x sign(beta1 m + (1 - beta1) g), so every entry moves by exactly
    lr; decoupled weight decay."""

    def __init__(self, params: Any, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99), wd: float = 0.0):
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": wd})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(torch.sign(m * b1 + p.grad * (1 - b1)), alpha=-group["lr"])
                m.mul_(b2).add_(p.grad, alpha=1 - b2)


def lion_checkpointed_gpt2() -> Setup:
    """GPT-2 (2 layers, d=32) with `gradient_checkpointing_enable()` (activations recomputed in backward),
    causal LM with labels=input_ids, trained by Lion (lr 2e-4, weight decay 0.1: the paper's 3-10x smaller lr
    and larger decay than AdamW's). Healthy: LM loss (train, held-out) falls."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4)
    model = GPT2LMHeadModel(cfg)
    model.gradient_checkpointing_enable()
    gen = torch.Generator().manual_seed(1)

    def batch(i: int) -> Batch:
        ids, _ = counting(gen, 8, 16, 64)
        return {"input_ids": ids, "labels": ids}

    test = held_out(lambda g: {"input_ids": (ids := counting(g, 32, 16, 64)[0]), "labels": ids})
    opt = Lion(model.parameters(), lr=2e-4, wd=0.1)
    return Setup(model, 150, eval_loss(model, test), hf_step(model, opt, batch), [(model, opt)])


def frozen_bn_finetune() -> Setup:
    """Fine-tuning a CNN with its BatchNorm layers kept in eval mode (frozen running statistics, as detection
    and segmentation recipes fine-tune a backbone; the BN affine weights still train), Adagrad lr 0.05. The CNN
    is first "pre-trained" (its running statistics gathered) on other classes' templates. Healthy: cross-entropy
    on the new task falls (train, held-out)."""
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4),
    )  # fmt: skip
    old = templates(4, 3, 16, seed_=9)
    with torch.no_grad():
        model.train()
        for _ in range(10):
            model(images(torch.Generator().manual_seed(2), old, 64)[0])
    tmpl = templates(4, 3, 16)
    gen = torch.Generator().manual_seed(1)
    tx, ty = held_out(lambda g: images(g, tmpl, 128))
    opt = torch.optim.Adagrad(model.parameters(), lr=0.05)

    def step(i: int) -> float:
        model.train()
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.eval()
        x, y = images(gen, tmpl, 32)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return float(loss.detach())

    return Setup(model, 150, _evaluator(model, lambda: F.cross_entropy(model(tx), ty)), step, [(model, opt)])


# --- the third round (zoo4): unusual routing, hybrids, masked pre-training, codebooks, flows -------------------
def deepseek_v3() -> Setup:
    """DeepSeek-V3 (2 layers: a dense first layer, then 8 routed experts of which sigmoid scores pick 2 inside
    the best of 2 groups, plus a shared expert; multi-head latent attention with low-rank q and kv) causal LM
    with labels=input_ids, AdamW 2e-3. Its auxiliary-loss-free balancing is done as the paper does, outside the
    optimizer: after each step every router's `e_score_correction_bias` (a buffer) moves by 1e-3 towards the
    experts the step under-used. Healthy: LM loss (train, held-out) falls; every expert's weights change."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
        n_group=2, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4,
        qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=32, tie_word_embeddings=False,
    )  # fmt: skip
    model = DeepseekV3ForCausalLM(cfg)
    s = _causal_lm(model, 64, 150, lr=2e-3)
    routers = [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]
    loads: dict[nn.Module, torch.Tensor] = {}

    def count(module: nn.Module, args: Any, out: tuple[torch.Tensor, ...]) -> None:
        loads[module] = torch.bincount(out[2].flatten(), minlength=module.e_score_correction_bias.numel()).float()

    for r in routers:
        r.register_forward_hook(count)
    inner = s.step
    assert inner is not None

    def step(i: int) -> float:
        value = inner(i)
        with torch.no_grad():
            for r in routers:
                r.e_score_correction_bias += 1e-3 * torch.sign(loads[r].mean() - loads[r])
        return value

    s.step = step
    return s


def qwen3_moe() -> Setup:
    """Qwen3-MoE (2 layers, 8 experts top-2 with normalised top-k weights, no shared expert, RMSNorm on queries
    and keys) causal LM with labels=input_ids and the load-balancing auxiliary loss on (`output_router_logits`),
    AdamW 2e-3. Healthy: LM loss (train, held-out) falls; every expert's weights change."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_experts=8,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        max_position_embeddings=32, output_router_logits=True, router_aux_loss_coef=0.01, decoder_sparse_step=1,
        tie_word_embeddings=False,
    )  # fmt: skip
    return _causal_lm(Qwen3MoeForCausalLM(cfg), 64, 150, lr=2e-3)


def gpt_oss() -> Setup:
    """GPT-OSS (2 layers alternating sliding-window and full attention, a learned attention sink per head that
    takes softmax mass, 4 experts top-2 with biased experts and a clamped SwiGLU) causal LM with
    labels=input_ids, AdamW 2e-3. Healthy: LM loss (train, held-out) falls; the sinks learn."""
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, head_dim=8, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=32,
    )  # fmt: skip
    return _causal_lm(GptOssForCausalLM(cfg), 64, 150, lr=2e-3)


def jamba() -> Setup:
    """Jamba (4 layers: Mamba mixers with one attention layer among them, a 4-expert top-2 MoE in every second
    layer; the pure-PyTorch scan on CPU) causal LM with labels=input_ids and the router's auxiliary loss,
    AdamW 2e-3. Healthy: LM loss (train, held-out) falls."""
    from transformers import JambaConfig, JambaForCausalLM

    cfg = JambaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, expert_layer_period=2, expert_layer_offset=1,
        attn_layer_period=4, attn_layer_offset=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
        output_router_logits=True, router_aux_loss_coef=0.01, max_position_embeddings=32,
        pad_token_id=0,
    )  # fmt: skip
    return _causal_lm(JambaForCausalLM(cfg), 64, 150, lr=2e-3)


def opt() -> Setup:
    """OPT (2 layers, d=32, learned positions offset by 2, ReLU MLP, pre-LayerNorm with a final norm, tied
    embeddings) causal LM with labels=input_ids, AdamW 1e-3. Healthy: LM loss (train, held-out) falls."""
    from transformers import OPTConfig, OPTForCausalLM

    cfg = OPTConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=4,
        max_position_embeddings=16, word_embed_proj_dim=32, pad_token_id=1,
    )  # fmt: skip
    return _causal_lm(OPTForCausalLM(cfg), 64, 150)


def rwkv() -> Setup:
    """RWKV (4 layers, d=32: linear-attention time mixing with learned per-channel decay and a bonus for the
    current token, token shift, squared-ReLU channel mixing; no attention matrix) causal LM with
    labels=input_ids, AdamW 2e-3. Healthy: LM loss (train, held-out) falls."""
    from transformers import RwkvConfig, RwkvForCausalLM

    cfg = RwkvConfig(
        vocab_size=64, context_length=16, hidden_size=32, num_hidden_layers=4, attention_hidden_size=32,
        intermediate_size=64, use_cache=False,
    )  # fmt: skip
    return _causal_lm(RwkvForCausalLM(cfg), 64, 150, lr=2e-3)


def modernbert_mlm() -> Setup:
    """ModernBERT (3 layers, d=32: global attention every third layer, sliding windows of 8 elsewhere, rotary
    positions, GeGLU, no biases, LayerNorm without bias) masked LM as BERT's, AdamW 1e-3, hand-written loop.
    Healthy: masked-LM loss falls (train, held-out)."""
    from transformers import ModernBertConfig, ModernBertForMaskedLM

    cfg = ModernBertConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
        global_attn_every_n_layers=3, local_attention=8, max_position_embeddings=16, pad_token_id=0,
        bos_token_id=2, eos_token_id=3, cls_token_id=2, sep_token_id=3,
    )  # fmt: skip
    return _mlm(ModernBertForMaskedLM(cfg))


def switch_transformers() -> Setup:
    """Switch Transformers (2+2 layers, d=32, every second layer a 4-expert top-1 router with jitter noise and an
    expert capacity of 8 tokens of a batch's 96 (8 sequences of 12) or 64, so overflowing tokens are dropped and
    pass by the residual alone) with labels and the router z-loss and load-balancing loss on
    (`output_router_logits=True`), continuing a counting stream, AdamW 1e-3. Healthy: seq2seq loss falls (train,
    held-out)."""
    from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration

    cfg = SwitchTransformersConfig(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_sparse_encoder_layers=1,
        num_sparse_decoder_layers=1, num_heads=4, num_experts=4, expert_capacity=8, router_z_loss_coef=0.01,
        router_aux_loss_coef=0.01, relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0,
        eos_token_id=1, dropout_rate=0.0,
    )  # fmt: skip
    model = SwitchTransformersForConditionalGeneration(cfg)
    gen = torch.Generator().manual_seed(1)
    test = held_out(lambda g: {**_seq2seq_batch(g, 64, 64), "output_router_logits": torch.tensor(True)})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def batch(i: int) -> Batch:
        return {**_seq2seq_batch(gen, 8, 64), "output_router_logits": torch.tensor(True)}

    return Setup(model, 150, eval_loss(model, test), hf_step(model, opt, batch), [(model, opt)])


def vit_mae() -> Setup:
    """ViT-MAE pre-training (encoder 2 layers d=32, decoder 1 layer d=32, 4x4 patches of 16x16 images, 75% of the
    patches masked at random, a learned mask token; the loss is the pixel MSE on the masked patches only): the
    patch embedding sees only the visible quarter, the decoder predicts the rest from the mask token and its
    position. Built from a config, transformers 5.25 leaves both fixed (frozen) 2-d sin-cos position tables at
    zero, so no patch knows where it is and the loss cannot fall (the zoo's second round left MAE out for that);
    the family fills them with transformers' own `build_2d_sinusoidal_position_embedding`, as the MAE paper's
    initialisation means to. Images are 4 class templates with light noise (0.1), so a visible quarter identifies
    the image; AdamW 3e-3, hand-written loop; the masking noise is drawn from the data's generator (fixed for the
    held-out set). Healthy: the reconstruction loss falls (train, held-out); the two position tables are frozen
    by the model itself (notes)."""
    from transformers import ViTMAEConfig, ViTMAEForPreTraining
    from transformers.models.vit_mae.modeling_vit_mae import build_2d_sinusoidal_position_embedding

    cfg = ViTMAEConfig(
        image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, decoder_hidden_size=32, decoder_num_hidden_layers=1, decoder_num_attention_heads=2,
        decoder_intermediate_size=64, mask_ratio=0.75,
    )  # fmt: skip
    model = ViTMAEForPreTraining(cfg)
    with torch.no_grad():
        for table in (model.vit.embeddings.position_embeddings, model.decoder.decoder_pos_embed):
            table.copy_(build_2d_sinusoidal_position_embedding(4, 4, table.shape[-1], cls_token=True)[None])
    tmpl = templates(4, 3, 16)

    def batch(g: torch.Generator, n: int) -> Batch:
        x, _ = images(g, tmpl, n, noise=0.1)
        return {"pixel_values": x, "noise": torch.rand(n, 16, generator=g)}

    gen = torch.Generator().manual_seed(1)
    test = held_out(lambda g: batch(g, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    return Setup(model, 200, eval_loss(model, test), hf_step(model, opt, lambda i: batch(gen, 16)), [(model, opt)])


def segformer() -> Setup:
    """SegFormer (2 stages of overlapping patch embeddings and efficient attention with a spatial reduction of 2
    in the first, Mix-FFN's depthwise convolution, stochastic depth 0.1; an all-MLP decode head) semantic
    segmentation: each 16x16 image is 4 quadrants, each one of 3 classes' textures plus noise, the labels the
    per-pixel class; the model's own loss (logits upsampled to the labels), AdamW 2e-3. Healthy: cross-entropy
    falls (train, held-out)."""
    from transformers import SegformerConfig, SegformerForSemanticSegmentation

    cfg = SegformerConfig(
        num_channels=3, num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32],
        patch_sizes=[3, 3], strides=[2, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2], decoder_hidden_size=32,
        num_labels=3,
    )  # fmt: skip
    model = SegformerForSemanticSegmentation(cfg)
    tmpl = templates(3, 3, 8)

    def batch(g: torch.Generator, n: int) -> Batch:
        y = torch.randint(0, 3, (n, 2, 2), generator=g)
        x = torch.cat([torch.cat([tmpl[y[:, r, c]] for c in range(2)], 3) for r in range(2)], 2)
        labels = y.repeat_interleave(8, 1).repeat_interleave(8, 2)
        return {"pixel_values": x + 0.5 * torch.randn(x.shape, generator=g), "labels": labels}

    gen = torch.Generator().manual_seed(1)
    test = held_out(lambda g: batch(g, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    return Setup(model, 120, eval_loss(model, test), hf_step(model, opt, lambda i: batch(gen, 16)), [(model, opt)])


def audio_spectrogram_transformer() -> Setup:
    """Audio Spectrogram Transformer (2 layers, d=32: 8x8 patches of a 32-frame, 32-bin spectrogram with stride 8,
    a CLS and a distillation token averaged for the head) audio classification: each class is a band of 4 bins
    lit at a random onset, on noise; AdamW 1e-3, hand-written loop. Healthy: cross-entropy falls (train,
    held-out)."""
    from transformers import ASTConfig, ASTForAudioClassification

    cfg = ASTConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, patch_size=8,
        frequency_stride=8, time_stride=8, max_length=32, num_mel_bins=32, num_labels=4,
    )  # fmt: skip
    model = ASTForAudioClassification(cfg)

    def batch(g: torch.Generator, n: int) -> Batch:
        y = torch.randint(0, 4, (n,), generator=g)
        onset = torch.randint(0, 16, (n,), generator=g)
        frames = torch.arange(32)[None, :, None]
        bins = torch.arange(32)[None, None, :]
        band = (bins // 8 == y[:, None, None]) & (bins % 8 < 4) & (frames >= onset[:, None, None])
        return {"input_values": band.float() + 0.5 * torch.randn(n, 32, 32, generator=g), "labels": y}

    gen = torch.Generator().manual_seed(1)
    test = held_out(lambda g: batch(g, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return Setup(model, 120, eval_loss(model, test), hf_step(model, opt, lambda i: batch(gen, 16)), [(model, opt)])


def dit() -> Setup:
    """diffusers' DiT (`DiTTransformer2DModel`, 2 blocks, d=32, 2x2 patches of 8x8 one-channel images; adaLN-Zero:
    each block's LayerNorm has no affine weights, its shift, scale and gate come from the timestep and class
    embeddings) trained as a class-conditional DDPM (noise added by `DDPMScheduler.add_noise`, MSE on the
    predicted noise), AdamW 1e-3. Healthy: the noise-prediction MSE falls (train, held-out triples)."""
    from diffusers import DDPMScheduler, DiTTransformer2DModel

    model = DiTTransformer2DModel(
        num_attention_heads=2, attention_head_dim=16, in_channels=1, num_layers=2, sample_size=8, patch_size=2,
        num_embeds_ada_norm=4,
    )  # fmt: skip
    sched = DDPMScheduler(num_train_timesteps=100)
    tmpl = templates(4, 1, 8)

    def batch(g: torch.Generator, n: int) -> tuple[torch.Tensor, ...]:
        y = torch.randint(0, 4, (n,), generator=g)
        noise = torch.randn(n, 1, 8, 8, generator=g)
        t = torch.randint(0, 100, (n,), generator=g)
        return sched.add_noise(tmpl[y], noise, t), noise, t, y

    def loss_of(b: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return F.mse_loss(model(b[0], timestep=b[2], class_labels=b[3]).sample, b[1])

    gen = torch.Generator().manual_seed(1)
    test = held_out(lambda g: batch(g, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return _plain(model, opt, lambda i: loss_of(batch(gen, 16)), 150, lambda: loss_of(test), clip=1.0)


class VQVAE(nn.Module):
    """A VQ-VAE (van den Oord et al.): a conv encoder to a 4x4 grid of 8-d latents, a 32-entry codebook chosen by
    nearest neighbour, the straight-through estimator (the decoder's gradient copied to the encoder), a conv
    decoder; the loss is reconstruction + codebook (codes pulled to the encodings) + 0.25 x commitment."""

    def __init__(self, codes: int = 32, dim: int = 8) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Conv2d(1, 16, 4, 2, 1), nn.ReLU(), nn.Conv2d(16, dim, 3, 1, 1))
        self.codebook = nn.Embedding(codes, dim)
        nn.init.uniform_(self.codebook.weight, -1 / codes, 1 / codes)
        self.decoder = nn.Sequential(nn.Conv2d(dim, 16, 3, 1, 1), nn.ReLU(), nn.ConvTranspose2d(16, 1, 4, 2, 1))

    def losses(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the training loss, its reconstruction term)"""
        z = self.encoder(x).permute(0, 2, 3, 1)
        with torch.no_grad():
            idx = torch.cdist(z.reshape(-1, z.shape[-1]), self.codebook.weight).argmin(1)
        q = self.codebook(idx).view(z.shape)
        codebook = F.mse_loss(q, z.detach())
        commitment = F.mse_loss(z, q.detach())
        st = z + (q - z).detach()
        recon = F.mse_loss(self.decoder(st.permute(0, 3, 1, 2)), x)
        return recon + codebook + 0.25 * commitment, recon


def vqvae() -> Setup:
    """A hand-written VQ-VAE (`VQVAE`) on 8x8 one-channel images of 8 smooth patterns plus light noise, Adam 2e-3.
    The metric is the reconstruction MSE (the VQ-VAE's measure of quality): the summed loss first rises while the
    encoder's latents grow away from the small initial codebook and the codebook term chases them. Healthy: the
    reconstruction MSE falls (train, held-out); a codebook entry is updated only on steps whose batch chose it,
    and about half the entries are seldom or never chosen (unused codes: a known, healthy VQ phenomenon)."""
    model = VQVAE()
    tmpl = templates(8, 1, 8)
    gen = torch.Generator().manual_seed(1)
    test = held_out(lambda g: images(g, tmpl, 128, noise=0.1)[0])
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)

    def step(i: int) -> float:
        model.train()
        loss, recon = model.losses(images(gen, tmpl, 32, noise=0.1)[0])
        loss.backward()
        opt.step()
        opt.zero_grad()
        return float(recon.detach())

    return Setup(model, 200, _evaluator(model, lambda: model.losses(test)[1]), step, [(model, opt)])


class RealNVP(nn.Module):
    """A RealNVP normalizing flow (Dinh et al.) on 2-d points: 6 affine coupling layers, alternating which
    coordinate is transformed, each scale (tanh-bounded) and shift from a small tanh MLP of the other coordinate;
    the loss is the exact negative log-likelihood under a standard normal base. (With ReLU in those MLPs, 3-19% of
    each layer's units are dead, most from the first step: a unit fed one coordinate is dead wherever w x + b < 0
    over the data's whole range. gradlog calls that a problem, truly: it is capacity the flow never uses.)"""

    def __init__(self, layers: int = 6, hidden: int = 32) -> None:
        super().__init__()
        self.nets = nn.ModuleList(
            nn.Sequential(nn.Linear(1, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, 2))
            for _ in range(layers)
        )

    def nll(self, x: torch.Tensor) -> torch.Tensor:
        logdet = torch.zeros(x.shape[0])
        for k, net in enumerate(self.nets):
            keep, move = (x[:, :1], x[:, 1:]) if k % 2 == 0 else (x[:, 1:], x[:, :1])
            s, t = net(keep).chunk(2, dim=1)
            s = torch.tanh(s)
            move = move * s.exp() + t
            x = torch.cat([keep, move], 1) if k % 2 == 0 else torch.cat([move, keep], 1)
            logdet = logdet + s.squeeze(1)
        return (0.5 * x.pow(2).sum(1) + math.log(2 * math.pi) - logdet).mean()


def realnvp() -> Setup:
    """RealNVP (`RealNVP`) fitted by maximum likelihood to a ring of radius 4 (noise 0.5), Adam 1e-3.
    Healthy: the negative log-likelihood falls (train, held-out)."""
    model = RealNVP()

    def ring(g: torch.Generator, n: int) -> torch.Tensor:
        a = 2 * math.pi * torch.rand(n, generator=g)
        r = 4 + 0.5 * torch.randn(n, generator=g)
        return torch.stack([r * a.cos(), r * a.sin()], 1)

    gen = torch.Generator().manual_seed(1)
    test = held_out(lambda g: ring(g, 1024))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return _plain(model, opt, lambda i: model.nll(ring(gen, 128)), 300, lambda: model.nll(test))


def informer() -> Setup:
    """Informer (2 encoder layers with ProbSparse self-attention: only the top queries by a sampled sparsity
    measure attend, the rest take the mean of the values; a distilling convolution with max-pooling between
    encoder layers; 1 decoder layer; a Student-t distribution head) forecasting the next 8 steps of a noisy sine
    from 16 steps of context and lags 1-3, with a time feature; its own loss (the Student-t negative
    log-likelihood), AdamW 2e-3, hand-written loop. Healthy: the NLL falls (train, held-out). The value
    projections' input feature 3 is log1p(|loc|), and the default mean scaling's loc is always 0: that column has
    nothing to learn from, by design (notes; it read as dead units, a problem, before the fix); the sinusoidal
    position tables are frozen by the model (notes)."""
    from transformers import InformerConfig, InformerForPrediction

    cfg = InformerConfig(
        prediction_length=8, context_length=16, input_size=1, lags_sequence=[1, 2, 3], num_time_features=1,
        d_model=16, encoder_layers=2, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=32, decoder_ffn_dim=32, attention_type="prob", sampling_factor=2, distil=True, dropout=0.0,
        encoder_layerdrop=0.0, decoder_layerdrop=0.0, attention_dropout=0.0, activation_dropout=0.0,
    )  # fmt: skip
    return _forecast(InformerForPrediction(cfg))


def noisy_sines(g: torch.Generator, n: int, past: int = 19, length: int = 27) -> Batch:
    """A forecasting batch for transformers' time-series models: noisy sines (random frequency and phase, level 2)
    with one time feature; `past` steps of context (the context length plus the largest lag), the rest future."""
    freq = 0.2 + 0.6 * torch.rand(n, 1, generator=g)
    phase = 2 * math.pi * torch.rand(n, 1, generator=g)
    t = torch.arange(length, dtype=torch.float32)[None]
    y = 2 + torch.sin(freq * t + phase) + 0.3 * torch.randn(n, length, generator=g)
    when = (t / length).expand(n, length)[..., None]
    return {"past_values": y[:, :past], "past_time_features": when[:, :past], "past_observed_mask":
            torch.ones(n, past), "future_values": y[:, past:], "future_time_features": when[:, past:]}  # fmt: skip


def _forecast(model: nn.Module, steps: int = 150, lr: float = 2e-3) -> Setup:
    """A forecaster trained on `noisy_sines` (batches of 16) by its own loss, AdamW, in the hand-written HF loop."""
    gen = torch.Generator().manual_seed(1)
    test = held_out(lambda g: noisy_sines(g, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    return Setup(
        model, steps, eval_loss(model, test), hf_step(model, opt, lambda i: noisy_sines(gen, 16)), [(model, opt)]
    )


#: every family, cheapest first: the first `FAST` run in the default test run, the rest are heavy
FAMILIES: list[Callable[[], Setup]] = [
    recommender_sparse,
    layerdrop,
    actor_critic,
    gcn,
    vae,
    gan,
    cnn_bn,
    ema_teacher,
    simsiam,
    lstm_lm,
    llrd,
    gpt2,
    llama_trainer,
    mixtral,
    qwen2_moe,
    mamba,
    bert_mlm,
    roberta_mlm_trainer,
    distilbert_cls_trainer,
    t5,
    bart,
    vit_trainer,
    convnext,
    swin,
    resnet_hf,
    wav2vec2_trainer,
    whisper_trainer,
    clip,
    siglip,
    unet2d,
    # the second round (issue 38): new mechanisms
    weight_norm_mlp,
    frozen_bn_finetune,
    spectral_norm_cnn,
    neumf_two_optimizers,
    compiled_mlp,
    cosine_warmup,
    gradual_unfreeze,
    accumulate_bf16_onecycle,
    albert_mlm,
    deberta_v2_cls,
    electra,
    pythia,
    bloom,
    gemma,
    patchtst,
    adafactor_t5,
    bitfit_bert,
    lion_checkpointed_gpt2,
    # the third round (zoo4)
    deepseek_v3,
    qwen3_moe,
    gpt_oss,
    jamba,
    opt,
    rwkv,
    modernbert_mlm,
    switch_transformers,
    vit_mae,
    segformer,
    audio_spectrogram_transformer,
    dit,
    vqvae,
    realnvp,
    informer,
]
FAST = 7


def main(argv: list[str], families: list[Callable[[], Setup]] | None = None) -> None:
    """`python tests/zoo.py [family,...]`: run the families (all by default) at every=5 and at the default
    `every`, one JSON line each: the health evidence, each logger's verdict and every finding (severity, kind,
    tensor, detail), the raw material of docs/verdict.md's table."""
    import json
    import time

    chosen = [f for f in families or FAMILIES if not argv or f.__name__ in argv[0].split(",")]
    for family in chosen:
        for every in (5, None):
            start = time.perf_counter()
            o = run(family, every)
            line = {
                "family": o.family,
                "every": every,
                "steps": o.steps,
                "seconds": round(time.perf_counter() - start, 1),
                "healthy": o.healthy,
                "evidence": o.evidence(),
                "unchanged": o.unchanged,
                "verdicts": [r.verdict for r in o.reports],
                "findings": [f for r in o.reports for f in findings(r)],
            }
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
