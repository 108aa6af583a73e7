"""Parts of tensors that never learn: planted bugs asserting the exact partly_updated records.

Every expected index set is computed independently of gradlog: from a deep copy of the initial
weights (slices whose values are bit-for-bit the same at the end) or from the gradients the test
itself reads at every step.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import catalogue
import pytest
import torch
from catalogue import Bag, BiasedAttention, DeadFilters, DeadUnits, OddTensors, TinyLM
from torch import nn

import gradlog
from gradlog import Reason
from gradlog.measure import fingerprint as fp
from gradlog.measure.slice_grads import slice_nonzero
from gradlog.verdict.records import format_ranges as ranges

Batch = Callable[[torch.Generator], torch.Tensor]


def run(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    batch: Batch,
    steps: int = 10,
    every: int = 1,
    loss: Callable[[torch.Tensor], torch.Tensor] = lambda out: out.pow(2).mean(),
    spy: Callable[[], None] | None = None,
) -> tuple[gradlog.Report, gradlog.GradLogger, gradlog.MemoryWriter]:
    mem = gradlog.MemoryWriter()
    gl = gradlog.GradLogger(model, opt, writer=mem, every=every, print_report=False)
    gen = torch.Generator().manual_seed(0)
    spy_step = None if spy is None else lambda step: spy()
    report = catalogue.train(opt, gl, steps, lambda step: loss(model(batch(gen))), after_backward=spy_step)
    return report, gl, mem


def records(report: gradlog.Report) -> set[tuple[str, int | None, tuple[int, ...], Reason]]:
    return {(r.name, r.dim, r.indices, r.reason) for r in report.partly_updated}


def unchanged(before: torch.Tensor, after: torch.Tensor, dim: int | None) -> tuple[int, ...]:
    """Reference: slices along `dim` (None: elements) that are bit-for-bit equal."""
    same = before == after
    if dim is None:
        return tuple(same.nonzero().flatten().tolist())
    same = same.movedim(dim, 0).reshape(same.shape[dim], -1).all(1)
    return tuple(same.nonzero().flatten().tolist())


class ZeroGradRows:
    """Reference for slices moved only by weight decay: rows/columns whose gradient the test saw zero at every step."""

    def __init__(self, param: torch.Tensor, dim: int | None) -> None:
        self.param, self.dim = param, dim
        self.ever: torch.Tensor | None = None

    def __call__(self) -> None:
        g = self.param.grad
        assert g is not None
        g = g.to_dense() if g.is_sparse else g
        nz = (g != 0) if self.dim is None else (g != 0).movedim(self.dim, 0).reshape(g.shape[self.dim], -1).any(1)
        self.ever = nz if self.ever is None else self.ever | nz

    @property
    def zero(self) -> tuple[int, ...]:
        assert self.ever is not None
        return tuple((~self.ever).nonzero().flatten().tolist())


# --- planted bugs ---------------------------------------------------------------------------


def first_half(gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 50, (8, 6), generator=gen)


def test_unseen_embedding_ids_dense_never_change() -> None:
    torch.manual_seed(0)
    model = Bag()
    start = copy.deepcopy(model)
    report, _, _ = run(model, torch.optim.Adam(model.parameters(), lr=1e-2), first_half)
    expected = unchanged(start.emb.weight, model.emb.weight, 0)
    assert expected == tuple(range(50, 100))
    assert records(report) == {("emb.weight", 0, expected, Reason.NOT_IN_BATCH)}
    rec = report.partly_updated[0]
    assert (rec.never, rec.total) == (50, 100)
    assert rec.detail.startswith(
        "ids 50, 51, 52, 53, 54, ... (50 of 100) were in no measured batch: rows 50-99 (50 of 100)"
    )
    assert "never changed; zero gradient at all 10 measured steps" in rec.detail
    assert "were in no measured batch" in rec.detail
    assert report.never_updated == []


@pytest.mark.parametrize("opt_name", ["sgd", "sparse_adam"])
def test_unseen_embedding_ids_sparse_never_change(opt_name: str) -> None:
    torch.manual_seed(0)
    model = Bag(sparse=True)
    start = copy.deepcopy(model)
    if opt_name == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        report, _, _ = run(model, opt, first_half)
    else:
        opt = torch.optim.SparseAdam([model.emb.weight], lr=1e-2)
        model.head.requires_grad_(False)  # SparseAdam takes sparse gradients only
        report, _, _ = run(model, opt, first_half)
    expected = unchanged(start.emb.weight, model.emb.weight, 0)
    assert expected == tuple(range(50, 100))
    assert ("emb.weight", 0, expected, Reason.NOT_IN_BATCH) in records(report)
    assert {r.name for r in report.partly_updated} == {"emb.weight"}


@pytest.mark.parametrize("every", [1, 3])
def test_unseen_ids_that_moved_only_by_weight_decay_are_reported(every: int) -> None:
    torch.manual_seed(0)
    model = Bag()
    spy = ZeroGradRows(model.emb.weight, 0)
    report, _, _ = run(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), first_half, 9, every, spy=spy
    )
    assert spy.zero == tuple(range(50, 100))
    assert records(report) == {("emb.weight", 0, spy.zero, Reason.NOT_IN_BATCH)}
    assert "moved only through weight decay (0.1)" in report.partly_updated[0].detail


def normal16(gen: torch.Generator) -> torch.Tensor:
    return torch.randn(32, 16, generator=gen)


def test_dead_units_rows_bias_and_next_columns_exact() -> None:
    torch.manual_seed(0)
    model = DeadUnits()
    start = copy.deepcopy(model)
    report, _, _ = run(model, torch.optim.Adam(model.parameters(), lr=1e-2), normal16)
    rows = unchanged(start.fc1.weight, model.fc1.weight, 0)
    bias = unchanged(start.fc1.bias, model.fc1.bias, None)
    cols = unchanged(start.fc2.weight, model.fc2.weight, 1)
    assert rows == bias == cols == tuple(range(8))
    assert records(report) == {
        ("fc1.weight", 0, rows, Reason.ZERO_GRAD),
        ("fc1.bias", None, bias, Reason.ZERO_GRAD),
        ("fc2.weight", 1, cols, Reason.ZERO_GRAD),
    }
    by = {(r.name, r.dim): r.detail for r in report.partly_updated}
    assert by[("fc1.weight", 0)].startswith("output units 0-7 (8 of 32) never changed; zero gradient at all 10")
    assert "dead units" in by[("fc1.weight", 0)]
    assert by[("fc2.weight", 1)].startswith("input features 0-7 (8 of 32) never changed")


def test_dead_units_under_adamw_moved_only_by_decay() -> None:
    torch.manual_seed(0)
    model = DeadUnits()
    spies = [ZeroGradRows(model.fc1.weight, 0), ZeroGradRows(model.fc1.bias, None), ZeroGradRows(model.fc2.weight, 1)]
    report, _, _ = run(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), normal16, every=2, spy=lambda: [s() for s in spies]
    )
    assert [s.zero for s in spies] == [tuple(range(8))] * 3
    assert records(report) == {
        ("fc1.weight", 0, tuple(range(8)), Reason.ZERO_GRAD),
        ("fc1.bias", None, tuple(range(8)), Reason.ZERO_GRAD),
        ("fc2.weight", 1, tuple(range(8)), Reason.ZERO_GRAD),
    }
    assert all("moved only through weight decay (0.01)" in r.detail for r in report.partly_updated)


def test_dead_conv_filters_and_the_next_layers_input_channels() -> None:
    torch.manual_seed(0)
    model = DeadFilters()
    start = copy.deepcopy(model)
    report, _, _ = run(
        model, torch.optim.Adam(model.parameters(), lr=1e-2), lambda g: torch.randn(4, 3, 8, 8, generator=g)
    )
    filters = unchanged(start.conv1.weight, model.conv1.weight, 0)
    channels = unchanged(start.conv2.weight, model.conv2.weight, 1)
    assert filters == channels == unchanged(start.conv1.bias, model.conv1.bias, None) == (1, 4, 5)
    assert records(report) == {
        ("conv1.weight", 0, filters, Reason.ZERO_GRAD),
        ("conv1.bias", None, filters, Reason.ZERO_GRAD),
        ("conv2.weight", 1, channels, Reason.ZERO_GRAD),
    }
    detail = next(r.detail for r in report.partly_updated if r.dim == 0)
    assert detail.startswith("filters 1, 4-5 (3 of 8) never changed") and "dead filters" in detail


def test_padding_idx_row_is_labelled_intentional() -> None:
    torch.manual_seed(0)
    model = Bag(padding_idx=0, vocab=20)
    report, _, _ = run(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), lambda g: torch.randint(0, 20, (8, 10), generator=g)
    )
    assert records(report) == {("emb.weight", 0, (0,), Reason.PADDING_IDX)}
    assert report.partly_updated[0].detail.startswith("row 0 (1 of 20) never changed: the embedding's padding_idx row")


def test_rows_frozen_by_a_gradient_hook() -> None:
    """Fine-tuning only the new token rows 20..29: the old rows' gradient is masked by a hook."""
    torch.manual_seed(0)
    model = Bag(vocab=30)
    mask = torch.zeros(30, 1)
    mask[20:] = 1.0
    model.emb.weight.register_hook(lambda g: g * mask)
    start = copy.deepcopy(model)
    report, _, _ = run(
        model, torch.optim.Adam(model.parameters(), lr=1e-2), lambda g: torch.randint(0, 30, (8, 10), generator=g)
    )
    expected = unchanged(start.emb.weight, model.emb.weight, 0)
    assert expected == tuple(range(20))
    assert records(report) == {("emb.weight", 0, expected, Reason.ZERO_GRAD)}
    assert "gradient hook" in report.partly_updated[0].detail


