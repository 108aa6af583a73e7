"""How fast `gradlog diff` reads checkpoints that are in the page cache (target: >= 1 GB/s of checkpoint data).

Builds two checkpoints of a GPT-like model of about --mb MB each (fp32; most tensors changed a little,
some unchanged, an embedding with untouched rows), in the chosen formats, reads each file once so it
is in the page cache, then times `gradlog.compare.checkpoints.diff` over the pair (best of --rounds). GB/s counts
the tensor bytes of both checkpoints, the data diff must read.

    PYTHONPATH=. python benchmarks/diff_speed.py                 # 2 x 512 MB, torch and safetensors
    PYTHONPATH=. python benchmarks/diff_speed.py --mb 2048 --formats safetensors
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import torch

from gradlog.compare.checkpoints import diff, open_all


def state_dict(mb: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    d = 1024
    per_layer = 12 * d * d * 4  # 4 attention + 8 MLP matrices' worth of fp32
    layers = max(1, (mb << 20) // per_layer)
    sd: dict[str, torch.Tensor] = {"embed.weight": torch.randn(8192, d, generator=g)}
    for i in range(layers):
        sd[f"layers.{i}.attn.qkv.weight"] = torch.randn(3 * d, d, generator=g)
        sd[f"layers.{i}.attn.proj.weight"] = torch.randn(d, d, generator=g)
        sd[f"layers.{i}.mlp.up.weight"] = torch.randn(4 * d, d, generator=g)
        sd[f"layers.{i}.mlp.down.weight"] = torch.randn(d, 4 * d, generator=g)
        sd[f"layers.{i}.norm.weight"] = torch.ones(d)
        sd[f"layers.{i}.mlp.up.bias"] = torch.zeros(4 * d)
    return sd


def step(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for i, (k, v) in enumerate(sd.items()):
        if i % 7 == 3:
            out[k] = v.clone()  # unchanged
        elif k == "embed.weight":
            w = v.clone()
            w[:4096] += 1e-3
            out[k] = w
        else:
            out[k] = v + 1e-3 * torch.randn_like(v)
    return out


def save(sd: dict[str, torch.Tensor], path: str, fmt: str) -> str:
    if fmt == "torch":
        torch.save({"model": sd, "step": 1}, path + ".pt")
        return path + ".pt"
    from safetensors.torch import save_file

    save_file(sd, path + ".safetensors")
    return path + ".safetensors"


def warm(path: str) -> None:
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=512, help="size of each checkpoint in MB (default 512)")
    ap.add_argument("--formats", default="torch,safetensors")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temp dir)")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="gradlog-diff-bench-", dir=args.dir)
    try:
        a = state_dict(args.mb, 0)
        b = step(a)
        nbytes = 2 * sum(t.numel() * t.element_size() for t in a.values())
        print(
            f"torch {torch.__version__}, {torch.get_num_threads()} threads, {len(a)} tensors, "
            f"{nbytes / 1e9:.2f} GB of tensors in the pair"
        )
        for fmt in args.formats.split(","):
            paths = [save(a, os.path.join(tmp, "a"), fmt), save(b, os.path.join(tmp, "b"), fmt)]
            best = float("inf")
            for _ in range(args.rounds):
                for p in paths:
                    warm(p)
                t0 = time.perf_counter()
                result = diff(open_all(paths))
                best = min(best, time.perf_counter() - t0)
            print(
                f"{fmt:12s} best of {args.rounds}: {best:.3f} s, {nbytes / best / 1e9:.2f} GB/s "
                f"({len(result.report.never_updated)} unchanged tensors, partly: "
                f"{[(p.name, p.dim, p.never) for p in result.report.partly_updated]})"
            )
            for p in paths:
                os.remove(p)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
