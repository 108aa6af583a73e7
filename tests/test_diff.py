"""`gradlog diff`: checkpoints of short planted-bug runs, in all three formats, give exactly the findings a
by-hand comparison of the saved tensors gives; bad input exits 2 with a message, never a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import catalogue
import pytest
import torch
from diff_models import SEEN, VOCAB, save_safetensors, save_sharded, save_torch, train_checkpoints
from torch import nn

from gradlog.cli.entry import main
from gradlog.compare.checkpoints import Progress, diff, open_all
from gradlog.readers.checkpoints import BadCheckpoint, Checkpoint
from gradlog.verdict.report import Reason

ROOT = Path(__file__).resolve().parent.parent


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality, by hand: the bytes of both values (copied into fresh memory first: a one-element
    column keeps its stride through `contiguous()`, which a byte view refuses)."""

    def raw(t: torch.Tensor) -> bytes:
        flat = torch.empty(t.numel(), dtype=t.dtype).copy_(t.reshape(-1))
        return bytes(flat.view(torch.uint8).tolist())

    return raw(a) == raw(b)


def _reference(cks: list[dict[str, object]]) -> dict[str, object]:
    """What never changed, per tensor and per row/column/element, found by comparing every saved value."""
    sds: list[dict[str, torch.Tensor]] = [ck["model"] for ck in cks]  # type: ignore[misc]
    never, rows, cols, elems, stalled = [], {}, {}, {}, {}
    for name, first in sds[0].items():
        vals = [sd[name] for sd in sds]
        changed = [not _same(vals[i - 1], vals[i]) for i in range(1, len(vals))]
        if not any(changed):
            never.append(name)
            continue
        last = max(i for i, c in enumerate(changed) if c)
        if last < len(changed) - 1:
            stalled[name] = last
        if first.dim() >= 2:
            rows[name] = [r for r in range(first.shape[0]) if all(_same(v[r], first[r]) for v in vals)]
            cols[name] = [c for c in range(first.shape[1]) if all(_same(v[:, c], first[:, c]) for v in vals)]
        else:
            elems[name] = [e for e in range(first.shape[0]) if all(_same(v[e], first[e]) for v in vals)]
    return {"never": never, "rows": rows, "cols": cols, "elems": elems, "stalled": stalled}


@pytest.fixture(scope="module")
def run() -> list[dict[str, object]]:
    return train_checkpoints()


def _partly(result) -> dict[tuple[str, int | None], tuple[int, ...]]:
    return {(p.name, p.dim): p.indices for p in result.report.partly_updated}


def _check_against_reference(result, cks) -> None:
    ref = _reference(cks)
    assert sorted(r.name for r in result.report.never_updated) == sorted(ref["never"])
    assert sorted(ref["never"]) == ["frozen.bias", "frozen.weight", "head.bias", "head.weight"]
    expected = {}
    for kind, dim in (("rows", 0), ("cols", 1), ("elems", None)):
        for name, idx in ref[kind].items():
            if idx:
                expected[(name, dim)] = tuple(idx)
    assert _partly(result) == expected
    assert expected == {("embed.weight", 0): tuple(range(SEEN, VOCAB))}
    assert {s.name: (s.since_step, s.last_update_step) for s in result.report.stalled} == {
        n: (last + 1, last) for n, last in ref["stalled"].items()
    }
    assert ref["stalled"] == {"mid.weight": 0, "mid.bias": 0}
    assert [(a.name, a.checkpoint, a.count) for a in result.nonfinite] == [("out.weight", 2, 1)]
    # a saved value, not a gradient: said once, first, as NaN/Inf that appeared (it was also "first non-finite
    # gradient at step 2", a second problem for the one value)
    assert result.report.first_nonfinite is None
    assert result.verdict.startswith("gradlog diff PROBLEM: NaN/Inf values appeared in 1 tensor (first: out.weight);")
    assert "gradient" not in result.verdict
    kinds = [f.kind for f in result.judged().findings]
    assert kinds.count("diff.nonfinite") == 1 and "run.nonfinite" not in kinds
    # relative change by hand
    sds = [ck["model"] for ck in cks]
    for name in ("out.bias", "embed.weight"):
        for i in range(2):
            a, b = sds[i][name], sds[i + 1][name]
            want = float(torch.linalg.vector_norm(b.double() - a.double()) / torch.linalg.vector_norm(a.double()))
            assert result.relative_change[name][i] == pytest.approx(want, rel=1e-5)
    assert result.relative_change["frozen.weight"] == [0.0, 0.0]
    assert result.relative_change["mid.weight"][1] == 0.0 and result.relative_change["mid.weight"][0] > 0
    assert not result.healthy