def test_bf16_rows_whose_update_rounds_away() -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 8, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        model.weight[:3] = 256.0  # bf16 spacing 2 there: an update of ~1e-3 rounds away
        model.weight[3:] = 0.01 * torch.randn(5, 8).to(torch.bfloat16)
    start = copy.deepcopy(model)
    spy = ZeroGradRows(model.weight, 0)
    report, _, _ = run(
        model,
        torch.optim.SGD(model.parameters(), lr=1e-3),
        lambda g: torch.randn(4, 8, generator=g).to(torch.bfloat16),
        loss=lambda out: out.float().sum(),
        spy=spy,
    )
    rows = unchanged(start.weight, model.weight, 0)
    assert rows == (0, 1, 2) and spy.zero == ()
    assert records(report) == {("weight", 0, rows, Reason.BELOW_PRECISION)}
    assert "bfloat16" in report.partly_updated[0].detail


# --- healthy runs: no records at all ----------------------------------------------------------


def test_an_fp32_key_bias_that_never_moves_is_a_tiny_update_note_not_a_problem() -> None:
    """The key bias at 1.0 (fp32 resolves ~6e-8 there), SGD with momentum: its ~3e-9 noise gradient moves it by
    ~3e-9 at most a step, which rounds away, while the query and value biases learn. Nothing is wrong with the
    run; the verdict called it a problem, with bf16 advice ("keep fp32 master weights")."""
    torch.manual_seed(0)
    d = 16
    model = BiasedAttention(d)
    catalogue.key_bias_stuck(model)
    start = copy.deepcopy(model)
    spy = ZeroGradRows(model.qkv.bias, None)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    report, _, _ = run(model, opt, lambda g: torch.randn(4, 6, d, generator=g), spy=spy)
    keys = unchanged(start.qkv.bias, model.qkv.bias, None)
    assert keys == tuple(range(d, 2 * d)) and spy.zero == ()  # every key element had a (noise) gradient
    assert records(report) == {("qkv.bias", None, keys, Reason.TINY_UPDATE)}
    (rec,) = report.partly_updated
    assert "float32" in rec.detail and "attention key bias" in rec.detail and "master weights" not in rec.detail
    assert report.severities() == {"note": 1} and report.healthy
    assert report.verdict.startswith("gradlog OK")


