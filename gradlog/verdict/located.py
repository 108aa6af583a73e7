"""A traced step's answers put into the report: the cut named in the records of weights that got no gradient,
the tensors that took part in the step outside the model's parameters as records of their own
(`not_registered`), and the hint that says which of "cleared before step()" and "never reached" it was.

Each record that a trace explains ends with "fix: ..." and, where the cause is a line, its file and line.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from gradlog.measure.trace import BUFFER, Foreign, Site, TraceResult
from gradlog.verdict.report import NeverUpdated, Reason, Stalled

#: the hint `gradlog.verdict.diagnosis` gives when every trainable tensor had grad None
_NONE_HINT = "every trainable tensor had grad None"
#: the hint `gradlog.verdict.diagnosis` gives when every trainable tensor had an all-zero grad
_ZERO_HINT = "every trainable tensor had an all-zero grad"
_CLEARED_FIX = "clear the gradients before backward() or after step(), never between them"
#: the hint when a traced step saw backward() write every gradient and step() find none
CLEARED_HINT = (
    "every trainable tensor had grad None at step(), yet backward() computed their gradients: zero_grad() "
    "called between backward() and step() cleared them; fix: call it before backward() or after step()"
)


def _step_first(trace: TraceResult) -> str:
    """The loop's order, where step() comes before backward() in it: what clears the gradient in between."""
    if not trace.step_before_backward() or trace.step_site is None or trace.backward_site is None:
        return ""
    return (
        f": the loop calls step() at {trace.step_site.quoted()} before backward() at "
        f"{trace.backward_site.quoted()}, so each step() finds the gradient the next iteration's zero_grad() "
        "cleared (or none yet); fix: call step() after backward() (zero_grad(), forward, backward(), step())"
    )


def _zeroed_fix(op: str | None, site: Site | None) -> str:
    """The fix for a gradient backward() computed and something zeroed before step(), from what wrote it last."""
    if (site is not None and "clip_grad_value" in site.code) or op in ("_foreach_clamp_max_", "clamp_", "clamp_max_"):
        return "clip_grad_value_ with clip_value=0 clamps every gradient to 0: give clip_value a positive value"
    if (site is not None and "clip_grad" in site.code) or op in ("_foreach_mul_", "mul_"):
        return "gradient clipping with max_norm=0 scales every gradient to 0: give max_norm a positive value"
    if op in ("zero_", "_foreach_zero_", "fill_"):
        return f"{_CLEARED_FIX} (zero_grad(set_to_none=False) there leaves zeros)"
    return "leave the gradients as backward() wrote them until step()"


def cause(pid: int, trace: TraceResult, name: str | None = None) -> str | None:
    """What the traced step says kept one weight from a gradient, ending with the fix; None: it cannot say.
    `name`: the weight's name in the model, where known (a slot forward filled with another tensor)."""
    label = trace.label()
    if trace.cleared(pid):
        said = f"{label}: backward() wrote its gradient and it was None at step(): cleared in between"
        return said + (_step_first(trace) or f"; fix: {_CLEARED_FIX}")
    if trace.zeroed(pid):
        op, site = trace.zeroed_by.get(pid, (None, None))
        by = f" by `{op}`" if op else ""
        at = f" at {site.quoted()}" if site else ""
        return (
            f"{label}: backward() wrote a non-zero gradient and it was all zero at step(): set to zero in "
            f"between{by}{at}; fix: {_zeroed_fix(op, site)}"
        )
    cut = trace.cut_of.get(pid)
    if cut is not None:
        return f"{label}: {cut.located()}; fix: {cut.fix()}"
    hooks = trace.hooks_of.get(pid)
    if hooks:
        return (
            f"{label}: its gradient hook (register_hook) {hooks} returns an all-zero gradient; fix: return the "
            "gradient from the hook, or remove it"
        )
    fn = trace.function_of.get(pid)
    if fn is not None:
        gave = "None" if pid in trace.none_at_step else "an all-zero gradient"
        at = f" at {fn.site.quoted()}" if fn.site else ""
        return (
            f"{label}: it reaches the loss only through the custom autograd.Function `{fn.name}`, whose "
            f"backward(){at} returns {gave} for forward's tensor argument {fn.argument}, which leads to it; fix: "
            f"return that argument's gradient from {fn.name}.backward()"
        )
    if trace.loss_leaf:
        return (
            f"{label}: the loss has no grad_fn (a new tensor built from numbers), so no path leads to any "
            "weight; fix: return the loss tensor the model's outputs computed"
        )
    held, swap_site = trace.swapped.get(name or "", (pid, None))
    if pid not in trace.used and pid in trace.none_at_step and held != pid:
        where = f", swapped in at {swap_site.quoted()}" if swap_site is not None else ""
        return (
            f"{label}: its module ran with another tensor in its place{where} ({name}: torch.func.functional_call "
            "or another stateless call swaps in the tensors it is given), so backward() gave that tensor the "
            "gradient and no torch call read this one, which the optimizer steps; fix: pass the model's own "
            "parameters (dict(model.named_parameters())), or build the optimizer over the tensors you pass"
        )
    if pid not in trace.used and pid in trace.none_at_step:
        return (
            f"{label}: no torch call read it, so it is unused in forward; fix: call its module in forward(), "
            "or leave it out of the model"
        )
    return None


