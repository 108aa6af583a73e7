"""The calibration zoo's fourth round (zoo5): healthy families chosen for a mechanism the first three rounds lack,
built, trained and judged exactly as tests/zoo.py's (its `Setup`, `run`, data and loops; see its docstring).

Mechanisms: activations recomputed in the backward pass (Reformer's reversible layers) and hashed attention
buckets; token mixing with no attention weights (FNet's Fourier transform); a latent array reading the input by
cross-attention (Perceiver); hash embeddings whose buckets most ids never hit (CANINE); two-stream attention
whose query stream starts from a learned mask embedding (XLNet); block-sparse attention with random blocks drawn
each forward (BigBird); zero-initialised GRN gains (ConvNeXt-V2); layer scale and a pre-training-only mask
token (DINOv2); a frozen vision tower with a trained projector (LLaVA); fixed sinusoidal positions (Marian);
and hand-written: a PINN (a loss made of derivatives taken with `create_graph=True`), a hypernetwork (the target
network's weights are outputs, not parameters), a DLRM (eight embedding tables with Zipf-skewed ids).

Where transformers builds a parameter that the trained head never reads (FNet's and BigBird's poolers under
the masked-LM head, CANINE's character-level output path under the [CLS] classifier, DINOv2's `mask_token`,
Reformer's `lm_head.bias`, which no forward reads in transformers 5.25), gradlog calls it `never.no_grad`, a
problem, truly: it is in the optimizer and can never learn, the evidence a layer a forward() forgot gives.
These families freeze it, as gradlog's detail advises (`tests/test_zoo5.py` checks the DINOv2 case unfrozen).

`python tests/zoo5.py [family,...]` prints each run's JSON line (zoo.main), `MEASURED` included.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F
from zoo import (
    FIRST,
    MASK,
    Batch,
    Setup,
    _causal_lm,
    _forecast,
    _mlm,
    _plain,
    _seq2seq,
    _vision,
    counting,
    eval_loss,
    first_half,
    held_out,
    hf_step,
    masked,
    templates,
)


# --- transformers: language ------------------------------------------------------------------------------------
def reformer() -> Setup:
    """Reformer (4 reversible layers alternating local and LSH attention: 4 hash buckets, chunks of 4; axial
    position embeddings 4x4; activations recomputed in the backward pass, not stored) causal LM with
    labels=input_ids, AdamW 2e-3. Healthy: LM loss (train, held-out) falls. Not the same run twice: in training
    its layers re-seed the global generator from `torch.seed()` every forward (dropout replayed in the backward),
    so the losses vary from run to run (last 10 steps 2.0-2.2, gradlog or not), always far past the margin."""
    from transformers import ReformerConfig, ReformerModelWithLMHead

    cfg = ReformerConfig(
        vocab_size=64, hidden_size=32, attention_head_size=8, num_attention_heads=4, feed_forward_size=64,
        attn_layers=["local", "lsh", "local", "lsh"], axial_pos_shape=[4, 4], axial_pos_embds_dim=[16, 16],
        max_position_embeddings=16, local_attn_chunk_length=4, lsh_attn_chunk_length=4, num_buckets=4, num_hashes=1,
        is_decoder=True, pad_token_id=0, eos_token_id=1, hash_seed=None,
    )  # fmt: skip
    model = ReformerModelWithLMHead(cfg)
    model.lm_head.bias.requires_grad_(False)  # no forward reads it in transformers 5.25 (the module docstring)
    return _causal_lm(model, 64, 150, lr=2e-3)


def fnet_mlm() -> Setup:
    """FNet (2 layers, d=32: each layer mixes tokens by the real part of a 2-d FFT, no attention weights at all)
    masked LM as BERT's, AdamW 1e-3. Healthy: masked-LM loss falls (train, held-out)."""
    from transformers import FNetConfig, FNetForMaskedLM

    cfg = FNetConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, intermediate_size=64, max_position_embeddings=16,
        type_vocab_size=2, pad_token_id=0,
    )  # fmt: skip
    model = FNetForMaskedLM(cfg)
    model.fnet.pooler.requires_grad_(False)  # the masked-LM head never reads the pooled output
    return _mlm(model)