@pytest.mark.parametrize(("tied", "every"), [(False, 1), (True, 1), (False, 4)])
def test_healthy_transformer_with_adamw_and_decay_has_no_records(tied: bool, every: int) -> None:
    torch.manual_seed(0)
    model = TinyLM(tied=tied)
    ids = lambda g: torch.randint(0, 32, (4, 8), generator=g)  # noqa: E731
    xent = lambda out: out.logsumexp(-1).mean()  # noqa: E731
    report, _, _ = run(model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1), ids, 12, every, xent)
    assert report.partly_updated == []
    assert report.never_updated == []


# --- live signal, memory, helpers -------------------------------------------------------------


def test_dead_frac_is_the_fraction_of_all_zero_gradient_rows_per_step() -> None:
    torch.manual_seed(0)
    model = DeadUnits()
    seen: list[float] = []

    def spy() -> None:
        g = model.fc1.weight.grad
        assert g is not None
        seen.append(float((g.abs().amax(1) == 0).double().mean()))

    _, _, mem = run(model, torch.optim.Adam(model.parameters(), lr=1e-2), normal16, steps=4, every=2, spy=spy)
    assert [v for _, v in mem.scalars["weights/dead_frac/fc1.weight"]] == [seen[0], seen[2]] == [0.25, 0.25]
    assert [v for _, v in mem.scalars["weights/dead_frac/fc1.bias"]] == [0.25, 0.25]
    assert [v for _, v in mem.scalars["weights/dead_frac/fc2.weight"]] == [0.0, 0.0]


