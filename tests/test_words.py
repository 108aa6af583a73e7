"""The words of the notes, on real Hugging Face models built from tiny configs (no downloads): each note says
what its rows are (positions, relative-position buckets, ids), in the right number, and only what holds for
the run; the verdict line counts findings so the numbers add up. References are independent of gradlog: a
copy of the initial weights (which rows truly never changed) and the model's own bucket function."""

from __future__ import annotations

from collections.abc import Callable

import catalogue
import pytest
import torch
from torch import nn

import gradlog
from gradlog import Reason

transformers = pytest.importorskip("transformers")

VOCAB, POSITIONS, SEQ, SEEN_IDS = 64, 32, 24, 40


def run(model: nn.Module, loss: Callable[[int], torch.Tensor], steps: int = 3) -> gradlog.Report:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)  # no decay: unused rows stay exact
    gl = gradlog.GradLogger(model, opt, writer="memory", every=1, print_report=False)
    catalogue.train(opt, gl, steps, loss)
    return gl.close()


def unchanged_rows(before: torch.Tensor, after: torch.Tensor) -> list[int]:
    return [i for i in range(before.shape[0]) if torch.equal(before[i], after[i])]


def test_a_masked_lm_says_positions_without_claiming_its_labels_are_its_inputs() -> None:
    """BERT trained as a masked LM on 24-token sequences of a 32-position table, one token type of two, ids
    1..39 of 64 (0 is the padding row). The position note states the longest sequence (24) and names the
    causal-LM case only as a possibility; the token-type note is singular ("id 1 (1 of 2) was"); the word
    embedding's two records (padding row, unseen ids) are counted as records of one tensor."""
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=POSITIONS,
        type_vocab_size=2,
        pad_token_id=0,
        tie_word_embeddings=False,  # tied, the output layer's softmax reaches every row
    )
    model = transformers.BertForMaskedLM(cfg)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}

    def loss(step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(1, SEEN_IDS, (4, SEQ), generator=g)
        labels = torch.full_like(ids, -100)
        masked = torch.rand(ids.shape, generator=g) < 0.3
        labels[masked] = ids[masked]
        out: torch.Tensor = model(input_ids=ids.masked_fill(masked, 3), labels=labels).loss
        return out

    report = run(model, loss)
    after = dict(model.named_parameters())
    by = {(p.name, p.reason): p for p in report.partly_updated}

    pos_name = "bert.embeddings.position_embeddings.weight"
    pos = by[(pos_name, Reason.NOT_IN_BATCH)]
    assert unchanged_rows(start[pos_name], after[pos_name].detach()) == list(range(SEQ, POSITIONS)) == list(pos.indices)
    assert pos.detail.startswith(
        f"positions {SEQ}-{POSITIONS - 1} (8 of {POSITIONS}) had no gradient in any measured batch: the longest "
        f"sequence seen had {SEQ} positions ({SEQ + 1} if this is a causal LM whose labels are its inputs"
    )
    assert "when labels are the inputs" not in pos.detail and "no batch reached past" not in pos.detail

    types_name = "bert.embeddings.token_type_embeddings.weight"
    types = by[(types_name, Reason.NOT_IN_BATCH)]
    assert unchanged_rows(start[types_name], after[types_name].detach()) == [1] == list(types.indices)
    assert types.detail.startswith("id 1 (1 of 2) was in no measured batch: row 1 (1 of 2) never changed")

    words_name = "bert.embeddings.word_embeddings.weight"
    unseen = by[(words_name, Reason.NOT_IN_BATCH)]
    assert [0, *unseen.indices] == unchanged_rows(start[words_name], after[words_name].detach())
    assert unseen.detail.startswith(f"ids {SEEN_IDS}, {SEEN_IDS + 1}, ")
    assert by[(words_name, Reason.PADDING_IDX)].indices == (0,)
    # 3 tensors, 4 records (the word embedding has two): the line counts records where they differ
    assert len(report.partly_updated) == 4
    assert "3 tensors partly never updated (4 causes: padding_idx 1, not_in_batch 3)" in report.verdict


def test_t5_relative_position_buckets_are_buckets_not_ids() -> None:
    """T5's relative_attention_bias is an nn.Embedding used as a table of distance buckets: on 6-token inputs
    and 4-token targets most buckets are never used. The note calls them relative-position buckets, never
    "ids ... in no measured batch"; which buckets, from T5's own bucket function."""
    torch.manual_seed(0)
    cfg = transformers.T5Config(
        vocab_size=VOCAB,
        d_model=16,
        d_kv=8,
        d_ff=32,
        num_layers=1,
        num_decoder_layers=1,
        num_heads=2,
        relative_attention_num_buckets=32,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    model = transformers.T5ForConditionalGeneration(cfg)
    src, tgt = 6, 4
    name = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    start = model.get_parameter(name).detach().clone()

    def loss(step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(step)
        x = torch.randint(1, VOCAB, (4, src), generator=g)
        y = torch.randint(1, VOCAB, (4, tgt), generator=g)
        out: torch.Tensor = model(input_ids=x, labels=y).loss
        return out

    report = run(model, loss)
    # the reference: the buckets T5 computes for every query-key distance of a 6-token input
    distance = torch.arange(src)[None, :] - torch.arange(src)[:, None]
    bucket = transformers.models.t5.modeling_t5.T5Attention._relative_position_bucket
    used = set(bucket(distance, bidirectional=True, num_buckets=32, max_distance=128).unique().tolist())
    never = [i for i in range(32) if i not in used]
    assert unchanged_rows(start, model.get_parameter(name).detach()) == never
    (rec,) = [p for p in report.partly_updated if p.name == name]
    assert list(rec.indices) == never and rec.reason == Reason.NOT_IN_BATCH
    shown = ", ".join(map(str, never[:5]))
    assert rec.detail.startswith(
        f"relative-position buckets {shown}, ... ({len(never)} of 32) were used by no query-key pair of any "
        "measured batch"
    ), rec.detail
    assert "ids" not in rec.detail and "in no measured batch" not in rec.detail
