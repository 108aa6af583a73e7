"""A timm ViT trained under gradlog, run by tests/test_real_models.py with the python of a second venv.

timm imports torchvision at `import timm`, and torchvision needs its own torch build, which cannot sit beside
the project's CPU torch pin: so this runs in `.venv-timm` (see the `timm_python` fixture), with the repo on
PYTHONPATH, and prints what close() said as one JSON line for the test to compare with `gradlog report`.

python tests/timm_child.py LOG_DIR healthy   a tiny ViT, random images, AdamW: verdict OK
python tests/timm_child.py LOG_DIR frozen    the same, with blocks.1 frozen by mistake after the optimizer was built
"""

from __future__ import annotations

import json
import sys

import timm
import torch
from torch import nn

import gradlog


def main(log_dir: str, mode: str) -> None:
    torch.manual_seed(0)
    model = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2, num_classes=10
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if mode == "frozen":
        model.blocks[1].requires_grad_(False)  # meant to freeze the patch embedding, say: still in the optimizer
    gl = gradlog.GradLogger(model, opt, writer="tensorboard", log_dir=log_dir, every=1, print_report=False)
    for step in range(8):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 10, (4,), generator=g)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        gl.log(step)
        opt.zero_grad()
    report = gl.close()
    print(
        json.dumps(
            {
                "torch": torch.__version__,
                "timm": timm.__version__,
                "healthy": report.healthy,
                "verdict": report.verdict,
                "warnings": report.warnings(),
                "tensors": [n for n, _ in model.named_parameters()],
                "never_updated": [[r.name, r.reason.value, r.suspect] for r in report.never_updated],
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