def locate(records: Sequence[NeverUpdated], ids: Mapping[str, int], trace: TraceResult) -> list[NeverUpdated]:
    """`records` with the traced cause in the detail of each no-gradient or zero-gradient one, and the line that
    froze each frozen one the traced step froze again (`ids`: tensor name -> `id` of the parameter); the other
    records as they were."""
    out = []
    for rec in records:
        pid = ids.get(rec.name)
        if pid is not None and rec.reason == Reason.FROZEN and rec.suspect and pid in trace.frozen_by:
            site = trace.frozen_by[pid]
            at = f" at {site.quoted()}" if site is not None else ""
            said = (
                f"; {trace.label()}: set to requires_grad=False{at}, which runs at every step (inside forward or "
                "the loop), so it never trains; fix: freeze it once before training if that is meant, or remove "
                "that call"
            )
            out.append(dataclasses.replace(rec, detail=rec.detail + said))
            continue
        why = (
            None if pid is None or rec.reason not in (Reason.NO_GRAD, Reason.ZERO_GRAD) else cause(pid, trace, rec.name)
        )
        if why is None:
            out.append(rec)
            continue
        evidence = rec.detail.split(": unused in forward")[0]  # the guesses make way for the traced answer
        out.append(dataclasses.replace(rec, detail=f"{evidence}; {why}"))
    return out


def remade(records: Sequence[NeverUpdated], trace: TraceResult) -> list[NeverUpdated]:
    """`records` with one record per parameter forward makes anew at every call (``self.gain =
    nn.Parameter(...)`` in forward), saying so with the line: the optimizer's first tensor of that name
    (`not_in_model`) where there is one, else the model's latest; the other records of that name (the latest
    one, first seen after the last step or in no param group) are the same cause and go."""
    kinds = (Reason.NOT_IN_MODEL, Reason.UNKNOWN, Reason.NOT_IN_OPTIMIZER)
    named = {r.name for r in records if r.name in trace.remade and r.reason in kinds}
    keep = {
        n: next((r for r in records if r.name == n and r.reason == Reason.NOT_IN_MODEL), None)
        or next(r for r in records if r.name == n and r.reason in kinds)
        for n in named
    }
    out: list[NeverUpdated] = []
    for rec in records:
        if rec.name not in named or rec.reason not in kinds:
            out.append(rec)
        elif rec is keep[rec.name]:
            site = trace.remade[rec.name]
            at = f" at {site.quoted()}" if site is not None else ""
            said = (
                f"{trace.label()}: forward makes a new nn.Parameter `{rec.name}` at every call{at}: the tensor "
                "the optimizer holds (if any) is not the one forward reads, and each new one is in no param group "
                "and replaced at the next call, so none ever learns; fix: create it once in __init__ and only use "
                "it in forward"
            )
            # the model's latest tensor of the name, where the optimizer holds none: it is in no param group
            reason = Reason.NOT_IN_OPTIMIZER if rec.reason == Reason.UNKNOWN else rec.reason
            out.append(dataclasses.replace(rec, reason=reason, detail=said))
    return out


def not_registered(trace: TraceResult) -> list[NeverUpdated]:
    """One record per tensor that took part in the traced step and got a gradient, yet is no parameter of the
    model: no optimizer built from ``model.parameters()`` steps it, and nothing else would say so."""
    out = []
    for f in trace.foreign:
        t = f.tensor
        name = f.path or f"<{type(t).__name__} {tuple(t.shape)}>"
        out.append(NeverUpdated(name, tuple(t.shape), t.numel(), Reason.NOT_REGISTERED, _detail(f)))
    return out


