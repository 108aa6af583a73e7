"""Short planted-bug training runs whose checkpoints the `gradlog diff` tests compare."""

from __future__ import annotations

import json
import os

import torch
from catalogue import CheckpointPlanted

VOCAB, SEEN, DIM = 40, 30, 8


def train_checkpoints(steps_between: int = 4, nan_at_end: bool = True, seed: int = 0) -> list[dict[str, object]]:
    """Three full checkpoints ({"model", "optimizer", "step"}): at init, after the first stretch (then
    mid's lr goes to 0), after the second (then, optionally, a NaN planted in out.weight)."""
    torch.manual_seed(seed)
    model = CheckpointPlanted(VOCAB, DIM)  # batches draw ids below SEEN only
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad and not n.startswith("mid.")]
    opt = torch.optim.Adam(
        [{"params": named}, {"params": [(f"mid.{n}", p) for n, p in model.mid.named_parameters()]}], lr=0.05
    )
    out: list[dict[str, object]] = []

    def save(step: int) -> None:
        out.append(
            {
                "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
                "optimizer": _clone(opt.state_dict()),
                "step": step,
            }
        )

    save(0)
    step = 0
    for stretch in range(2):
        for _ in range(steps_between):
            x = torch.randint(0, SEEN, (16, 5))
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
        if stretch == 0:
            opt.param_groups[1]["lr"] = 0.0
        elif nan_at_end:
            with torch.no_grad():
                model.out.weight[0, 0] = float("nan")
        save(step)
    return out


def _clone(obj: object) -> object:
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone(v) for v in obj]
    return obj


def save_torch(ck: dict[str, object], path: str) -> str:
    torch.save(ck, path)
    return path


def save_safetensors(ck: dict[str, object], path: str) -> str:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in ck["model"].items()}, path)  # type: ignore[attr-defined]
    return path


def save_sharded(ck: dict[str, object], folder: str, shards: int = 2) -> str:
    """A Hugging Face style folder: model-0000i-of-0000n.safetensors + model.safetensors.index.json +
    the Trainer's optimizer.pt."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    sd: dict[str, torch.Tensor] = ck["model"]  # type: ignore[assignment]
    names = list(sd)
    weight_map = {}
    for s in range(shards):
        part = names[s::shards]
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: sd[k].contiguous() for k in part}, os.path.join(folder, fname))
        weight_map.update(dict.fromkeys(part, fname))
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)
    torch.save(ck["optimizer"], os.path.join(folder, "optimizer.pt"))
    return folder
