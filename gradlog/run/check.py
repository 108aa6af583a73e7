"""`gradlog.check`: one real training step before the run starts, then everything put back as it was.

Many bugs (a layer left out of the optimizer, an unused head, ``zero_grad()`` in the wrong place, a
zero learning rate, NaN gradients, bf16 updates that round away) show on the very first step.
`check` runs that step (or a few) on the user's own model and optimizer under a `GradLogger`, so the
reasons are the ones a run's report gives, and then restores the weights, the gradients (None stays
None), the buffers (BatchNorm's running statistics), the optimizer's state and param groups, the
modules' train/eval flags and the random number generators, bit for bit: training afterwards is
exactly what it would have been without the check.

What one batch cannot tell apart from a bug is labelled "in this batch" and does not make the verdict
a problem: rows, columns or elements whose gradient was exactly zero in every checked step
(embedding rows of tokens the batch does not hold, units inactive on this batch) are listed in
`CheckReport.in_batch` with reason `not_in_batch` (or `padding_idx` for an embedding's padding row),
apart from `Report.partly_updated`, which the verdict judges (it stays empty in a check).
A whole tensor that only a rare path uses (an expert the batch never routes to) looks the same as
an unused one in one batch; it is listed, and its detail says so: check with another batch.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import random
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from gradlog.measure.engines import refuse_check
from gradlog.measure.flat_shards import is_flat_shard  # an FSDP1 slice, as a DTensor shard: no in-batch slices
from gradlog.measure.optimizers import steppable
from gradlog.measure.params import NameFilter
from gradlog.measure.trace import StepTrace, TraceResult
from gradlog.run import lifecycle
from gradlog.run.logger import GradLogger
from gradlog.verdict.located import locate, not_registered, traced_hint
from gradlog.verdict.policy import Policy, PolicyLike, Rule
from gradlog.verdict.report import PARTLY_COLUMNS, PartlyUpdated, Reason, Report, format_table
from gradlog.verdict.slices import unseen_words
from gradlog.verdict.unchanged import partly_rows, reduce_to_slices, slice_dims, slice_word

LossFn = Callable[[nn.Module, Any], Any]
StepFn = Callable[..., Any]
_MISSING = object()


def default_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """``model(batch)`` (``model(*batch)`` for a tuple or list, ``model(**batch)`` for a dict), reduced to a scalar.

    A batch the model's ``forward`` cannot take that way (an ``(x, y)`` pair for a model of one input) is
    refused before the call, naming what was tried and how to pass the loss (issue 41: Python's bare
    "forward() takes 2 positional arguments but 3 were given" came from inside gradlog)."""
    args: tuple[Any, ...]
    if isinstance(batch, Mapping):
        args, kwargs, how = (), dict(batch), "model(**batch)"
    elif isinstance(batch, (tuple, list)):
        args, kwargs, how = tuple(batch), {}, "model(*batch)"
    else:
        args, kwargs, how = (batch,), {}, "model(batch)"
    _must_fit(model, args, kwargs, how, batch)
    return _scalar(model(*args, **kwargs), how)


def _must_fit(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], how: str, batch: Any) -> None:
    """Raise a TypeError that says what gradlog tried when `model.forward` cannot bind `args`/`kwargs`."""
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):  # a builtin or a forward without a signature: let the call decide
        return
    try:
        signature.bind(*args, **kwargs)
    except TypeError as exc:
        held = f"a {type(batch).__name__} of {len(batch)}" if isinstance(batch, (tuple, list, Mapping)) else "one value"
        raise TypeError(
            f"gradlog.check: without loss_fn= the loss is {how} reduced to a scalar, but the batch is {held} "
            f"and {type(model).__name__}.forward{signature} cannot take it that way ({exc}). Pass your loss, "
            "e.g. gradlog.check(model, optimizer, (x, y), loss_fn=lambda model, batch: "
            "torch.nn.functional.cross_entropy(model(batch[0]), batch[1])), or your own training step: "
            "gradlog.check(model, optimizer, step_fn=train_step)"
        ) from None


def _scalar(out: Any, what: str) -> torch.Tensor:
    """A tensor is summed; an object with a `.loss` (Hugging Face outputs) or a dict with "loss" gives that."""
    if isinstance(out, torch.Tensor):
        return out.sum()
    loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss.sum()
    raise TypeError(
        f"gradlog.check: {what} returned {type(out).__name__}, not a tensor or an output with a .loss tensor; "
        "pass loss_fn=lambda model, batch: <a scalar loss tensor>"
    )


@dataclass
class CheckReport(Report):
    """The `Report` of `gradlog.check`, plus `in_batch`: slices whose gradient was exactly zero on the
    checked batch. They depend on the data (tokens the batch lacks, units it leaves inactive), so they
    are shown apart and never make the verdict a problem."""

    #: judged like a run's partly-updated slices (`partly.not_in_batch`, `partly.padding_idx`: notes by
    #: default), so a check and a run give one answer to one fact
    in_batch: list[PartlyUpdated] = field(default_factory=list)

    def table(self) -> str:
        """The usual tables and verdict, then the data-dependent 'in this batch' table."""
        text = super().table()
        if self.in_batch:
            rows = partly_rows(self.in_batch)
            text += "\n\nIn this batch only (data-dependent; judged as partly-updated slices, notes by default):\n"
            text += format_table(PARTLY_COLUMNS, rows)
        return text

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out["in_batch"] = [p.to_dict(self.policy) for p in self.in_batch]
        return out


class RngState:
    """The random number generators a training step may draw from: torch's CPU and CUDA generators,
    Python's `random`, NumPy's global one (if NumPy is imported), and any extra `torch.Generator`s
    given (a sampler's own)."""

    def __init__(self, *generators: torch.Generator) -> None:
        self.cpu = torch.random.get_rng_state()
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
        self.cuda = torch.cuda.get_rng_state_all() if cuda else None
        self.python = random.getstate()
        np = sys.modules.get("numpy")
        self.numpy = np.random.get_state() if np is not None else None
        self.generators = [(g, g.get_state()) for g in generators]

    def restore(self) -> None:
        torch.random.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        random.setstate(self.python)
        np = sys.modules.get("numpy")
        if np is not None and self.numpy is not None:
            np.random.set_state(self.numpy)
        for g, state in self.generators:
            g.set_state(state)


class _Saved:
    """Everything one training step can change, copied so it can be put back bit for bit."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer
        params: dict[int, torch.Tensor] = {id(p): p for p in model.parameters()}
        for group in optimizer.param_groups:
            params.update({id(p): p for p in group["params"]})
        self.params = list(params.values())
        with torch.no_grad():
            self.values = [p.detach().clone() for p in self.params]
            self.grads = [(p.grad, None if p.grad is None else p.grad.detach().clone()) for p in self.params]
            self.buffers = [
                (m, name, b, None if b is None else b.detach().clone())
                for m in model.modules()
                for name, b in m._buffers.items()
            ]
        self.training = [(m, m.training) for m in model.modules()]
        state = optimizer.state
        self.state = {id(p): (state[p], {k: _clone(v) for k, v in state[p].items()}) for p in self.params if p in state}
        self.groups = [{k: _clone(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        self.opt_called = vars(optimizer).get("_opt_called", _MISSING)  # set by an LR scheduler's step wrapper
        self.rng = RngState()

    def restore(self) -> None:
        with torch.no_grad():
            for p, value, (grad, grad_copy) in zip(self.params, self.values, self.grads):
                p.copy_(value)
                if grad is not None and grad_copy is not None:
                    grad.copy_(grad_copy)
                p.grad = grad
            for m, name, b, b_copy in self.buffers:
                if b is not None and b_copy is not None:
                    b.copy_(b_copy)
                m._buffers[name] = b
        for m, training in self.training:
            m.training = training
        opt = self.optimizer
        for p in self.params:
            saved = self.state.get(id(p))
            if saved is None:
                opt.state.pop(p, None)
                continue
            original, values = saved
            for k, v in values.items():
                cur = original.get(k)
                if isinstance(v, torch.Tensor) and isinstance(cur, torch.Tensor) and cur.shape == v.shape:
                    with torch.no_grad():
                        cur.copy_(v)
                else:
                    original[k] = v
            for k in [k for k in original if k not in values]:
                del original[k]
            opt.state[p] = original
        for group, saved_group in zip(opt.param_groups, self.groups):
            for k in [k for k in group if k != "params" and k not in saved_group]:
                del group[k]
            group.update(saved_group)
        if self.opt_called is _MISSING:
            vars(opt).pop("_opt_called", None)
        else:
            vars(opt)["_opt_called"] = self.opt_called
        self.rng.restore()


def _clone(v: Any) -> Any:
    return v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)


def _plain(t: torch.Tensor) -> bool:
    return type(t) in (torch.Tensor, nn.Parameter)


def check(
    model: nn.Module,
    optimizer: Any,
    batch: Any = None,
    loss_fn: LossFn | None = None,
    steps: int = 1,
    *,
    step_fn: StepFn | None = None,
    print_report: bool = True,
    include: NameFilter = None,
    exclude: NameFilter = None,
    policy: PolicyLike = None,
) -> CheckReport:
    """Run `steps` real forward/backward/optimizer steps on `batch`, restore everything, return the report.

    `loss_fn(model, batch)` returns the loss (a tensor is summed; an object with ``.loss``, such as
    a Hugging Face output, gives that); by default ``model(batch)``, ``model(*batch)`` for a tuple
    or list, ``model(**batch)`` for a dict. The batch must already be on the model's device.
    Gradients are cleared before each step (and put back afterwards).

    ``step_fn``: your own training step instead (forward, backward, ``optimizer.step()``, your
    ``zero_grad()`` wherever your loop has it), called as ``step_fn(batch)``, or ``step_fn()`` without a
    batch; then a bug in the loop itself (``zero_grad()`` between ``backward()`` and ``step()``) shows.
    Gradients are cleared once, before the first step. A scheduler it steps is not put back (its
    ``lr`` in the param groups is): step it outside, or pass a copy.

    Needs memory for one copy of the weights, gradients and optimizer state. The report is printed
    unless ``print_report=False``; ``include`` / ``exclude`` choose tensors as in `GradLogger`;
    ``policy`` tunes severities as there (`gradlog.Policy`). A `GradLogger` already open on this model
    or optimizer is left alone: it does not count the check's steps, and goes on logging after it.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"gradlog.check: model must be a torch.nn.Module, got {type(model).__name__}")
    refuse_check(model, optimizer)  # before any step: its restore would fail on partitioned tensors
    opt = steppable(optimizer)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"gradlog.check: steps must be an integer >= 1 (optimizer steps to try), got {steps!r}")
    _check_step_args(batch, loss_fn, step_fn)
    lazy = [n for n, p in model.named_parameters() if isinstance(p, nn.parameter.UninitializedParameter)]
    if lazy:
        raise ValueError(
            f"gradlog.check: {lazy[0]!r} is not materialised yet (a lazy module), so it cannot be put back as it "
            "was; run one forward pass (model(batch)) before gradlog.check"
        )
    with lifecycle.set_aside(model, opt):
        saved = _Saved(model, opt)
        report, gl, seen, traced = _run(model, opt, batch, loss_fn, step_fn, steps, saved, (include, exclude, policy))
    fields = {f.name: getattr(report, f.name) for f in dataclasses.fields(Report)}
    _add_trace(fields, gl, traced)
    fields["never_updated"] = [_label_rare_path(rec, steps) for rec in fields["never_updated"]]
    # one batch's unchanged slices are data-dependent: shown apart, from the gradients (which weight
    # decay cannot blur), and never judged as problems
    fields["partly_updated"] = []
    fields["never_updated"], notes = _explained(fields["never_updated"], gl, opt, saved)
    if notes:
        base = report.policy if report.policy is not None else Policy()
        fields["policy"] = Policy([*(Rule.parse(spec, severity) for spec, severity in notes), *base.rules])
    result = CheckReport(**fields, in_batch=_in_batch(model, gl, report, seen))
    if print_report:
        print(result.table(), flush=True)
    return result