def test_dead_frac_only_on_zero_count_steps() -> None:
    model = DeadUnits()
    mem = gradlog.MemoryWriter()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gl = gradlog.GradLogger(model, opt, writer=mem, every=1, histograms=False, print_report=False)
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    gl.log()
    gl.close()
    assert not any(tag.startswith("weights/dead_frac/") for tag in mem.scalars)


def test_evidence_and_fingerprints_take_at_most_32_bytes_per_slice() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(100, 16), nn.Linear(16, 300), nn.Conv1d(300, 7, 3), nn.LayerNorm(5))
    model[3] = nn.LayerNorm(5).double()
    fwd = lambda x: model[3](model[2](model[1](model[0](x)).transpose(1, 2)).double())  # noqa: E731
    opt = torch.optim.Adam(model.parameters())
    gl = gradlog.GradLogger(model, opt, writer="memory", every=1, print_report=False)
    for _ in range(2):
        fwd(torch.randint(0, 100, (2, 7))).sum().backward()
        opt.step()
        gl.log()
    for row in gl.table.live:
        p = row.param
        first = gl.ledger.evidence[row.index].first_fp
        assert first is not None
        slices = p.shape[0] + p.shape[1] if p.dim() >= 2 else p.numel()
        held = first.nbytes + sum(
            d[row.index].numel() * d[row.index].element_size()
            for d in (gl.meter.slice_grads.rows, gl.meter.slice_grads.cols)
            if row.index in d
        )
        assert held <= 32 * slices, (row.name, held, slices)
        assert first.slices == slices
    gl.close()


def test_ranges_compress_and_cut() -> None:
    assert ranges([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"
    assert ranges([]) == ""
    assert ranges([4]) == "4"
    assert ranges([0, 2, 4, 6, 7], limit=2) == "0, 2, ... (+2 more ranges)"


# --- fingerprints -----------------------------------------------------------------------------

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.complex64, torch.int64, torch.bool]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 5), (40, 3, 2, 2), (3,), (), (0, 4), (4, 0), (0,)])
def test_fingerprint_finds_exactly_the_changed_slice_on_both_paths(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen) * 100
    x = x > 0 if dtype == torch.bool else x.to(dtype)
    cpu, generic = fp.take(x), fp.take(x, generic=True)
    for kind in ("rows", "cols", "elems"):
        a, b = getattr(cpu, kind), getattr(generic, kind)
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a, b), kind  # the accelerator path gives the same numbers
    assert not bool(fp.compare(cpu, fp.take(x.clone())).any())
    assert not bool(fp.changes_since(cpu, x.clone()).any())  # type: ignore[union-attr]
    if x.numel() == 0:
        return
    y = x.clone()
    at = tuple(min(1, n - 1) for n in shape)
    y[at] = ~y[at] if dtype == torch.bool else y[at] + 1
    ch = fp.compare(cpu, fp.take(y))
    via = fp.changes_since(cpu, y)
    assert via is not None
    for kind in ("rows", "cols", "elems"):
        a, b = getattr(ch, kind), getattr(via, kind)
        assert (a is None and b is None) or torch.equal(a, b)
    assert bool(ch.any())
    if x.dim() >= 2:
        assert ch.rows is not None and ch.cols is not None
        assert ch.rows.nonzero().flatten().tolist() == [at[0]]
        assert ch.cols.nonzero().flatten().tolist() == [at[1]]
    elif x.dim() == 1:
        assert ch.elems is not None and ch.elems.nonzero().flatten().tolist() == [at[0]]


