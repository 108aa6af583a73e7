"""Exact against sampled histograms on a real GPT-2 (124M, built from its config, one backward pass): the tables
in docs/metrics.md (issue 40).

For each tensor over the sample size, its weight and gradient histograms both ways (`histogram_partials`, CPU):
the largest bucket error as a share of the tensor's entries, the error the docs state for that bucket
(sqrt(q (1 - q) / sample)), the total variation distance between the two, and the time of each. Then one
histogram side by side, bucket by bucket (16 buckets, so it fits a page).

    OMP_NUM_THREADS=1 python benchmarks/sampled_histograms.py [--layers 12] [--bins 64]
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import transformers

from gradlog.measure.bucketing import DEFAULT_SAMPLE, histogram_partials

CPU = torch.device("cpu")


def tensors(layers: int) -> dict[str, torch.Tensor]:
    cfg = transformers.GPT2Config(n_layer=layers)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, cfg.vocab_size, (4, 128), generator=torch.Generator().manual_seed(1))
    model(ids, labels=ids).loss.backward()
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if p.numel() > DEFAULT_SAMPLE and (name.startswith(("transformer.wte", "transformer.h.0.")) or "wpe" in name):
            out[f"weight {name.removeprefix('transformer.')}"] = p.detach().reshape(-1)
            assert p.grad is not None
            out[f"grad {name.removeprefix('transformer.')}"] = p.grad.reshape(-1)
    return out


def timed(xs: list[torch.Tensor], bins: int, sample: int | None) -> tuple[torch.Tensor, float]:
    best = math.inf
    rows = torch.empty(0)
    for _ in range(3):
        t0 = time.perf_counter()
        rows = histogram_partials(xs, bins, CPU, sample=sample)
        best = min(best, time.perf_counter() - t0)
    return rows, best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--bins", type=int, default=64)
    args = ap.parse_args()
    bins = args.bins
    ts = tensors(args.layers)
    print(f"GPT-2 ({args.layers} layers), {bins} buckets, sample {DEFAULT_SAMPLE}, CPU, 1 thread\n")
    print(
        "| tensor | entries | largest bucket error (share of entries) | stated error of that bucket | "
        "total variation | exact ms | sampled ms |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, x in ts.items():
        exact, t_exact = timed([x], bins, None)
        sampled, t_sampled = timed([x], bins, DEFAULT_SAMPLE)
        n = x.numel()
        e, s = exact[0, :bins].double() / n, sampled[0, :bins].double() / n
        assert exact[0, bins:].tolist() == sampled[0, bins:].tolist()  # min, max, moments exact
        off = (s - e).abs()
        at = int(off.argmax())
        stated = math.sqrt(e[at] * (1 - e[at]) / DEFAULT_SAMPLE)
        tv = 0.5 * float(off.sum())
        print(
            f"| {name} | {n:,} | {off[at]:.2e} | {stated:.2e} | {tv:.4f} | {t_exact * 1e3:.1f} | "
            f"{t_sampled * 1e3:.2f} |"
        )
    name = "weight h.0.mlp.c_fc.weight"
    x = ts[name]
    ex = histogram_partials([x], 16, CPU)[0]
    sa = histogram_partials([x], 16, CPU, sample=DEFAULT_SAMPLE)[0]
    lo, hi = float(ex[16]), float(ex[17])
    print(f"\n{name} ({x.numel():,} entries), 16 buckets, exact and sampled side by side:\n")
    print("| bucket from | exact count | sampled count | difference (share of entries) |")
    print("|---:|---:|---:|---:|")
    for b in range(16):
        edge = lo + (hi - lo) * b / 16
        print(f"| {edge:+.4f} | {int(ex[b]):,} | {int(sa[b]):,} | {(float(sa[b]) - float(ex[b])) / x.numel():+.1e} |")


if __name__ == "__main__":
    main()