def _check_step_args(batch: Any, loss_fn: LossFn | None, step_fn: StepFn | None) -> None:
    if step_fn is not None:
        if not callable(step_fn):
            raise TypeError(f"gradlog.check: step_fn must be your training step (a callable), got {step_fn!r}")
        if loss_fn is not None:
            raise TypeError("gradlog.check: pass loss_fn= or step_fn=, not both (step_fn computes its own loss)")
        return
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"gradlog.check: loss_fn must be a callable (model, batch) -> loss, got {loss_fn!r}")
    if batch is None:
        raise TypeError(
            "gradlog.check needs a batch (gradlog.check(model, optimizer, batch)) or your training step "
            "(gradlog.check(model, optimizer, step_fn=train_step))"
        )


def _run(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    batch: Any,
    loss_fn: LossFn | None,
    step_fn: StepFn | None,
    steps: int,
    saved: _Saved,
    selection: tuple[NameFilter, NameFilter, PolicyLike],
) -> tuple[Report, GradLogger, dict[int, dict[int | None, torch.Tensor]], TraceResult]:
    """The checked steps under a memory-only logger; everything in `saved` put back, whatever happens."""
    include, exclude, policy = selection
    gl = GradLogger(
        model,
        opt,
        writer="memory",
        every=1,
        print_report=False,
        alerts=False,
        histograms=False,
        include=include,
        exclude=exclude,
        policy=policy,
    )
    gl._once.close(0)  # check traces its own first step below: the logger's run-time trace stays off
    seen: dict[int, dict[int | None, torch.Tensor]] = {}
    trace = StepTrace(model, opt)  # the first step is traced: where a weight's path from the loss is cut
    record = opt.register_step_pre_hook(lambda *_: _record_slices(saved.params, seen)) if step_fn else None
    try:
        for p in saved.params:
            p.grad = None
        for step in range(steps):
            if step == 0:
                trace.start()  # ends at the optimizer's step (the user's own, under step_fn)
            if step_fn is not None:
                _user_step(step_fn, batch, gl)
            else:
                for p in saved.params:
                    p.grad = None
                loss = _loss(model, batch, loss_fn)
                if step == 0:
                    trace.loss(loss)
                torch.autograd.backward(loss)
                _record_slices(saved.params, seen)
                opt.step()
            trace.stop()
            gl.log(step)
        report = gl.close()
    finally:
        trace.stop()
        if record is not None:
            record.remove()
        if not gl.closed:
            gl.print_report = False
            gl.close()
        saved.restore()
    return report, gl, seen, trace.result()