def _classify(model: nn.Module, steps: int, vocab: int = 64, first: int = FIRST, length: int = 16,
              lr: float = 1e-3, offset: int = 0) -> Setup:  # fmt: skip
    """Sequence classification (is the first id of a counting stream over first..vocab-1 in the lower half?),
    batches of 16, AdamW, the hand-written HF loop; `offset` shifts every id (CANINE reads Unicode code points)."""
    gen = torch.Generator().manual_seed(1)

    def batch(g: torch.Generator, n: int) -> Batch:
        ids, _ = counting(g, n, length, vocab, first)
        return {"input_ids": ids + offset, "labels": first_half(ids, first, vocab)}

    test = held_out(lambda g: batch(g, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    return Setup(model, steps, eval_loss(model, test), hf_step(model, opt, lambda i: batch(gen, 16)), [(model, opt)])


def funnel_cls() -> Setup:
    """Funnel Transformer (2 blocks of 1 layer: the second block's queries mean-pooled to half the sequence, the
    [CLS] position kept apart; relative-shift attention) sequence classification, AdamW 1e-3.
    Healthy: cross-entropy falls (train, held-out). Measured, not asserted: the last layer's relative-position
    and segment terms (`r_kernel`, `r_r_bias`, `r_s_bias`, `seg_embed`) get an exactly zero gradient, truly (the
    classifier reads the [CLS] query only, and Funnel masks those terms out of the [CLS] row: `cls_mask`), a
    problem; and the first layer's `seg_embed` row for a segment pair the one-segment data never has is called
    zero-gradient rows (problem) where it is a category no batch held."""
    from transformers import FunnelConfig, FunnelForSequenceClassification

    cfg = FunnelConfig(
        vocab_size=64, block_sizes=[1, 1], num_decoder_layers=1, d_model=32, n_head=2, d_head=16, d_inner=64,
        num_labels=2,
    )  # fmt: skip
    return _classify(FunnelForSequenceClassification(cfg), 150)


def canine_cls() -> Setup:
    """CANINE-s (characters as Unicode code points, each embedded by 4 hash functions into 64 buckets per hash,
    a local transformer, strided convolution downsampling by 4, 2 deep layers, upsampling) sequence
    classification of lower-case letter streams, AdamW 1e-3. Healthy: cross-entropy falls (train, held-out)."""
    from transformers import CanineConfig, CanineForSequenceClassification

    cfg = CanineConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, max_position_embeddings=64,
        type_vocab_size=2, downsampling_rate=4, upsampling_kernel_size=4, num_hash_functions=4, num_hash_buckets=256,
        local_transformer_stride=4, num_labels=2,
    )  # fmt: skip
    model = CanineForSequenceClassification(cfg)
    model.canine.projection.requires_grad_(False)  # the character-level output path: the [CLS] head never reads it
    model.canine.final_char_encoder.requires_grad_(False)
    return _classify(model, 150, vocab=26, first=0, offset=ord("a"))


def perceiver_cls() -> Setup:
    """Perceiver IO (8 latents of d=32 read the 16 embedded tokens by one cross-attention, then 2 latent
    self-attention layers; a classification decoder with one learned query) sequence classification, AdamW 1e-3.
    Healthy: cross-entropy falls (train, held-out)."""
    from transformers import PerceiverConfig, PerceiverForSequenceClassification

    cfg = PerceiverConfig(
        num_latents=8, d_latents=32, d_model=32, num_blocks=1, num_self_attends_per_block=2,
        num_self_attention_heads=2, num_cross_attention_heads=1, vocab_size=64, max_position_embeddings=16,
        num_labels=2,
    )  # fmt: skip
    return _classify(PerceiverForSequenceClassification(cfg), 150)


def xlnet_plm() -> Setup:
    """XLNet (2 layers, d=32, relative positions and segments) trained as its docs show for permutation language
    modelling: `perm_mask` hides the last 4 positions from every token, `target_mapping` asks for them, so the
    query stream (started from the learned `mask_emb`) predicts them with two-stream attention; two segments
    of 8 (as its pre-training pairs them), so both rows of `seg_embed` (same / different segment) learn.
    AdamW 1e-3. Healthy: the PLM loss falls (train, held-out)."""
    from transformers import XLNetConfig, XLNetLMHeadModel

    cfg = XLNetConfig(vocab_size=64, d_model=32, n_layer=2, n_head=2, d_inner=64, pad_token_id=0)
    model = XLNetLMHeadModel(cfg)
    length, hidden = 16, 4

    def batch(g: torch.Generator, n: int) -> Batch:
        ids, _ = counting(g, n, length, 64, FIRST)
        perm = torch.zeros(n, length, length)
        perm[:, :, -hidden:] = 1.0
        target = torch.zeros(n, hidden, length)
        target[:, torch.arange(hidden), torch.arange(length - hidden, length)] = 1.0
        return {"input_ids": ids, "perm_mask": perm, "target_mapping": target,
                "token_type_ids": (torch.arange(length) >= length // 2).long().expand(n, length),
                "labels": ids[:, -hidden:].contiguous()}  # fmt: skip

    gen = torch.Generator().manual_seed(1)
    test = held_out(lambda g: batch(g, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return Setup(model, 150, eval_loss(model, test), hf_step(model, opt, lambda i: batch(gen, 16)), [(model, opt)])


def bigbird_mlm() -> Setup:
    """BigBird (2 layers, d=32) masked LM with block-sparse attention on 64-token sequences: blocks of 4, each
    attending to its sliding window, 2 random blocks drawn anew each forward, and the global first and last
    blocks. BERT's masking, AdamW 1e-3. Healthy: masked-LM loss falls (train, held-out)."""
    from transformers import BigBirdConfig, BigBirdForMaskedLM

    cfg = BigBirdConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64, attention_type="block_sparse", block_size=4, num_random_blocks=2, sep_token_id=3,
    )  # fmt: skip
    model = BigBirdForMaskedLM(cfg)
    model.bert.pooler.requires_grad_(False)  # the masked-LM head never reads the pooled output

    def batch(g: torch.Generator, n: int) -> Batch:
        ids, _ = counting(g, n, 64, FIRST + 16, FIRST)
        inputs, labels = masked(g, ids, MASK, FIRST, FIRST + 16)
        return {"input_ids": inputs, "labels": labels}

    gen = torch.Generator().manual_seed(1)
    test = held_out(lambda g: batch(g, 32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return Setup(model, 150, eval_loss(model, test), hf_step(model, opt, lambda i: batch(gen, 8)), [(model, opt)])


def marian() -> Setup:
    """Marian (1+1 layers, d=32, fixed sinusoidal positions, scaled embeddings shared by encoder, decoder and the
    output layer) with labels, continuing a counting stream, AdamW 1e-2 (at 1e-3 its loss fell 2% in 150 steps).
    Healthy: seq2seq loss falls (train, held-out); the position tables are frozen by the model (notes)."""
    from transformers import MarianConfig, MarianMTModel

    cfg = MarianConfig(
        vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
        pad_token_id=0, decoder_start_token_id=0, eos_token_id=1, share_encoder_decoder_embeddings=True,
    )  # fmt: skip
    return _seq2seq(MarianMTModel(cfg), 150, lr=1e-2)


# --- transformers: vision, multimodal, time series ----------------------------------------------------------------
def convnext_v2() -> Setup:
    """ConvNeXt-V2 (2 stages; every block's Global Response Normalization has gamma and beta initialised to zero,
    so it starts as the identity) image classification, AdamW 1e-3. Healthy: cross-entropy falls; GRN learns."""
    from transformers import ConvNextV2Config, ConvNextV2ForImageClassification

    cfg = ConvNextV2Config(
        num_channels=3, patch_size=2, hidden_sizes=[16, 32], depths=[1, 1], num_stages=2, num_labels=4
    )
    return _vision(ConvNextV2ForImageClassification(cfg), 120)


def dinov2() -> Setup:
    """DINOv2 (2 layers, d=32, 4x4 patches, layer scale on both residual branches; the classifier reads the [CLS]
    state and the patches' mean) fine-tuned for image classification, AdamW 1e-3. Its `mask_token`, used only by
    masked-image pre-training, is frozen as fine-tuning recipes leave it out. Healthy: cross-entropy falls."""
    from transformers import Dinov2Config, Dinov2ForImageClassification

    cfg = Dinov2Config(
        image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        mlp_ratio=2, num_labels=4,
    )  # fmt: skip
    model = Dinov2ForImageClassification(cfg)
    model.dinov2.embeddings.mask_token.requires_grad_(False)  # read only with bool_masked_pos (pre-training)
    return _vision(model, 120)


def llava() -> Setup:
    """LLaVA (a CLIP vision tower of 2 layers on 16x16 images, 16 patch features from its second-to-last layer,
    a 2-layer GELU projector into a 2-layer Llama) trained as LLaVA's instruction tuning: the vision tower frozen,
    projector and language model trained, labels the text ids (-100 on the 16 image tokens). The text counts up
    from a start the image's class sets, so the model must read the image. AdamW 1e-3.
    Healthy: the LM loss falls (train, held-out); every trainable tensor changes; the tower is listed frozen."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    image = 63
    cfg = LlavaConfig(
        vision_config=CLIPVisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=16,
            patch_size=4, projection_dim=32,
        ),
        text_config=LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
        ),
        image_token_index=image, image_seq_length=16, vision_feature_layer=-2,
    )  # fmt: skip
    model = LlavaForConditionalGeneration(cfg)
    model.model.vision_tower.requires_grad_(False)
    tmpl = templates(4, 3, 16)

    def batch(g: torch.Generator, n: int) -> Batch:
        y = torch.randint(0, 4, (n,), generator=g)
        pixels = tmpl[y] + 0.5 * torch.randn(n, 3, 16, 16, generator=g)
        text = FIRST + (12 * y[:, None] + torch.arange(8)) % 56
        ids = torch.cat([torch.full((n, 16), image), text], 1)
        labels = torch.cat([torch.full((n, 16), -100), text], 1)
        return {"input_ids": ids, "pixel_values": pixels, "labels": labels}

    gen = torch.Generator().manual_seed(1)
    test = held_out(lambda g: batch(g, 64))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3)
    return Setup(model, 120, eval_loss(model, test), hf_step(model, opt, lambda i: batch(gen, 16)), [(model, opt)])


def autoformer() -> Setup:
    """Autoformer (series decomposition by moving average in every layer, auto-correlation found by FFT in place
    of attention: the top lags' rolled values aggregated; 2 encoder and 1 decoder layers, d=16; a Student-t head)
    forecasting noisy sines as Informer does, AdamW 2e-3. Healthy: the NLL falls (train, held-out). Measured, not
    asserted: at every=5, `update_ratio_low` warnings at step 10 on encoder query/key projections, whose only way
    to the loss is the softmax weight of the top-k lags the correlation picks: their gradient starts below Adam's
    eps, and their updates reach their peers' by step ~20 (a true transient; docs/verdict.md)."""
    from transformers import AutoformerConfig, AutoformerForPrediction

    cfg = AutoformerConfig(
        prediction_length=8, context_length=16, input_size=1, lags_sequence=[1, 2, 3], num_time_features=1,
        d_model=16, encoder_layers=2, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=32, decoder_ffn_dim=32, dropout=0.0, encoder_layerdrop=0.0, decoder_layerdrop=0.0,
        attention_dropout=0.0, activation_dropout=0.0, moving_average=5, autocorrelation_factor=2, label_length=8,
    )  # fmt: skip
    return _forecast(AutoformerForPrediction(cfg))


# --- hand-written PyTorch ----------------------------------------------------------------------------------------
def pinn() -> Setup:
    """A physics-informed network (Raissi et al.) for u'' = -pi^2 sin(pi x) on [0, 1] with u(0) = u(1) = 0: a
    tanh MLP u(x) whose loss is the squared residual of the equation at 64 random collocation points, u'' taken
    by two `torch.autograd.grad(create_graph=True)` calls (so the weights' gradient flows through derivatives),
    plus the boundary terms; Adam 2e-3. Healthy (gradlog-free): the loss falls, and so does the error against
    the exact solution sin(pi x) on a fixed grid."""
    model = nn.Sequential(nn.Linear(1, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    gen = torch.Generator().manual_seed(1)
    ends = torch.tensor([[0.0], [1.0]])
    grid = torch.linspace(0, 1, 101)[:, None]

    def loss(i: int) -> torch.Tensor:
        x = torch.rand(64, 1, generator=gen).requires_grad_(True)
        u = model(x)
        (du,) = torch.autograd.grad(u.sum(), x, create_graph=True)
        (d2u,) = torch.autograd.grad(du.sum(), x, create_graph=True)
        residual = d2u + math.pi**2 * torch.sin(math.pi * x)
        return residual.pow(2).mean() + 10 * model(ends).pow(2).mean()

    return _plain(model, opt, loss, 300, lambda: (model(grid) - torch.sin(math.pi * grid)).pow(2).mean())


class HyperNetwork(nn.Module):
    """A hypernetwork (Ha et al.): a learned embedding per task, an MLP that maps it to every weight and bias of a
    small target MLP, which is applied functionally (`F.linear`): the target's weights are outputs, not parameters."""

    def __init__(self, tasks: int = 8, dim: int = 4, hidden: int = 16, z: int = 8) -> None:
        super().__init__()
        self.dim, self.hidden = dim, hidden
        self.tasks = nn.Embedding(tasks, z)
        sizes = hidden * dim + hidden + hidden + 1
        self.generator = nn.Sequential(nn.Linear(z, 64), nn.ReLU(), nn.Linear(64, sizes))

    def forward(self, task: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        theta = self.generator(self.tasks(task))
        d, h = self.dim, self.hidden
        w1, b1, w2, b2 = theta.split([h * d, h, h, 1], dim=-1)
        hid = torch.tanh(torch.einsum("bhd,bnd->bnh", w1.view(-1, h, d), x) + b1[:, None])
        return torch.einsum("bh,bnh->bn", w2, hid) + b2  # type: ignore[no-any-return]


def hypernetwork() -> Setup:
    """`HyperNetwork` fitting 8 regression tasks (each y = sin of its own random projection of x), a batch of 8
    tasks x 32 points, Adam 1e-3. Healthy: the MSE falls (train, held-out points of every task)."""
    model = HyperNetwork()
    proj = torch.randn(8, 4, generator=torch.Generator().manual_seed(7))

    def batch(g: torch.Generator, n: int) -> tuple[torch.Tensor, ...]:
        task = torch.randint(0, 8, (8,), generator=g)
        x = torch.randn(8, n, 4, generator=g)
        return task, x, torch.sin(torch.einsum("bnd,bd->bn", x, proj[task]))

    gen = torch.Generator().manual_seed(1)
    test = held_out(lambda g: (torch.arange(8), x := torch.randn(8, 64, 4, generator=g),
                               torch.sin(torch.einsum("bnd,bd->bn", x, proj))))  # fmt: skip
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def mse(b: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return F.mse_loss(model(b[0], b[1]), b[2])

    return _plain(model, opt, lambda i: mse(batch(gen, 32)), 200, lambda: mse(test))


class DLRM(nn.Module):
    """A DLRM (Naumov et al.) in small: a bottom MLP for 4 dense features, one embedding table per categorical
    feature (8 tables, 10 to 5,000 rows, d=8), the pairwise dot products of all nine vectors, a top MLP."""

    def __init__(self, sizes: list[int], dim: int = 8) -> None:
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, dim), nn.ReLU())
        self.tables = nn.ModuleList(nn.Embedding(n, dim) for n in sizes)
        pairs = (len(sizes) + 1) * len(sizes) // 2
        self.top = nn.Sequential(nn.Linear(pairs + dim, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, dense: torch.Tensor, cats: torch.Tensor) -> torch.Tensor:
        d = self.bottom(dense)
        vecs = torch.stack([d, *(t(cats[:, k]) for k, t in enumerate(self.tables))], 1)
        dots = vecs @ vecs.transpose(1, 2)
        i, j = torch.triu_indices(vecs.shape[1], vecs.shape[1], offset=1)
        return self.top(torch.cat([d, dots[:, i, j]], 1)).squeeze(1)  # type: ignore[no-any-return]


def dlrm() -> Setup:
    """`DLRM` on synthetic clicks: each categorical id drawn Zipf-like (p ~ 1/rank^1.1, so a big table's tail is
    seldom or never hit), the click a Bernoulli of a hidden logistic model of per-id scores and the dense
    features; batches of 128, BCE, Adam 1e-2 (dense, every table in one optimizer).
    Healthy: BCE falls (train, held-out); every table's weight changes."""
    sizes = [10, 20, 50, 100, 200, 500, 1000, 5000]
    model = DLRM(sizes)
    hidden = torch.Generator().manual_seed(7)
    scores = [2 * torch.randn(n, generator=hidden) for n in sizes]
    wdense = torch.randn(4, generator=hidden)
    zipf = [(1 / torch.arange(1, n + 1).float() ** 1.1) for n in sizes]

    def batch(g: torch.Generator, n: int) -> tuple[torch.Tensor, ...]:
        dense = torch.randn(n, 4, generator=g)
        cats = torch.stack([torch.multinomial(p, n, replacement=True, generator=g) for p in zipf], 1)
        logit = dense @ wdense + sum(s[cats[:, k]] for k, s in enumerate(scores)) / 2
        return dense, cats, torch.bernoulli(torch.sigmoid(logit), generator=g)

    def bce(b: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(model(b[0], b[1]), b[2])

    gen = torch.Generator().manual_seed(1)
    test = held_out(lambda g: batch(g, 2048))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return _plain(model, opt, lambda i: bce(batch(gen, 128)), 200, lambda: bce(test))


#: every asserted family, cheapest first: the first `FAST` run in the default test run, the rest are heavy
FAMILIES: list[Callable[[], Setup]] = [
    pinn,
    hypernetwork,
    dlrm,
    dinov2,
    convnext_v2,
    marian,
    llava,
    fnet_mlm,
    perceiver_cls,
    canine_cls,
    xlnet_plm,
    bigbird_mlm,
    reformer,
]
FAST = 6

#: healthy by the zoo's check, with a finding gradlog makes that is left as it is (docs/verdict.md says why):
#: measured by `python tests/zoo5.py`, not asserted
MEASURED: list[Callable[[], Setup]] = [funnel_cls, autoformer]


if __name__ == "__main__":
    import sys

    import zoo

    zoo.main(sys.argv[1:], FAMILIES + MEASURED)
