"""What issue 29's evidence adds to a measured step: an interleaved A/B in one process.

Two private switches on the meter turn the new per-step work off: `slice_grads.track_last` (each
slice's last measured step with a non-zero gradient, for stopped slices: a probe or a per-slice pass
over every gradient, complete or not, and an int32 per slice) and `count_frozen` (the share of a
low-precision tensor's updates rounded away: one `==`, one `!=`, one `&` and one count per fp16/bf16
tensor). On the overhead benchmark's models, gradlog's own time on a measured step (the optimizer
hooks' `meter.start`/`meter.finish` and `log()`, the main thread's CPU time) is taken with both on and
both off, alternating which goes first, best of N per side and step kind:

- steady: a later measured step, zeros not counted (`histograms=False`: complete tensors are probed);
- zero-count: zeros counted (the default logger's measured steps): their counts say which gradients
  have no zero entry, and those need no probe.

    PYTHONPATH=. python benchmarks/stopped_evidence.py --models mlp,deep,big,gpt --repeat 5
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import slice_evidence  # its evidence logger and clocked measured steps
from overhead import model_specs  # the benchmark's models, built from its configs


def one_run(on: bool, built: Any, optimizer: Callable[..., torch.optim.Optimizer]) -> dict[str, float]:
    """A fresh logger with the stopped-slice and rounded-away evidence on or off; gradlog's time on steady
    and zero-count measured steps (seconds; the first, which sets things up, is left out)."""
    model, loss_fn = built
    opt = optimizer(model)
    gl = slice_evidence.evidence_logger(model, opt)
    gl.meter.slice_grads.track_last = on
    gl.meter.count_frozen = on
    kinds = ("first", "steady", "steady", "zero-count", "zero-count")
    out = slice_evidence.measured_steps(gl, opt, model, loss_fn, kinds, ("zero-count",))
    del out["first"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="mlp,deep,big,gpt")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--bf16", action="store_true", help="cast the models to bf16 (the rounded-away count runs)")
    args = ap.parse_args()
    specs = model_specs(args)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread; main thread CPU ms, best of {args.repeat} interleaved\n")
    print("| model | measured step | off | on | on - off | on / off |")
    print("|---|---|---:|---:|---:|---:|")
    for name in args.models.split(","):
        spec = specs[name]
        built = spec.build(torch.device("cpu"))
        if args.bf16:  # pure bf16 weights; inputs cast in, the output cast back out for the fp32 loss
            m = built[0].to(torch.bfloat16)
            m.register_forward_pre_hook(lambda _, a: tuple(t.bfloat16() if t.is_floating_point() else t for t in a))
            m.register_forward_hook(lambda _, a, out: out.float())
        best: dict[tuple[bool, str], float] = defaultdict(lambda: float("inf"))
        for i in range(args.repeat):
            for on in (True, False) if i % 2 else (False, True):
                for kind, t in one_run(on, built, spec.optimizer).items():
                    best[on, kind] = min(best[on, kind], t)
        for kind in ("steady", "zero-count"):
            off, on_ = best[False, kind], best[True, kind]
            print(
                f"| {name} | {kind} | {off * 1e3:.1f} | {on_ * 1e3:.1f} | {(on_ - off) * 1e3:+.1f} | {on_ / off:.3f} |"
            )
        sys.stdout.flush()


if __name__ == "__main__":
    main()
