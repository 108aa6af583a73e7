"""What the per-slice fingerprint costs, against `tensor.sum()` over the same data.

gradlog fingerprints every watched tensor once when it is first seen and once at close
(`gradlog/measure/fingerprint.py`). This prints a markdown table: for each dtype, size and shape
(1-D, 2-D, 4-D conv), the best-of-N time of `tensor.sum()`, of one `take()` (construction), of
`changes_since()` (close: a new take and the comparison; for 1-D tensors a comparison with the
kept bits), and optionally of the whole-tensor fingerprint gradlog used before.

Every timed call starts with a cold cache (a 64 MB buffer is written first), the sum's as well as
the fingerprint's: each tensor is read once at construction and once at close, after the rest of the
model went through the cache. `--warm` times back-to-back repeats instead (data left in L2/L3).

    python benchmarks/fingerprint.py                           # 65K / 1M / 50M values; fp32, bf16, fp16
    python benchmarks/fingerprint.py --sizes 1e6 --dtypes float32 --repeat 9 --warm
    python benchmarks/fingerprint.py --models                  # whole-model pass: overhead.py's gpt and mlp
    python benchmarks/fingerprint.py --evidence                # the per-slice gradient evidence of a measured step

`--models` times the ledger's whole pass (`fingerprint_new` at construction, `changed` at close: every
tensor, with the one host copy) against one `sum()` per tensor, on overhead.py's gpt and mlp.

`--evidence` times, on the gradients of the overhead benchmark's 400-tensor MLP (200 x 256x256
weights and 200 biases), what a measured step adds for the per-slice evidence: the first step
(rows and columns of every tensor), a later step of a healthy model (every slice already seen:
skipped), a zero-count step (dead_frac: rows of every tensor), against one fused `_foreach_norm`
of the same gradients (the norm every measured step computes anyway).
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from gradlog.measure import fingerprint as fp
from gradlog.measure.params import Tracked
from gradlog.measure.slice_grads import SliceGrads
from gradlog.verdict.ledger import Ledger

sys.path.insert(0, str(Path(__file__).resolve().parent))

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def previous_whole_fingerprint(t: torch.Tensor) -> torch.Tensor:
    """The whole-tensor fingerprint gradlog had before the per-slice one (for the comparison column)."""
    bits = t.detach().contiguous().reshape(-1).view(_INT[t.element_size()])
    out = torch.zeros(2, dtype=torch.int64)
    chunk_n = 1 << 22
    for start in range(0, bits.numel(), chunk_n):
        chunk = bits[start : start + chunk_n].to(torch.int64)
        pos = torch.arange(start, start + chunk.numel(), dtype=torch.int64)
        weight = (pos * 2654435761 + 40503) & 0x7FFFFFFF
        out[0] += chunk.sum()
        out[1] += (chunk * weight).sum()
    return out


CLOCK = time.process_time
COLD = True
_FLUSH = torch.empty(1 << 24)  # 64 MB: twice the L3 of the benchmark machine


def best(fn: Callable[[], object], repeat: int, prime: Callable[[], object] | None = None) -> float:
    """Best of `repeat` runs. The default clock is the process's CPU time (user + system, so page
    faults count), which a machine shared with other jobs inflates far less than wall time.

    Cold (the default): the data is evicted before each run, then `prime` (the same work on a tiny
    tensor) runs, so the code is warm as it is in a pass over many tensors and only the data is cold."""
    times = []
    for _ in range(repeat):
        gc.collect()
        if COLD:
            _FLUSH.add_(1.0)
        if prime is not None:
            prime()
        t0 = CLOCK()
        fn()
        times.append(CLOCK() - t0)
    return min(times)


def shapes(n: int) -> list[tuple[int, ...]]:
    side = int(math.sqrt(n))
    conv = max(1, int(math.sqrt(n / 9)))  # [out, in, 3, 3]
    return [(n,), (max(1, n // 4096), 4096), (side, n // side), (conv, n // (9 * conv), 3, 3)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", type=float, default=[65536, 1e6, 5e7], help="elements per tensor")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "float16"], help="e.g. float32 bfloat16")
    ap.add_argument("--repeat", type=int, default=5, help="best of this many runs")
    ap.add_argument("--previous", action="store_true", help="add the (slow) previous whole-tensor fingerprint")
    ap.add_argument("--models", action="store_true", help="time the whole-model pass on overhead.py's gpt and mlp")
    ap.add_argument("--evidence", action="store_true", help="time the per-slice gradient evidence instead")
    ap.add_argument("--wall", action="store_true", help="time wall-clock instead of process CPU time")
    ap.add_argument("--warm", action="store_true", help="leave the data in the cache between runs")
    args = ap.parse_args()
    global CLOCK, COLD
    CLOCK = time.perf_counter if args.wall else time.process_time
    COLD = not args.warm
    if args.evidence:
        evidence(args.repeat)
        return
    clock = "wall" if args.wall else "process CPU"
    cache = "warm cache" if args.warm else "cold cache"
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"{clock} time in ms, {cache}, best of {args.repeat}\n"
    )
    if args.models:
        models(args.repeat)
        return
    cols = ["dtype", "shape", "sum()", "take()", "x sum", "at close", "x sum", "previous whole", "x sum"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * 2 + "---:|" * (len(cols) - 2))
    for name in args.dtypes:
        dtype = getattr(torch, name)
        for size in args.sizes:
            for shape in shapes(int(size)):
                print(row(torch.randn(shape).to(dtype), name, args.repeat, args.previous), flush=True)
                gc.collect()


def models(repeat: int) -> None:
    """The ledger's whole pass at construction and at close, against one `sum()` per tensor."""
    from overhead import model_specs  # the benchmark's models, built from their configs

    print("| model | tensors | values | sum() each | construction | x sum | close | x sum |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in ("gpt", "mlp"):
        model, _ = model_specs()[name].build(torch.device("cpu"))
        print(model_row(name, list(model.parameters()), repeat), flush=True)


def model_row(name: str, params: list[torch.Tensor], repeat: int) -> str:
    tracked = [Tracked.of(i, p, f"t{i}") for i, p in enumerate(params)]
    base = best(lambda: [p.sum() for p in params], repeat)

    def construct() -> Ledger:
        ledger = Ledger()
        ledger.fingerprint_new(tracked)
        return ledger

    ledger = construct()
    t_new = best(construct, repeat)
    t_close = best(lambda: ledger.changed(tracked), repeat)
    n = sum(p.numel() for p in params)
    return (
        f"| {name} | {len(params)} | {n / 1e6:.1f}M | {base * 1e3:.2f} | {t_new * 1e3:.2f} | "
        f"{t_new / base:.1f}x | {t_close * 1e3:.2f} | {t_close / base:.1f}x |"
    )


def evidence(repeat: int) -> None:
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(256, 256, generator=gen) for _ in range(200)]
    params += [torch.randn(256, generator=gen) for _ in range(200)]
    rows = [Tracked.of(i, torch.nn.Parameter(p), f"t{i}") for i, p in enumerate(params)]
    grads = [torch.randn(p.shape, generator=gen) for p in params]
    cpu = torch.device("cpu")
    norm = best(lambda: torch._foreach_norm(grads), repeat)

    def first() -> None:
        SliceGrads().observe(rows, grads, False, cpu)

    full = SliceGrads()
    seen = full.observe(rows, grads, False, cpu)
    full.mark_done(seen.keys, seen.done.tolist() if seen.done is not None else [])  # dense: complete on the host
    cases = [
        ("first measured step (rows + columns of all 400)", best(first, repeat)),
        ("later step, every slice already seen (skipped)", best(lambda: full.observe(rows, grads, False, cpu), repeat)),
        ("zero-count step (dead_frac: rows of all 400)", best(lambda: full.observe(rows, grads, True, cpu), repeat)),
    ]
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; 400 gradients, 13.2M values; best of {repeat}\n"
    )
    print("| work | ms | x the step's fused norm |")
    print("|---|---:|---:|")
    print(f"| `_foreach_norm` of the 400 gradients (done anyway) | {norm * 1e3:.2f} | 1.0x |")
    for name, t in cases:
        print(f"| {name} | {t * 1e3:.2f} | {t / norm:.2f}x |")