def test_torch_checkpoints_with_optimizer_state(run, tmp_path):
    paths = [save_torch(ck, str(tmp_path / f"step{i}.pt")) for i, ck in enumerate(run)]
    result = diff(open_all(paths))
    _check_against_reference(result, run)
    reasons = {r.name: r.reason for r in result.report.never_updated}
    # left out of the optimizer (built from the trainable tensors only): checkpoints do not store requires_grad
    assert reasons["frozen.weight"] == reasons["frozen.bias"] == Reason.NOT_IN_OPTIMIZER
    assert reasons["head.weight"] == reasons["head.bias"] == Reason.NO_GRAD  # in the optimizer, never stepped
    assert {s.name: s.reason for s in result.report.stalled} == {
        "mid.weight": Reason.ZERO_LR,
        "mid.bias": Reason.ZERO_LR,
    }
    emb = result.report.partly_updated[0]
    assert emb.reason == Reason.NOT_IN_BATCH and "zero moments" in emb.detail
    text = result.text()
    assert "rows 30-39 (10 of 40)" in text and "gradlog diff PROBLEM" in text
    assert "by the parameter names" in result.optimizer_note
    # checkpoints show values, not updates: the verdict says what changed, in the judge's own parts
    n = len(run[0]["model"])  # type: ignore[arg-type]
    verdict = result.verdict
    assert f"; 4 of {n} tensors never changed (not_in_optimizer 2, no_grad 2); " in verdict
    assert "; 1 tensor partly never changed (not_in_batch 1); " in verdict
    assert "; 2 tensors stopped changing (zero_lr 2), the first from step 1 (3 checkpoints; " in verdict
    assert (
        "updated" not in verdict
        and "learning" not in verdict
        # problems per cause: frozen's two tensors (one layer out of the optimizer), head's two, mid's two
        # (zero lr), and the NaN once, not twice
        and verdict.endswith(" (3 checkpoints; 4 problems, 1 note)")
    ), verdict


def test_safetensors_files(run, tmp_path):
    paths = [save_safetensors(ck, str(tmp_path / f"step{i}.safetensors")) for i, ck in enumerate(run)]
    result = diff(open_all(paths))
    _check_against_reference(result, run)
    # no optimizer state in a .safetensors file: the reason is honest about it
    assert {r.reason for r in result.report.never_updated} == {Reason.UNKNOWN}
    assert all("no checkpoint holds optimizer state" in r.detail for r in result.report.never_updated)


def test_sharded_hugging_face_folder(run, tmp_path):
    folders = [save_sharded(ck, str(tmp_path / f"checkpoint-{i}"), shards=3) for i, ck in enumerate(run)]
    assert len([f for f in os.listdir(folders[0]) if f.endswith(".safetensors")]) == 3
    result = diff(open_all(folders))
    _check_against_reference(result, run)
    reasons = {r.name: r.reason for r in result.report.never_updated}
    assert reasons["head.weight"] == Reason.NO_GRAD  # optimizer.pt of the Trainer-style folder was used


