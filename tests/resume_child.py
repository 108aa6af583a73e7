"""One segment of a preempted-and-resumed training run (tests/test_resume.py runs it in a subprocess).

    python resume_child.py first  LOG_DIR CKPT [WRITER]  # steps 0..29, checkpoint, then SIGTERM (preempted)
    python resume_child.py second LOG_DIR CKPT RESUME [WRITER]  # a new process: load the checkpoint, steps 30..59

WRITER: "tensorboard" (default) or "wandb" (offline: WANDB_MODE=offline in the environment).

`frozen` is frozen throughout; `late` is frozen until the resume; `slow`'s learning rate goes to 0 at the
resume; `main` trains throughout. The initial and checkpoint weights are saved beside the checkpoint.
"""

from __future__ import annotations

import os
import signal
import sys

import torch
from catalogue import FrozenMainLateSlow

import gradlog


def build() -> tuple[FrozenMainLateSlow, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = FrozenMainLateSlow()
    model.frozen.requires_grad_(False)
    groups = [
        {"params": [*model.main.parameters(), *model.late.parameters()], "lr": 1e-2},
        {"params": list(model.slow.parameters()), "lr": 1e-2},
    ]
    return model, torch.optim.Adam(groups)


def train(model: FrozenMainLateSlow, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        torch.manual_seed(1000 + step)
        opt.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
        gradlog.log()


def main() -> None:
    phase, log_dir, ckpt = sys.argv[1:4]
    writer = (
        sys.argv[5 if phase == "second" else 4] if len(sys.argv) > (5 if phase == "second" else 4) else "tensorboard"
    )
    model, opt = build()
    if phase == "first":
        model.late.requires_grad_(False)
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, ckpt + ".initial")
        gradlog.watch(model, opt, writer=writer, every=5, log_dir=log_dir, print_report=False)
        train(model, opt, range(30))
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, ckpt)
        os.kill(os.getpid(), signal.SIGTERM)  # preempted: gradlog writes its tables on the way out
        return
    resume: bool | str = {"True": True, "auto": "auto"}[sys.argv[4]]
    state = torch.load(ckpt)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    model.late.requires_grad_(True)
    opt.param_groups[1]["lr"] = 0.0
    gradlog.watch(model, opt, writer=gradlog.Output(writer, resume=resume), every=5, log_dir=log_dir)
    train(model, opt, range(30, 60))
    report = gradlog.close()
    assert report is not None
    torch.save({"never": sorted(r.name for r in report.never_updated), "verdict": report.verdict}, ckpt + ".report")
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, ckpt + ".final")


if __name__ == "__main__":
    main()