def _loss(model: nn.Module, batch: Any, loss_fn: LossFn | None) -> torch.Tensor:
    return _scalar(loss_fn(model, batch), "loss_fn(model, batch)") if loss_fn else default_loss(model, batch)


def _user_step(step_fn: StepFn, batch: Any, gl: GradLogger) -> None:
    """One call of the user's step; it must step the optimizer, or the check has nothing to judge."""
    before = gl.optimizer_steps
    step_fn() if batch is None else step_fn(batch)
    if gl.optimizer_steps == before:
        raise RuntimeError(
            "gradlog.check: step_fn returned without calling optimizer.step() on the optimizer given to check; "
            "step_fn must do the forward, the backward and the optimizer step"
        )


def _explained(
    records: list[Any], gl: GradLogger, opt: torch.optim.Optimizer, saved: _Saved
) -> tuple[list[Any], list[tuple[str, str]]]:
    """Records one check explains as the model's design, not a bug, each made a note (a policy rule for
    its name) with the evidence in its detail (issue 39):

    - `zero_grad` on a tensor whose output feeds a partner that starts at exactly zero (LoRA's A: its
      first gradient is zero because B starts at zero; it gets one once B has moved);
    - `zero_lr` in a param group whose `initial_lr` is above 0 (a scheduler's warm-up from lr 0)."""
    params = {row.name: row.param for row in gl.table.live}
    start = {id(p): v for p, v in zip(saved.params, saved.values)}
    groups = {id(p): g for g, p_group in zip(saved.groups, opt.param_groups) for p in p_group["params"]}
    out, notes = [], []
    for rec in records:
        why = None
        if rec.reason == Reason.ZERO_GRAD:
            partner = _zero_partner(rec.name, params, start, {r.name for r in records})
            if partner is not None:
                why = (
                    f"gradient exactly zero because its output feeds {partner}, which starts at exactly zero "
                    "(LoRA's B is zero-initialised by design): it gets a gradient once that tensor has moved"
                )
        elif rec.reason == Reason.ZERO_LR:
            group = groups.get(id(params[rec.name])) if rec.name in params else None
            initial = group.get("initial_lr") if group is not None else None
            if isinstance(initial, (int, float)) and initial > 0:
                why = (
                    f"lr is 0 now and the group's initial_lr is {initial:g}: a scheduler's warm-up from 0, "
                    "which raises the lr on later steps"
                )
        if why is None:
            out.append(rec)
            continue
        out.append(dataclasses.replace(rec, detail=f"{why}; a note, not a problem"))
        notes.append((f"never.{rec.reason}:{_glob_escape(rec.name)}", "note"))
    return out, notes