def _detail(f: Foreign) -> str:
    used = f" (first used at {f.site.quoted()})" if f.site else ""
    head = f"used in the traced step{used} and given a gradient, but not a parameter of the model"
    if f.container is not None and f.path is not None:
        attr = f.path.split("[")[0]
        if f.container == BUFFER:
            short = attr.rsplit(".", 1)[-1]
            return (
                f"{head}: {attr} is {f.container}: it requires grad, so backward() gives it a gradient, but buffers "
                "are not in parameters(), so no optimizer steps it; fix: register it as a parameter "
                f"(self.{short} = nn.Parameter(...), or self.register_parameter('{short}', ...)), or keep it a "
                "buffer without requires_grad if it is not meant to learn"
            )
        if f.container.startswith("a plain tensor"):
            return (
                f"{head}: {attr} is {f.container}, so no optimizer sees it; "
                f"fix: make it an nn.Parameter (self.{attr.rsplit('.', 1)[-1]} = nn.Parameter(...))"
            )
        holder = "nn.ModuleDict" if " dict " in f.container else "nn.ModuleList"
        if "Parameter" in f.container or "Tensor" in f.container:
            holder = "nn.ParameterDict" if " dict " in f.container else "nn.ParameterList"
        return f"{head}: {attr} is {f.container}, so no optimizer sees it; fix: hold them in {holder}"
    return (
        f"{head}: a module created inside forward(), or a tensor made with requires_grad=True there, is new at "
        "every step and never trained; fix: create it once in __init__ as a submodule or nn.Parameter"
    )


def traced_hint(
    hint: str | None, records: Sequence[NeverUpdated | Stalled], ids: Mapping[str, int], trace: TraceResult
) -> str | None:
    """The hint, with "every trainable tensor had grad None: is zero_grad() misplaced?" replaced by what the
    trace saw: gradients computed and cleared before step(), or a loss that never reached the weights (and
    where it was cut). `records`: the never-updated and stalled ones (a resumed run's tensors quiet since the
    resume are stalled); its "from the resume at step N on, " stays in front."""
    prefix, found, _ = (hint or "").partition(_NONE_HINT)
    if not found:
        return _traced_zero_hint(hint, records, ids, trace)
    pids = [ids[r.name] for r in records if r.reason == Reason.NO_GRAD and r.name in ids]
    if not pids:
        return hint
    if all(trace.cleared(p) for p in pids):
        order = _step_first(trace)
        return prefix + (
            f"{_NONE_HINT} at step(), yet backward() computed their gradients{order}" if order else CLEARED_HINT
        )
    if any(p in trace.accumulated for p in pids):
        return hint
    cuts = [trace.cut_of[p] for p in pids if p in trace.cut_of]
    nearest = max(cuts, key=lambda c: c.seq) if cuts else None  # the cut nearest the loss
    first = next((p for p in pids if trace.cut_of.get(p) is nearest), pids[0])
    why = cause(first, trace, next((n for n, p in ids.items() if p == first), None))
    where = f": {why.split('): ', 1)[-1]}" if why else ""  # the cause without the trace's label
    return f"{prefix}{_NONE_HINT}: the loss never reached them (backward() wrote no gradient){where}"


def _traced_zero_hint(
    hint: str | None, records: Sequence[NeverUpdated | Stalled], ids: Mapping[str, int], trace: TraceResult
) -> str | None:
    """The hint "every trainable tensor had an all-zero grad: zero_grad misplaced, clipped to 0, or a constant
    loss?" replaced by the traced answer when the trace gives every one of them the same cause (one clip call,
    one cut): the guesses make way for it."""
    prefix, found, _ = (hint or "").partition(_ZERO_HINT)
    if not found:
        return hint
    pids = [ids[r.name] for r in records if r.reason == Reason.ZERO_GRAD and r.name in ids]
    causes = {cause(p, trace) for p in pids}
    if not pids or len(causes) != 1 or None in causes:
        return hint
    why = next(iter(causes)) or ""
    return f"{prefix}{_ZERO_HINT}: {why.split('): ', 1)[-1]}"  # the cause without the trace's label