def test_fingerprint_sees_a_change_in_the_high_half_of_a_double_and_a_swap() -> None:
    x = torch.ones(4, 4, dtype=torch.float64)
    y = x.clone()
    y[2, 3] = 2.0  # 1.0 -> 2.0 changes only the upper 32 bits
    assert fp.compare(fp.take(x), fp.take(y)).rows.nonzero().flatten().tolist() == [2]  # type: ignore[union-attr]
    z = torch.arange(16.0).reshape(4, 4)
    w = z.clone()
    w[1, 0], w[1, 2] = z[1, 2], z[1, 0]  # a swap keeps the row's plain sum: the weighted one sees it
    assert fp.compare(fp.take(z), fp.take(w)).rows.nonzero().flatten().tolist() == [1]  # type: ignore[union-attr]


def test_sparse_gradient_rows_are_the_present_non_zero_ones() -> None:
    idx = torch.tensor([[1, 3, 3, 6]])
    vals = torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 2.0]])
    g = torch.sparse_coo_tensor(idx, vals, (8, 2), check_invariants=True)
    rows, cols = slice_nonzero(g)
    assert rows.nonzero().flatten().tolist() == [1, 6]
    assert cols is not None and cols.tolist() == [True, True]


# --- bad input ------------------------------------------------------------------------------


def test_zero_element_scalar_fp16_lazy_and_complex_tensors_work() -> None:
    torch.manual_seed(0)
    model = OddTensors()
    mem = gradlog.MemoryWriter()
    model(torch.randn(2, 4))  # materialises the lazy layer
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gl = gradlog.GradLogger(model, opt, writer=mem, every=1, print_report=False)
    for _ in range(3):
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
        gl.log()
        opt.zero_grad()
    report = gl.close()
    assert report.partly_updated == []
    assert {r.name for r in report.never_updated} == {"empty"}
    assert mem.scalars["weights/dead_frac/lazy.weight"][-1][1] == 0.0


def test_lazy_parameters_materialised_after_the_logger_are_fingerprinted_then() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyLinear(8), nn.ReLU(), nn.Linear(8, 2))
    gl = gradlog.GradLogger(model, None, writer="memory", every=1, print_report=False)
    with torch.no_grad():
        model(torch.randn(1, 4))
        model[0].bias[:2] = -100.0
    for _ in range(3):
        model(torch.randn(16, 4)).pow(2).mean().backward()
        gl.log()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.01 * p.grad  # type: ignore[operator]
                p.grad = None
    report = gl.close()
    assert records(report) == {
        ("0.weight", 0, (0, 1), Reason.ZERO_GRAD),
        ("0.bias", None, (0, 1), Reason.ZERO_GRAD),
        ("2.weight", 1, (0, 1), Reason.ZERO_GRAD),
    }