def row(x: torch.Tensor, name: str, repeat: int, previous: bool) -> str:
    tiny = torch.randn([min(n, 4) for n in x.shape]).to(x.dtype)  # primes the code paths, not the data
    tiny_first = fp.take(tiny)
    base = best(lambda: x.sum(), repeat, lambda: tiny.sum())
    first = fp.take(x)
    t_take = best(lambda: fp.take(x), repeat, lambda: fp.take(tiny))
    t_close = best(
        lambda: bool(fp.changes_since(first, x).any()),  # type: ignore[union-attr]
        repeat,
        lambda: bool(fp.changes_since(tiny_first, tiny).any()),  # type: ignore[union-attr]
    )
    prev = prev_x = "-"
    if previous:
        t_prev = best(lambda: previous_whole_fingerprint(x), 1, lambda: previous_whole_fingerprint(tiny))
        prev, prev_x = f"{t_prev * 1e3:.1f}", f"{t_prev / base:.1f}x"
    shape = "x".join(map(str, x.shape))
    return (
        f"| {name} | {shape} | {base * 1e3:.3f} | {t_take * 1e3:.3f} | {t_take / base:.1f}x | "
        f"{t_close * 1e3:.3f} | {t_close / base:.1f}x | {prev} | {prev_x} |"
    )


if __name__ == "__main__":
    main()
