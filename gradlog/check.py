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
import random
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from gradlog.logger import GradLogger
from gradlog.measure.engines import refuse_unsupported
from gradlog.measure.optimizers import steppable
from gradlog.measure.params import NameFilter
from gradlog.verdict.policy import PolicyLike
from gradlog.verdict.report import PARTLY_COLUMNS, PartlyUpdated, Reason, Report, format_table
from gradlog.verdict.slices import unseen_words
from gradlog.verdict.unchanged import partly_rows, reduce_to_slices, slice_dims, slice_word

LossFn = Callable[[nn.Module, Any], Any]
_MISSING = object()


def default_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """``model(batch)`` (``model(*batch)`` for a tuple or list, ``model(**batch)`` for a dict), reduced to a scalar."""
    if isinstance(batch, Mapping):
        out = model(**batch)
    elif isinstance(batch, (tuple, list)):
        out = model(*batch)
    else:
        out = model(batch)
    return _scalar(out, "model(batch)")


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
    batch: Any,
    loss_fn: LossFn | None = None,
    steps: int = 1,
    *,
    print_report: bool = True,
    include: NameFilter = None,
    exclude: NameFilter = None,
    policy: PolicyLike = None,
) -> CheckReport:
    """Run `steps` real forward/backward/optimizer steps on `batch`, restore everything, return the report.

    `loss_fn(model, batch)` returns the loss (a tensor is summed; an object with ``.loss``, such as
    a Hugging Face output, gives that); by default ``model(batch)``, ``model(*batch)`` for a tuple
    or list, ``model(**batch)`` for a dict. The batch must already be on the model's device.
    Gradients are cleared before each step (and put back afterwards). Needs memory for one copy of
    the weights, gradients and optimizer state. The report is printed unless ``print_report=False``;
    ``include`` / ``exclude`` choose tensors as in `GradLogger`; ``policy`` tunes severities as there
    (`gradlog.Policy`).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"gradlog.check: model must be a torch.nn.Module, got {type(model).__name__}")
    refuse_unsupported(model, optimizer)  # before any step: its restore would fail on partitioned tensors
    opt = steppable(optimizer)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"gradlog.check: steps must be an integer >= 1 (optimizer steps to try), got {steps!r}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"gradlog.check: loss_fn must be a callable (model, batch) -> loss, got {loss_fn!r}")
    lazy = [n for n, p in model.named_parameters() if isinstance(p, nn.parameter.UninitializedParameter)]
    if lazy:
        raise ValueError(
            f"gradlog.check: {lazy[0]!r} is not materialised yet (a lazy module), so it cannot be put back as it "
            "was; run one forward pass (model(batch)) before gradlog.check"
        )
    saved = _Saved(model, opt)
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
    seen: dict[int, dict[int | None, torch.Tensor]] = {}
    try:
        for step in range(steps):
            for p in saved.params:
                p.grad = None
            loss = _scalar(loss_fn(model, batch), "loss_fn(model, batch)") if loss_fn else default_loss(model, batch)
            torch.autograd.backward(loss)
            _record_slices(saved.params, seen)
            opt.step()
            gl.log(step)
        report = gl.close()
    finally:
        if not gl.closed:
            gl.print_report = False
            gl.close()
        saved.restore()
    fields = {f.name: getattr(report, f.name) for f in dataclasses.fields(Report)}
    fields["never_updated"] = [_label_rare_path(rec, steps) for rec in report.never_updated]
    # one batch's unchanged slices are data-dependent: shown apart, from the gradients (which weight
    # decay cannot blur), and never judged as problems
    fields["partly_updated"] = []
    result = CheckReport(**fields, in_batch=_in_batch(model, gl, report, seen))
    if print_report:
        print(result.table(), flush=True)
    return result


def _record_slices(params: list[torch.Tensor], seen: dict[int, dict[int | None, torch.Tensor]]) -> None:
    """Per tensor and slice kind, which slices got a non-zero gradient in any checked step."""
    with torch.no_grad():
        for p in params:
            g = p.grad
            if g is None or not _plain(p) or not slice_dims(tuple(p.shape)) or p.numel() == 0:
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
    if rec.reason in (Reason.NO_GRAD, Reason.ZERO_GRAD):
        batch = "this batch" if steps == 1 else f"these {steps} steps on this batch"
        return dataclasses.replace(
            rec, detail=f"{rec.detail} (in {batch}: a path only some batches take looks the same; try another batch)"
        )
    return rec
