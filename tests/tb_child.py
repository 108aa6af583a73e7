"""A training process for tests/test_tensorboard.py to kill or to let exit without closing anything.

python tests/tb_child.py kill LOG_DIR   trains, printing "logged N" after each gl.log(N) returns; hangs after step 12
python tests/tb_child.py exit LOG_DIR   logs a few steps (and a bare TensorBoardWriter) and exits without close()
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn

import gradlog

KILL_AT = 12


def main(mode: str, log_dir: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(16)])  # 32 tensors, 96 histograms a step
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gl = gradlog.GradLogger(
        model,
        opt,
        writer="tensorboard",
        log_dir=os.path.join(log_dir, "run"),
        every=1,
        histograms=gradlog.HistogramOptions(bins=512),
    )
    steps = 5 if mode == "exit" else KILL_AT + 1
    for step in range(steps):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        gl.log(step)
        opt.zero_grad()
        print(f"logged {step}", flush=True)
        if mode == "kill" and step == KILL_AT:
            # Hang right after log() returned, holding the GIL so no other thread of ours can write
            # anything more: what is on disk now is all that log() made durable.
            sys.setswitchinterval(1e6)
            while True:
                pass
    if mode == "exit":
        bare = gradlog.TensorBoardWriter(os.path.join(log_dir, "bare"))
        bare.log_scalars({"bare/x": 1.5, "bare/y": -2.0}, 7)  # neither flushed nor closed


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
