"""One segment of a run whose `b` layer is reloaded from a saved copy before every step (tests/test_overwritten.py
runs the first segment in a subprocess, ended by SIGTERM as a preempted job is).

    python setback_child.py LOG_DIR SAVED CKPT  # steps 0..9 with the reload, checkpoint, then SIGTERM
"""

from __future__ import annotations

import os
import signal
import sys

import torch
from catalogue import TwoLayer, random_mse

import gradlog


def segment(model: TwoLayer, opt: torch.optim.Optimizer, steps: range, saved: dict[str, torch.Tensor]) -> None:
    """`steps` of training, `b` reloaded from `saved` at the top of each (the planted bug), under gradlog.watch."""
    loss = random_mse(model, 16, 6)
    for step in steps:
        if saved:
            model.b.load_state_dict(saved)
        loss(step).backward()
        opt.step()
        gradlog.log(step)
        opt.zero_grad()


def main() -> None:
    log_dir, saved_path, ckpt = sys.argv[1:4]
    torch.manual_seed(0)
    model = TwoLayer(torch.tanh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    saved = {k: v.clone() for k, v in model.b.state_dict().items()}
    torch.save(saved, saved_path)
    gradlog.watch(model, opt, writer="tensorboard", every=1, log_dir=log_dir, print_report=False)
    segment(model, opt, range(10), saved)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, ckpt)
    os.kill(os.getpid(), signal.SIGTERM)  # preempted: gradlog writes its tables on the way out


if __name__ == "__main__":
    main()