def _zero_partner(
    name: str, params: dict[str, torch.Tensor], start: dict[int, torch.Tensor], never: set[str]
) -> str | None:
    """A tensor next to `name` (the same module two levels up) that starts at exactly zero, was updated,
    and reads `name`'s output (its dim 1 is `name`'s dim 0, as LoRA's B [out, r] reads A [r, in])."""
    p = params.get(name)
    if p is None or p.dim() < 2:
        return None
    near = name.split(".")[:-3]
    for other, q in params.items():
        if other == name or other in never or q.dim() < 2 or q.shape[1] != p.shape[0]:
            continue
        if other.split(".")[:-3] != near:
            continue
        first = start.get(id(q))
        if first is not None and first.numel() > 0 and not bool(first.any()):
            return other
    return None


def _glob_escape(name: str) -> str:
    """`name` as a policy pattern that matches only itself (fnmatch's special characters bracketed)."""
    return "".join(f"[{c}]" if c in "*?[]" else c for c in name)


def _add_trace(fields: dict[str, Any], gl: GradLogger, trace: TraceResult) -> None:
    """The traced step's answers: each no-gradient record's cut and fix, tensors outside the model's
    parameters (counted among the tensors judged), the hint that tells "cleared" from "never reached"."""
    ids = {row.name: id(row.param) for row in gl.table.live}
    fields["hint"] = traced_hint(fields["hint"], fields["never_updated"], ids, trace)
    outside = not_registered(trace)
    fields["never_updated"] = locate(fields["never_updated"], ids, trace) + outside
    fields["tracked_tensors"] += len(outside)