def _planted_gradients(shape: tuple[int, ...], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Gradients with zeros where the evidence's cheap probe looks (the wrapped diagonals) and where it
    does not: the probe may only ever skip reading a gradient whose every slice is non-zero."""
    gen = torch.Generator().manual_seed(sum(shape))
    base = torch.randn(shape, generator=gen).to(dtype)
    out = {"dense": base.clone()}
    if len(shape) == 1:
        g = base.clone()
        g[shape[0] // 2] = 0
        out["one zero"] = g
        g = base.clone()
        g[0] = -0.0
        out["negative zero"] = g
        return out
    r, c = shape[0], shape[1]
    g = base.clone()
    g[r // 2] = 0
    out["zero row"] = g
    g = base.clone()
    g[:, c - 1] = 0
    out["zero column"] = g
    g = base.clone()  # every probed entry zero, yet no row or column is all zero when the plane is wide enough
    plane = g.view(r, c, -1)
    for k in range(max(r, c)):
        plane[k % r, k % c, 0] = 0
    out["zeros on the probe"] = g
    g = base.clone()
    g.view(r, c, -1)[0, 0, 0] = -0.0
    out["negative zero on the probe"] = g
    g = base.clone()
    g.view(r, c, -1)[r - 1, c - 1, 0] = float("nan")
    out["nan"] = g
    # a column whose only non-zero entry is the dtype's smallest subnormal (a square underflows to 0), and
    # a row of negative zeros: the sign bit alone is not a value
    g = base.clone()
    g[:, c // 2] = 0
    g.view(r, c, -1)[r // 2, c // 2, 0] = torch.finfo(dtype).tiny * torch.finfo(dtype).eps
    g[r - 1] = -0.0
    out["subnormal column, negative-zero row"] = g
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize(
    "shape",
    [(7, 7), (9, 4), (4, 9), (13, 3), (3, 13, 2), (5, 2, 3, 3), (1, 6), (6, 1), (11,), (600, 300), (300, 40, 3, 3)],
)  # the last two span several of the host path's row blocks
def test_slice_evidence_equals_nonzero_slices_by_hand(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """One measured step's evidence (rows, columns, elements with a non-zero gradient entry) equals
    `(g != 0).any(...)` computed here, for dense gradients and gradients with zeros planted on and off
    the probe entries that let a healthy gradient skip the full read."""
    from gradlog.measure.params import Tracked
    from gradlog.measure.slice_grads import SliceGrads

    for what, g in _planted_gradients(shape, dtype).items():
        p = nn.Parameter(torch.zeros(shape, dtype=dtype))
        sg = SliceGrads()
        seen = sg.observe([Tracked.of(0, p, "w")], [g], False, torch.device("cpu"))
        nz = (g != 0) | g.isnan()  # NaN counts as a non-zero gradient
        want_rows = nz.reshape(shape[0], -1).any(1)
        assert torch.equal(sg.rows[0].reshape(-1), want_rows), (what, shape, dtype)
        if len(shape) >= 2:
            want_cols = nz.transpose(0, 1).reshape(shape[1], -1).any(1)
            assert torch.equal(sg.cols[0].reshape(-1), want_cols), (what, shape, dtype)
        complete = bool(want_rows.all()) and (len(shape) < 2 or bool(want_cols.all()))
        # complete: known on the host at once (CPU) or through the step's flag (devices)
        marked = 0 in sg.full or (seen.done is not None and bool(seen.done.all()))
        assert marked == complete, (what, shape, dtype)


def test_column_evidence_after_every_row_had_a_gradient_keeps_accumulating() -> None:
    """Once every row of a weight has had a non-zero gradient only its columns are looked at (blocks of rows):
    an input that is zero for a while and then fires must still be marked, one never non-zero must not."""
    torch.manual_seed(0)
    lin = nn.Linear(200, 700)  # 140k entries: several row blocks
    opt = torch.optim.SGD(lin.parameters(), lr=1e-4)
    gl = gradlog.GradLogger(lin, opt, writer="memory", every=1, histograms=False, print_report=False)
    seen = torch.zeros(200, dtype=torch.bool)

    def loss(step: int) -> torch.Tensor:
        x = torch.randn(8, 200)
        x[:, 150:] = 0  # inputs 150.. never fire ...
        x[:, 10] = 0 if step < 4 else 1.0  # ... input 10 only from step 4 on, after the rows are complete,
        x[:, 20] = 1.0 if step == 2 else 0  # and input 20 at step 2 only
        return lin(x).square().sum()

    def record(step: int) -> None:
        nonlocal seen
        seen |= (lin.weight.grad != 0).any(0)

    catalogue.loop(opt, gl, 6, loss, after_backward=record)
    row = gl.table.get(lin.weight)
    assert row is not None
    evidence = gl.meter.slice_grads
    assert row.index in evidence.rows_full and row.index not in evidence.full
    assert torch.equal(evidence.cols[row.index], seen) and bool(seen[10] & seen[20]) and not bool(seen[150:].any())
    report = gl.close()
    cols = [r for r in report.partly_updated if r.name == "weight" and r.dim == 1]
    # inputs the data never sets, with no dead unit upstream: an input no batch held (a note), not dead units
    assert len(cols) == 1 and cols[0].indices == tuple(range(150, 200)) and cols[0].reason is Reason.NOT_IN_BATCH


@pytest.mark.parametrize("shape", [(300, 7), (50, 9, 3, 3), (1, 40)])
def test_host_slices_in_row_blocks_equal_the_whole_tensor_at_once(
    shape: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CPU path reduces a block of rows at a time (a 200M-entry table's per-row outputs were 6 MB of
    temporaries at once): blocks of one or a few rows must give the rows and columns `(g != 0)` gives."""
    from gradlog.measure import slice_grads

    for what, g in _planted_gradients(shape, torch.float32).items():
        nz = (g != 0) | g.isnan()
        want_rows = nz.reshape(shape[0], -1).any(1)
        want_cols = nz.transpose(0, 1).reshape(shape[1], -1).any(1)
        for block in (1, 64, 1 << 20):
            monkeypatch.setattr(slice_grads, "_BLOCK", block)
            out = slice_grads._host_slices(g, need_cols=True)
            assert out is not None
            rows, cols = out
            assert torch.equal(torch.from_numpy(rows), want_rows), (what, block)
            assert torch.equal(torch.from_numpy(cols), want_cols), (what, block)


def test_gpt2_conv1d_dead_units_are_named_as_units() -> None:
    """transformers' Conv1D holds (in, out): GPT-2's c_fc columns and c_proj rows are its MLP's units. Units
    dead from the start (relu, a bias of -100) read "output units" / "input features" like a Linear's (the
    partly table said "columns" / "rows"; stopped slices already said units). Indices from copies of the
    weights."""
    model = catalogue.tiny_gpt2(activation="relu")
    mlp = model.transformer.h[0].mlp
    with torch.no_grad():
        mlp.c_fc.bias[:8] = -100.0
    start = copy.deepcopy(mlp)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gl = gradlog.GradLogger(model, opt, writer="memory", every=1, print_report=False)
    gen = torch.Generator().manual_seed(0)
    report = catalogue.train(opt, gl, 8, lambda step: catalogue.lm_loss(model, gen))
    dead = tuple(range(8))
    assert unchanged(start.c_fc.weight, mlp.c_fc.weight, 1) == dead
    assert unchanged(start.c_proj.weight, mlp.c_proj.weight, 0) == dead
    got = {(r.name.rsplit(".", 2)[-2], r.dim): r for r in report.partly_updated if ".h.0.mlp." in r.name}
    assert {k: r.indices for k, r in got.items()} == {("c_fc", 1): dead, ("c_fc", None): dead, ("c_proj", 0): dead}
    assert got[("c_fc", 1)].detail.startswith("output units 0-7 (8 of 128) never changed")
    assert got[("c_fc", None)].detail.startswith("units 0-7 (8 of 128) never changed")
    assert got[("c_proj", 0)].detail.startswith("input features 0-7 (8 of 128) never changed")
    assert "dead units" in got[("c_fc", 1)].detail


def test_an_input_feature_no_batch_sets_is_a_note_like_an_unseen_id() -> None:
    """A layer's input column that is zero in every batch while no watched unit is dead (transformers' Informer
    feeds log1p(|loc|), 0 under its default mean scaling: the zoo's `informer` read PROBLEM, "16.7% of the layer's
    input features", on a healthy run) is `not_in_batch`, a note worded as the input no batch set, not dead units.
    The zero column is found from the gradients the test reads and from the weights' copy."""
    torch.manual_seed(0)
    model = catalogue.MeanScaledInputs()
    start = copy.deepcopy(model)
    spy = ZeroGradRows(model.inp.weight, 1)

    def batch(gen: torch.Generator) -> torch.Tensor:
        return torch.randn(16, 4, generator=gen) + 2

    report, _, _ = run(model, torch.optim.Adam(model.parameters(), lr=1e-2), batch, spy=spy)
    zero = (model.zero_feature,)
    assert spy.zero == unchanged(start.inp.weight, model.inp.weight, 1) == zero
    assert records(report) == {("inp.weight", 1, zero, Reason.NOT_IN_BATCH)}
    detail = report.partly_updated[0].detail
    assert detail.startswith("input feature 4 (1 of 6) never changed; zero gradient at all 10 measured steps")
    assert "the layer's input was zero there in every measured batch" in detail
    assert "no dead unit that gradlog watches feeds it" in detail and "dead units upstream" not in detail
    assert report.healthy and set(report.severities()) == {"note"}, report.verdict


def test_input_channels_zeroed_by_dead_filters_before_a_flatten_stay_dead_units() -> None:
    """The input columns of a Linear after a flatten are blocks of a conv's filters: dead filters upstream (bias
    -100 before the ReLU) zero whole blocks, and those columns stay `zero_grad` (dead units), weighed as such,
    though their count (filters x positions) is not the filters' count. Columns from the weights' copy."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 4 * 4, 2))
    with torch.no_grad():
        model[0].bias[[1, 4]] = -100.0
    start = copy.deepcopy(model)
    report, _, _ = run(
        model, torch.optim.Adam(model.parameters(), lr=1e-2), lambda g: torch.randn(8, 3, 6, 6, generator=g)
    )
    cols = unchanged(start[3].weight, model[3].weight, 1)
    assert cols == (*range(16, 32), *range(64, 80))
    assert ("3.weight", 1, cols, Reason.ZERO_GRAD) in records(report)
    assert ("0.weight", 0, (1, 4), Reason.ZERO_GRAD) in records(report)
    assert not report.healthy