def test_torch_bin_folders_and_nested_ddp_state_dict(run, tmp_path):
    """pytorch_model.bin(.index.json) folders, and {"state_dict": {"module.x": ...}} from a DDP run."""
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    sd = run[0]["model"]
    names = list(sd)
    torch.save({k: sd[k] for k in names[:3]}, sharded / "pytorch_model-1.bin")
    torch.save({k: sd[k] for k in names[3:]}, sharded / "pytorch_model-2.bin")
    index = {k: "pytorch_model-1.bin" if i < 3 else "pytorch_model-2.bin" for i, k in enumerate(names)}
    (sharded / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": index}))
    single = tmp_path / "single"
    single.mkdir()
    torch.save(run[1]["model"], single / "pytorch_model.bin")
    ddp = tmp_path / "ddp.ckpt"
    torch.save({"epoch": 3, "state_dict": {"module." + k: v for k, v in run[2]["model"].items()}}, ddp)
    result = diff(open_all([str(sharded), str(single), str(ddp)]))
    _check_against_reference(result, run)


def test_positional_optimizer_matching(tmp_path):
    """Adam(model.parameters()) saves no names: matched by order when the counts and shapes agree."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2), nn.Linear(4, 3))  # [3] unused
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "a.pt")
    for _ in range(3):
        opt.zero_grad()
        model[2](model[1](model[0](torch.randn(8, 4)))).sum().backward()
        opt.step()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "b.pt")
    result = diff(open_all([str(tmp_path / "a.pt"), str(tmp_path / "b.pt")]))
    assert {r.name: r.reason for r in result.report.never_updated} == {
        "3.weight": Reason.NO_GRAD,
        "3.bias": Reason.NO_GRAD,
    }
    assert "by position" in result.optimizer_note
    assert "1.num_batches_tracked" in result.skipped_non_float


def test_healthy_pair_exits_0_and_json(run, tmp_path, capsys):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    torch.save(model.state_dict(), tmp_path / "a.pt")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(5, 3)).pow(2).sum().backward()
    opt.step()
    torch.save(model.state_dict(), tmp_path / "b.pt")
    assert main(["diff", str(tmp_path / "a.pt"), str(tmp_path / "b.pt")]) == 0
    assert "gradlog diff OK: all 2 compared tensors changed across 2 checkpoints" in capsys.readouterr().out
    paths = [save_torch(ck, str(tmp_path / f"s{i}.pt")) for i, ck in enumerate(run)]
    assert main(["diff", *paths, "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["healthy"] is False
    assert data["relative_change"]["out.weight"][1] is None  # NaN is null in JSON
    assert {r["name"] for r in data["never_updated"]} == {"frozen.weight", "frozen.bias", "head.weight", "head.bias"}
    assert data["partly_updated"][0]["indices"] == list(range(SEEN, VOCAB))
    assert main(["diff", *paths, "--include", "mid.*", "--include", "out.bias", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert set(data["relative_change"]) == {"mid.weight", "mid.bias", "out.bias"}
    assert (
        main(
            [
                "diff",
                *paths,
                "--exclude",
                "head.*",
                "--exclude",
                "frozen.*",
                "--exclude",
                "mid.*",
                "--exclude",
                "embed.*",
                "--exclude",
                "out.weight",
            ]
        )
        == 0
    )


def test_plot(run, tmp_path, capsys):
    paths = [save_torch(ck, str(tmp_path / f"s{i}.pt")) for i, ck in enumerate(run)]
    out = tmp_path / "diff.png"
    assert main(["diff", *paths, "--plot", str(out)]) == 1
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
    from matplotlib.image import imread

    px = torch.from_numpy(imread(str(out))[..., :3].copy())
    red = ((px - torch.tensor([0.85, 0.1, 0.1])).abs().amax(dim=-1) < 0.02).sum()  # the NaN/Inf cell (out.weight, 1->2)
    grey = ((px - 0.88).abs().amax(dim=-1) < 0.01).sum()  # cells that never changed (frozen, head, mid 1->2)
    assert red > 500 and grey > 5 * red


def test_missing_shape_and_dtype_changes(tmp_path):
    a = {"w": torch.zeros(3, 2), "b": torch.zeros(2), "gone": torch.ones(1), "h": torch.ones(2, 2)}
    b = {"w": torch.ones(3, 2), "b": torch.ones(2, 1), "h": torch.ones(2, 2, dtype=torch.float64), "new": torch.ones(1)}
    torch.save(a, tmp_path / "a.pt")
    torch.save(b, tmp_path / "b.pt")
    result = diff(open_all([str(tmp_path / "a.pt"), str(tmp_path / "b.pt")]))
    assert [(m.name, m.present_in) for m in result.missing] == [("gone", (0,)), ("new", (1,))]
    assert [(m.name, m.before, m.after) for m in result.meta_changes] == [
        ("b", "2 float32", "2x1 float32"),
        ("h", "2x2 float32", "2x2 float64"),
    ]
    assert result.relative_change["w"] == [pytest.approx(1.0)]  # ‖A‖ = 0: measured against ‖B‖
    assert "2 tensors missing from some checkpoints; 2 tensors changed shape or dtype" in result.verdict


def test_bitwise_definition(tmp_path):
    """-0.0 vs 0.0 is the same value; NaN in the same place is no change; a NaN that moves is one."""
    a = torch.tensor([[0.0, float("nan"), 1.0], [2.0, 3.0, float("nan")]])
    b = torch.tensor([[-0.0, float("nan"), 1.0], [2.0, 3.5, 4.0]])
    torch.save({"t": a}, tmp_path / "a.pt")
    torch.save({"t": b}, tmp_path / "b.pt")
    result = diff(open_all([str(tmp_path / "a.pt"), str(tmp_path / "b.pt")]))
    assert _partly(result) == {("t", 0): (0,), ("t", 1): (0,)}
    assert result.nonfinite[0].checkpoint == 0 and result.nonfinite[0].count == 2


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # torch's, about the malicious file
@pytest.mark.parametrize(
    "case",
    ["missing", "fifo", "empty", "garbage", "dir", "no_common", "shapes", "filter", "one", "pickle", "bad_index"],
)
def test_bad_input_exits_2(case, tmp_path, capsys):
    good = tmp_path / "good.pt"
    torch.save({"w": torch.zeros(2, 2)}, good)
    other = tmp_path / "other.pt"
    args: list[str]
    if case == "missing":
        args = [str(good), str(tmp_path / "nope.pt")]
        msg = "cannot read checkpoint"
    elif case == "fifo":
        os.mkfifo(tmp_path / "fifo")
        args, msg = [str(good), str(tmp_path / "fifo")], "is a FIFO"
    elif case == "empty":
        other.write_bytes(b"")
        args, msg = [str(good), str(other)], "is empty"
    elif case == "garbage":
        other.write_bytes(b"hello world, not a checkpoint")
        args, msg = [str(good), str(other)], "not a torch.save file"
    elif case == "dir":
        (tmp_path / "d").mkdir()
        args, msg = [str(good), str(tmp_path / "d")], "holds no model.safetensors"
    elif case == "no_common":
        torch.save({"v": torch.zeros(2, 2)}, other)
        args, msg = [str(good), str(other)], "no tensor name in common"
    elif case == "shapes":
        torch.save({"w": torch.zeros(3, 2)}, other)
        args, msg = [str(good), str(other)], "different models"
    elif case == "filter":
        torch.save({"w": torch.ones(2, 2)}, other)
        args, msg = [str(good), str(other), "--include", "enc*"], "leave no tensor to compare; names look like 'w'"
    elif case == "one":
        args, msg = [str(good)], "needs two or more checkpoints"
    elif case == "pickle":
        import pickle

        class Evil:
            def __reduce__(self):
                return (os.system, ("echo pwned",))

        other.write_bytes(pickle.dumps({"w": Evil()}))
        args, msg = [str(good), str(other)], "weights_only=True"
    else:
        (tmp_path / "hf").mkdir()
        (tmp_path / "hf" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "../good.pt"}}))
        args, msg = [str(good), str(tmp_path / "hf")], "not a file inside"
    assert main(["diff", *args]) == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err


def test_checkpoint_reader_reads_lazily(tmp_path):
    """torch files are memory-mapped: opening reads headers; a tensor is read when it is asked for."""
    torch.save(
        {"model": {"a": torch.arange(6.0).reshape(2, 3)}, "optimizer": {"state": {}, "param_groups": []}},
        tmp_path / "c.pt",
    )
    ck = Checkpoint(str(tmp_path / "c.pt"))
    assert ck.kind == "torch" and ck.names == ["a"] and ck.info("a").shape == (2, 3)
    assert ck.optimizer == {"state": {}, "param_groups": []}
    assert torch.equal(ck.get("a"), torch.arange(6.0).reshape(2, 3))
    with pytest.raises(BadCheckpoint, match="holds no model state dict"):
        torch.save({"epoch": 1, "lr": 0.1}, tmp_path / "x.pt")
        Checkpoint(str(tmp_path / "x.pt"))


MEMORY_CHILD = r"""
import os, sys, threading, time
from gradlog.compare.checkpoints import Progress, diff, open_all

def anon_kb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    return 0

peak = [0]
stop = [False]
def sample():
    while not stop[0]:
        peak[0] = max(peak[0], anon_kb())
        time.sleep(0.0005)

base = anon_kb()
t = threading.Thread(target=sample, daemon=True)
t.start()
result = diff(open_all(sys.argv[1:]))
diff_peak = max(peak[0], anon_kb())
import torch
probe = torch.ones(16 << 20)  # 64 MB: the sampler must see it, or the measurement proves nothing
time.sleep(0.05)
stop[0] = True
t.join()
print(base, diff_peak, peak[0], len(result.report.never_updated), result.compared_bytes)
"""


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_memory_stays_near_two_tensors(fmt, tmp_path):
    """A 2 x 384 MB checkpoint pair of 16 MB tensors: the anonymous memory the diff adds (what cannot be
    paged back to the file) stays below 160 MB, several times less than one checkpoint."""
    from safetensors.torch import save_file

    paths = []
    for k in range(2):
        g = torch.Generator().manual_seed(0)
        sd = {f"layer{i}.weight": torch.randn(2048, 2048, generator=g) for i in range(24)}
        if k:
            for i in range(0, 24, 2):
                sd[f"layer{i}.weight"][::3] += 1.0
        path = tmp_path / f"c{k}.{'pt' if fmt == 'torch' else 'safetensors'}"
        torch.save(sd, path) if fmt == "torch" else save_file(sd, str(path))
        paths.append(str(path))
        del sd
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", MEMORY_CHILD, *paths], capture_output=True, text=True, env=env, timeout=240
    )
    assert out.returncode == 0, out.stderr
    base, peak, probed, never, compared = map(int, out.stdout.split())
    assert never == 12 and compared == 2 * 24 * 2048 * 2048 * 4
    assert (probed - base) / 1024 > 60  # the sampler does see a 64 MB allocation
    grown_mb = (peak - base) / 1024
    print(f"anonymous memory grew by {grown_mb:.0f} MB")
    assert grown_mb < 160, f"anonymous memory grew by {grown_mb:.0f} MB while diffing 2 x 384 MB"


def test_progress_line(monkeypatch):
    """On a terminal above 64 MB: a tqdm bar, or the plain line without tqdm; on a pipe only for inputs above
    2 GB, a plain line every 10%."""
    import io

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    pytest.importorskip("tqdm")
    tty = Tty()
    bar = Progress(200 << 20, stream=tty)
    bar.add(100 << 20)
    bar.add(100 << 20)
    bar.close()
    frames = tty.getvalue().split("\r")
    assert frames[-1].startswith("gradlog diff: 100%|") and "210M/210M" in frames[-1] and frames[-1].endswith("\n")
    monkeypatch.setitem(sys.modules, "tqdm", None)  # not installed: the plain line on the terminal too
    tty = Tty()
    bar = Progress(200 << 20, stream=tty)
    bar.add(100 << 20)
    bar.add(100 << 20)
    bar.close()
    assert tty.getvalue() == "gradlog diff: 50% of 0.21 GB\ngradlog diff: 100% of 0.21 GB\n"
    small = io.StringIO()
    bar = Progress(200 << 20, stream=small)
    bar.add(200 << 20)
    bar.close()
    assert small.getvalue() == ""
    pipe = io.StringIO()  # a pipe: plain lines (tqdm is never asked)
    bar = Progress(4 << 30, stream=pipe)
    for _ in range(40):
        bar.add(100 << 20)
    bar.close()
    lines = pipe.getvalue().splitlines()
    assert lines[0] == "gradlog diff: 2% of 4.29 GB" and lines[-1] == "gradlog diff: 90% of 4.29 GB"
    assert len(lines) == 10


def test_progress_counts_what_is_compared(run, tmp_path, capsys):
    from gradlog.cli.diff import run_diff

    paths = [save_torch(ck, str(tmp_path / f"s{i}.pt")) for i, ck in enumerate(run)]
    assert run_diff(paths, include=["mid.*"], progress=True) == 1
    lines = capsys.readouterr().err.splitlines()
    assert lines[-1] == "gradlog diff: 100% of 0.00 GB"  # only the selected tensors' bytes, all of them
    assert run_diff(paths) == 1 and capsys.readouterr().err == ""  # small input on a pipe: no progress


def test_real_hugging_face_save_pretrained_shards(tmp_path):
    """A tiny GPT-2 saved by transformers itself (sharded safetensors + index), before and after 3 steps."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=16)
    model = transformers.GPT2LMHeadModel(cfg)
    model.save_pretrained(tmp_path / "step0", max_shard_size="8KB")
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(3):
        ids = torch.randint(0, 32, (4, 8))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(tmp_path / "step3", max_shard_size="8KB")
    after = model.state_dict()
    assert (tmp_path / "step3" / "model.safetensors.index.json").exists()
    result = diff(open_all([str(tmp_path / "step0"), str(tmp_path / "step3")]))
    expected = {}
    for name in result.relative_change:
        a, b = before[name], after[name]
        if a.dim() >= 2:
            rows = tuple(r for r in range(a.shape[0]) if _same(a[r], b[r]))
            cols = tuple(c for c in range(a.shape[1]) if _same(a[:, c], b[:, c]))
            expected.update({(name, 0): rows} if 0 < len(rows) < a.shape[0] else {})
            expected.update({(name, 1): cols} if 0 < len(cols) < a.shape[1] else {})
    # positions 8..15 are never used and position 7 has no next token to predict: their rows never move
    assert _partly(result) == expected == {("transformer.wpe.weight", 0): tuple(range(7, 16))}
    assert result.report.never_updated == [] and not result.missing


def test_an_fp32_key_bias_that_never_moved_is_a_tiny_update_note(tmp_path):
    """Checkpoints of a healthy attention whose key bias sits where fp32 rounds its noise-sized SGD steps away:
    diff names the key elements (found by comparing the saved values) as tiny_update, a note, and exits 0; it
    called them `unknown`, a problem."""
    torch.manual_seed(0)
    model = catalogue.BiasedAttention(16)
    keys = catalogue.key_bias_stuck(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    paths = []
    for k in range(3):
        paths.append(str(tmp_path / f"ck{k}.pt"))
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, paths[-1])
        for _ in range(4):
            opt.zero_grad()
            model(torch.randn(4, 6, 16)).pow(2).mean().backward()
            opt.step()
    cks = [torch.load(p) for p in paths]
    ref = _reference(cks)
    assert ref["never"] == [] and ref["elems"]["qkv.bias"] == list(keys)
    result = diff(open_all(paths))
    (rec,) = result.report.partly_updated
    assert (rec.name, rec.dim, rec.indices, rec.reason) == ("qkv.bias", None, keys, Reason.TINY_UPDATE)
    assert "non-zero optimizer moment" in rec.detail and "master weights" not in rec.detail
    assert result.healthy
    assert main(["diff", *paths]) == 0


def test_the_text_keeps_within_a_terminal_even_with_long_names(tmp_path):
    """The diff's tables follow the run report's width rule: a detail that would run past 100 columns prints
    under its row (a 112-column row came from a long module name and a never-changed detail)."""
    name = "image_encoder.backbone_stage_three.projection"
    a = {f"{name}.weight": torch.randn(6, 4), f"{name}.bias": torch.randn(6), "head.weight": torch.randn(2, 6)}
    b = {k: v.clone() for k, v in a.items()}
    b["head.weight"] += 1.0  # head learned; the long-named layer never changed; one of its rows did not either
    b[f"{name}.weight"][1:] += 0.5
    b[f"{name}.bias"][1:] += 0.5
    torch.save(a, tmp_path / "a.pt")
    torch.save(b, tmp_path / "b.pt")
    text = diff(open_all([str(tmp_path / "a.pt"), str(tmp_path / "b.pt")])).text()
    assert "Rows/columns/elements that never changed:" in text and f"{name}.weight" in text
    too_wide = [line for line in text.splitlines()[:-1] if len(line) > 100]  # the verdict: one line to grep
    assert too_wide == []
