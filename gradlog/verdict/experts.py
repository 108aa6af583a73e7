"""Mixture-of-experts layers: the findings of their expert tensors said per expert, grouped per layer.

A user thinks "experts 6-7 and 14 of 32 got no gradient", not "rows 6-7, 14 of gate_up_proj". Two layouts:

- **Fused**: one 3-D parameter holds every expert of a layer along dim 0 (transformers' `MixtralExperts`:
  `experts.gate_up_proj` (E, 2I, H), `experts.down_proj` (E, H, I)). A 3-D parameter is taken for a set of
  experts when it has exactly 3 dims, its owning module is not a convolution (`nn.Conv1d/2d/3d` and their
  transposed forms hold 3-D+ weights that are filters, not experts), and either the owning module's class
  name or a component of the parameter's path contains "expert" (case-insensitive). A 3-D parameter that
  matches none of this (a custom module's stacked heads) is reported by rows, as before.
- **Per-expert modules**: `...experts.3.w1.weight`: a path component containing "expert" followed by an
  integer component. The layer is the path up to that component; the expert count is the container's
  `len()` when it has one (an `nn.ModuleList`), else the highest index seen + 1. An expert is reported
  only when every tracked tensor of it is in the same state (all never updated, or all stalled): one
  tensor of an expert that never learned is the tensor tables' finding, not the expert's.

The records come from the others (`never_updated`, `partly_updated`, `stalled`, `stopped_slices`), so they
add no evidence and no verdict of their own: the verdict counts those.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gradlog.measure.owners import Owner, Owners
from gradlog.measure.params import Tracked, is_materialized
from gradlog.verdict.records import format_ranges
from gradlog.verdict.report import (
    IdleExperts,
    NeverUpdated,
    PartlyUpdated,
    Reason,
    Stalled,
    StoppedSlice,
)


@dataclass(frozen=True)
class ExpertTensor:
    """Where one tracked tensor sits among experts: its layer, the layer's expert count, and its expert
    (None: a fused tensor holding all of them along dim 0)."""

    layer: str
    count: int
    expert: int | None


def is_fused_experts(owner: Owner | None, path: str, dims: int) -> bool:
    """Whether a parameter of `dims` dims at `path`, held by `owner` (None: no module of the model holds
    it), is a fused set of experts along dim 0 (see the module docstring)."""
    if dims != 3 or (owner is not None and owner.family == "conv"):
        return False
    named = owner is not None and owner.expert_class
    return named or any("expert" in part.lower() for part in path.split("."))


def _per_expert(path: str) -> tuple[str, int] | None:
    """(layer path, expert index) of `...experts.3.w1.weight`, else None (the last such pair in the path)."""
    parts = path.split(".")
    for i in range(len(parts) - 2, 0, -1):
        if parts[i].isdigit() and "expert" in parts[i - 1].lower():
            return ".".join(parts[:i]), int(parts[i])
    return None


def expert_layout(owners: Owners, rows: Sequence[Tracked]) -> dict[str, ExpertTensor]:
    """Tracked tensor name -> its place among experts, for the tensors that are experts' (names as reported),
    from the tensors' owning modules and the model's expert containers as `owners` describes them."""
    containers = owners.expert_containers
    out: dict[str, ExpertTensor] = {}
    seen: dict[str, int] = {}
    for row in rows:
        p = row.held()
        if p is None or not is_materialized(p):
            continue
        per = _per_expert(row.name)
        if per is not None:
            layer, k = per
            seen[layer] = max(seen.get(layer, 0), k + 1)
            out[row.name] = ExpertTensor(layer, 0, k)
        elif is_fused_experts(owners.get(row.index), row.name, len(row.shape)):  # the whole tensor's shape
            layer = row.name.rsplit(".", 1)[0] if "." in row.name else row.name
            out[row.name] = ExpertTensor(layer, int(row.shape[0]), None)
    for name, t in out.items():
        if t.expert is not None:
            count = containers.get(t.layer, seen[t.layer])
            for path, n in containers.items():  # tracked names may carry a wrapper's prefix (FSDP, compile)
                if t.layer.endswith("." + path) or path.endswith("." + t.layer):
                    count = n
            out[name] = ExpertTensor(t.layer, max(count, seen[t.layer]), t.expert)
    return out


def idle_experts(
    layout: dict[str, ExpertTensor],
    never: Sequence[NeverUpdated],
    partly: Sequence[PartlyUpdated],
    stalled: Sequence[Stalled],
    stopped: Sequence[StoppedSlice],
) -> list[IdleExperts]:
    """The experts of each layer that got no gradient (never, or from some step on), one record per layer,
    state, reason and stop step, in the order of the layers' first tensors. A resumed run passes its merged
    records (`Pipeline.diagnose`), so the experts found span its segments."""
    if not layout:
        return []
    # (layer, state, reason) -> expert -> (since, last, tensor names)
    found: dict[tuple[str, str, Reason], dict[int, tuple[int, int, set[str]]]] = {}
    counts: dict[str, int] = {}

    def note(layer: str, state: str, reason: Reason, experts: Sequence[int], since: int, last: int, name: str) -> None:
        per = found.setdefault((layer, state, reason), {})
        for k in experts:
            s, lst, names = per.get(k, (since, last, set()))
            per[k] = (min(s, since), max(lst, last), names | {name})

    for layer_t in layout.values():
        counts[layer_t.layer] = max(counts.get(layer_t.layer, 0), layer_t.count)
    for r in partly:
        t = layout.get(r.name)
        if t is not None and t.expert is None and r.dim == 0:
            note(t.layer, "never", r.reason, r.indices, -1, -1, r.name)
    for s in stopped:
        t = layout.get(s.name)
        if t is not None and t.expert is None and s.dim == 0:
            note(t.layer, "stopped", s.reason, s.indices, s.since_step, s.last_grad_step, s.name)
    # per-expert modules: an expert is reported when all its tracked tensors are in the same state
    members: dict[tuple[str, int], set[str]] = {}
    for name, t in layout.items():
        if t.expert is not None:
            members.setdefault((t.layer, t.expert), set()).add(name)
    whole: dict[str, tuple[str, Reason, int, int]] = {r.name: ("never", r.reason, -1, -1) for r in never}
    whole.update({r.name: ("stopped", r.reason, r.since_step, r.last_update_step) for r in stalled})
    for (layer, k), names in members.items():
        states = [whole.get(n) for n in names]
        if any(s is None for s in states) or len({s[0] for s in states if s is not None}) != 1:
            continue
        for n, st in zip(names, states):
            assert st is not None
            note(layer, st[0], st[1], [k], st[2], st[3], n)
    order = {t.layer: i for i, t in reversed(list(enumerate(layout.values())))}
    out: list[IdleExperts] = []
    for (layer, state, reason), per in sorted(found.items(), key=lambda kv: (order[kv[0][0]], kv[0][1] != "never")):
        for since in sorted({v[0] for v in per.values()}):
            alike = {k: v for k, v in per.items() if v[0] == since}
            out.append(_record(layer, state, reason, alike, counts[layer]))
    return out


def _record(
    layer: str, state: str, reason: Reason, per: dict[int, tuple[int, int, set[str]]], total: int
) -> IdleExperts:
    """One layer's experts in one state, for one reason, from one step on (`per`: expert -> since, last step
    with a gradient, tensor names): experts that stopped at different steps are separate records, so that
    each record's step is theirs (a resumed run: one stopped before the resume, one at it)."""
    experts = tuple(sorted(per))
    since = min(v[0] for v in per.values())
    last = max(v[1] for v in per.values())
    tensors = sorted({n for v in per.values() for n in v[2]})
    what = f"expert{'s' if len(experts) != 1 else ''} {format_ranges(experts, 8)} of {total}"
    shown = ", ".join(n.removeprefix(layer + ".") for n in tensors[:4]) + (", ..." if len(tensors) > 4 else "")
    if state == "never":
        detail = f"{what} got no gradient at any measured step ({reason.value} in {shown})"
    else:
        seen = f"at step {last}" if last >= 0 else f"before step {since}"  # -1: not known (stopped at a resume)
        detail = f"{what} got no gradient from step {since} on (the last {seen}; {reason.value} in {shown})"
    if reason is Reason.NOT_ROUTED:
        detail += ": the router's rows for them stopped too, no token is routed to them any more"
    return IdleExperts(layer, state, experts, total, since, reason, detail)