def _record_slices(params: list[torch.Tensor], seen: dict[int, dict[int | None, torch.Tensor]]) -> None:
    """Per tensor and slice kind, which slices got a non-zero gradient in any checked step."""
    with torch.no_grad():
        for p in params:
            g = p.grad
            if g is None or not _plain(p) or is_flat_shard(p) or not slice_dims(tuple(p.shape)) or p.numel() == 0:
                continue
            if g.is_sparse:
                g = g.to_dense()
            nonzero = g != 0
            masks = seen.setdefault(id(p), {})
            for dim in slice_dims(tuple(p.shape)):
                got = reduce_to_slices(nonzero, dim).cpu()
                masks[dim] = got if dim not in masks else masks[dim] | got


def _in_batch(
    model: nn.Module, gl: GradLogger, report: Report, seen: dict[int, dict[int | None, torch.Tensor]]
) -> list[PartlyUpdated]:
    """Slices whose gradient was exactly zero in every checked step: data-dependent, labelled 'in this batch'."""
    padding: dict[int, int] = {}
    embeddings: set[int] = set()
    for m in model.modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
            embeddings.add(id(m.weight))
            if m.padding_idx is not None:
                padding[id(m.weight)] = int(m.padding_idx) % m.num_embeddings
    whole = {rec.name for rec in report.never_updated}
    out: list[PartlyUpdated] = []
    for row in gl.table.live:
        masks = seen.get(id(row.param))
        if masks is None or row.name in whole:
            continue
        for dim, got in masks.items():
            never = [int(i) for i in (~got).nonzero().reshape(-1).tolist()]
            if not never or len(never) == got.shape[0]:
                continue
            total = got.shape[0]
            pad = padding.get(id(row.param)) if dim == 0 else None
            if pad is not None and pad in never:
                out.append(
                    PartlyUpdated(
                        row.name,
                        dim,
                        1,
                        total,
                        (pad,),
                        Reason.PADDING_IDX,
                        f"in this batch: row {pad} is the embedding's padding_idx, never updated by design",
                    )
                )
                never.remove(pad)
                if not never:
                    continue
            if id(row.param) in embeddings and dim == 0:
                why = unseen_words(row.name, never, total, one_batch=True)
            elif dim == 1 and id(row.param) in embeddings:
                why = "embedding dimensions no id of this batch used"
            else:
                why = "inactive units, masked or unused inputs, or a gradient that cancels exactly"
            out.append(
                PartlyUpdated(
                    row.name,
                    dim,
                    len(never),
                    total,
                    tuple(never),
                    Reason.NOT_IN_BATCH,
                    f"in this batch: gradient exactly zero in these {slice_word(dim)}: {why}; "
                    "data-dependent, not a problem by itself",
                )
            )
    return out


def _label_rare_path(rec: Any, steps: int) -> Any:
    """One batch cannot tell an unused tensor from one only a rare path uses: say so where it matters."""
    if rec.reason in (Reason.NO_GRAD, Reason.ZERO_GRAD) and "traced step (" not in rec.detail:
        batch = "this batch" if steps == 1 else f"these {steps} steps on this batch"
        return dataclasses.replace(
            rec, detail=f"{rec.detail} (in {batch}: a path only some batches take looks the same; try another batch)"
        )
    return rec
