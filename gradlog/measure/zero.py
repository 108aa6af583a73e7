"""DeepSpeed ZeRO-1, -2 and -3, measured globally through a model-facing view of the ZeRO optimizer.

Under ZeRO-1/2 every rank holds the model's weights whole (the bit16 copies, all-gathered after each
step), but its gradients only as fragments of flat per-rank partitions: at the optimizer's step every
model tensor has `.grad=None`, and the averaged gradient of a tensor is spread over the ranks that own
its elements (`param._hp_mapping`: which elements of the tensor, where in the rank's partition). The
ZeRO optimizer steps its inner torch optimizer once per param group, over those flat fp32 partitions.

`ZeroView` is a `torch.optim.Optimizer` over the model's own parameters, grouped as the ZeRO optimizer
groups them, that gradlog hooks as usual. It takes the place of the ZeRO optimizer's `step` (an
instance attribute, removed at close): one view step per engine step, whatever the number of groups.
On a step gradlog measures, the tensors' gradients are rebuilt whole first: each rank writes its
fragments into one zeroed flat buffer of the trained tensors and ONE ``all_reduce(SUM)`` over the
data-parallel group completes it (each element lives on one rank, so the sum is exact). They are the
averaged gradients before clipping (and unscaled), as the engine's `get_global_grad_norm()` sees
them; they are the tensors' `.grad` while gradlog's pre-hook measures, and the ZeRO step runs with the
gradients it had. The weights before and after are the model's own (updated from the fp32 masters by
DeepSpeed's all-gather before the view's post-hook runs). Unmeasured steps cost a counter and a flag.
After every ZeRO step the view offers DeepSpeed's verdict (`overflow`: the step was skipped) as a fused
optimizer's `found_inf`, and on measured steps the clip coefficient `gradient_clipping` applied.

ZeRO-3 (`Zero3View`) differs in where the tensors live: each rank holds one contiguous part of every
parameter's flattened form, so the tensors are measured as those parts (FSDP1's layout) through gradlog's
sharded path, with no gather at all.

gradlog never imports deepspeed: everything here is read off the objects DeepSpeed built.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gradlog.measure.distributed import Reducer
from gradlog.measure.flat_shards import FlatShard, register_shard

#: the ZeRO-1/2 optimizer class (deepspeed/runtime/zero/stage_1_and_2.py)
ZERO12 = "DeepSpeedZeroOptimizer"
#: the ZeRO-3 optimizer class (deepspeed/runtime/zero/stage3.py)
ZERO3 = "DeepSpeedZeroOptimizer_Stage3"


class ZeroView(torch.optim.Optimizer):
    """The model's parameters as the DeepSpeed ZeRO-1/2 optimizer `zero` trains them: one group per
    ZeRO group (its trained tensors, the inner group's settings), one step per ZeRO step."""

    #: after each step `found_inf` says whether DeepSpeed skipped it (see `_skipped`)
    _step_supports_amp_scaling = True

    def __init__(self, zero: Any, outside: list[nn.Parameter] | None = None) -> None:
        groups = [{**_settings(inner), "params": list(params)} for params, inner in self._pairs(zero)]
        super().__init__(groups, {})
        self._zero = weakref.ref(zero)
        self._step = type(zero).step  # the class's step: the instance attribute set below is ours
        #: whether the next step is measured (set by the logger; False before and after it)
        self.due: Callable[[], bool] = lambda: False
        #: all_reduce(SUM) over the data-parallel group, in place (set by the logger; defaults to torch's)
        self.all_reduce: Callable[[torch.Tensor, Any], None] = _all_reduce
        #: a measured step's stand-ins, put back by `_restore`: each tensor's own gradient and `.data`
        self._grads: list[tuple[nn.Parameter, torch.Tensor | None]] = []
        self._data: list[tuple[nn.Parameter, torch.Tensor]] = []
        self._measuring = False
        #: whether the last ZeRO step was skipped (fp16 overflow, or a global norm that is not finite: DeepSpeed
        #: then leaves the weights as they were), read after every step as a fused optimizer's flag is
        #: (`gradlog.measure.amp`): gradlog counts the step as skipped, not as a step without an update
        self.found_inf = torch.zeros(1)
        #: optimizer steps counted so far by the logger (set by `connect`): the measured step's index
        self.steps: Callable[[], int] = lambda: 0
        #: measured step index -> DeepSpeed's clip coefficient of that step (`gradient_clipping`), until published
        self._clips: dict[int, float] = {}
        #: bf16/fp16 weights: their fp32 masters differ, and gradlog measures those (update ratios, weights)
        self._bit16 = any(p.dtype != torch.float32 for g in self.param_groups for p in g["params"])
        #: the model's trainable tensors the ZeRO optimizer does not hold: DeepSpeed never reduces their
        #: gradients (each rank's own, accumulating), so a measured step sees none (reason not_in_optimizer)
        self._outside = list(outside or [])
        view = weakref.ref(self)

        def step(*args: Any, **kwargs: Any) -> Any:
            me = view()
            return me.engine_step(*args, **kwargs) if me is not None else type(zero).step(zero, *args, **kwargs)

        zero.step = self._patch = step

    def connect(self, due: Callable[[], bool], reducer: Reducer | None, steps: Callable[[], int]) -> None:
        """Measure the steps `due` says (the logger's next measured step); collectives through `reducer`
        (a gloo peer that never joins raises instead of hanging); `steps`: the logger's optimizer steps so far."""
        self.due, self.steps = due, steps
        if reducer is not None:
            self.all_reduce = lambda t, group: reducer.all_reduce(t, "sum", -1, group=group)

    # --- the step ----------------------------------------------------------------------------------
    def engine_step(self, closure: Any = None) -> Any:
        """Called in place of the ZeRO optimizer's step: on a measured step the gradients are made whole
        first, then `step` runs with gradlog's hooks around it (torch's Optimizer wraps it)."""
        zero = self._zero()
        if zero is None:
            return None
        self._refresh(zero)
        self._measuring = self.due()
        try:
            if self._measuring:
                self._whole(zero)
            return self.step() if closure is None else self.step(closure)
        finally:
            self._measuring = False
            self._restore()

    def step(self, closure: Any = None) -> Any:
        """The ZeRO step itself, between gradlog's step pre- and post-hook."""
        zero = self._zero()
        self._restore()  # the ZeRO step runs with the weights and gradients it had (None under ZeRO-2)
        out = self._step(zero) if closure is None else self._step(zero, closure)
        self._skipped(zero)
        if self._measuring and self._bit16:  # the post-hook reads the fp32 masters after the step
            self._show_masters(zero, self._gather(zero, grads=False))
        return out

    def shown(self) -> contextlib.AbstractContextManager[None]:
        """While gradlog reads the weights outside the step (construction, diagnosis): ZeRO-1/2's are whole."""
        return contextlib.nullcontext()

    def _skipped(self, zero: Any) -> None:
        """DeepSpeed's verdict on the step that just ran: skipped (`overflow`) or not; on a measured step that
        ran, the clip coefficient it applied (`clip_coef`)."""
        overflow = bool(getattr(zero, "overflow", False))
        self.found_inf = torch.ones(1) if overflow else torch.zeros(1)
        clip = float(getattr(zero, "clip_grad", 0.0) or 0.0)
        if self._measuring and clip > 0 and not overflow:
            # DeepSpeed divides the gradients by ((norm + 1e-6) / clip) when that exceeds 1: torch's coefficient
            norm = float(getattr(zero, "_global_grad_norm", 0.0) or 0.0)
            self._clips[self.steps() - 1] = min(1.0, clip / (norm + 1e-6))

    def clip_coef(self, index: int) -> float | None:
        """The clip coefficient DeepSpeed applied at measured step `index` (None: it did not clip there); the
        entries of that step and earlier ones are dropped."""
        coef = self._clips.get(index)
        for k in [k for k in self._clips if k <= index]:
            del self._clips[k]
        return coef

    def release(self) -> None:
        """Give the ZeRO optimizer its own step back (close())."""
        zero = self._zero()
        self.due = lambda: False
        if zero is not None and vars(zero).get("step") is self._patch:  # not a later logger's view
            del zero.step

    # --- the tensors made whole ----------------------------------------------------------------------
    def _params(self) -> list[nn.Parameter]:
        return [p for g in self.param_groups for p in g["params"]]

    def _gather(self, zero: Any, grads: bool) -> torch.Tensor:
        """One flat fp32 buffer, whole on every rank after ONE all_reduce(SUM): every trained tensor's
        averaged gradient (`grads`), then, for bit16 weights, its fp32 master."""
        params = self._params()
        sizes = [p.numel() for p in params]
        total = sum(sizes)
        parts = (2 if self._bit16 else 1) if grads else 1
        device = params[0].device if params else torch.device("cpu")
        flat = torch.zeros(parts * total, dtype=torch.float32, device=device)
        at = 0
        for p, n in zip(params, sizes):
            mapping = getattr(p, "_hp_mapping", None)
            fragment = _grad_fragment(p, n) if grads else None
            if fragment is not None:
                start, values = fragment
                flat[at + start : at + start + values.numel()] = values
            if mapping is not None and (self._bit16 or not grads):
                start, numel = int(mapping.lp_fragment_address.start), int(mapping.lp_fragment_address.numel)
                base = at + (total if grads else 0)
                flat[base + start : base + start + numel] = mapping.hp_fragment.detach().reshape(-1).float()
            at += n
        self.all_reduce(flat, zero.dp_process_group)
        return flat

    def _whole(self, zero: Any) -> None:
        """Every trained tensor's averaged gradient, whole, as its `.grad` (bit16 weights: shown as their
        fp32 masters, and the gradient in fp32); the tensors outside the optimizer show none."""
        flat = self._gather(zero, grads=True)
        params = self._params()
        total = sum(p.numel() for p in params)
        scale = float(getattr(zero, "loss_scale", 1.0) or 1.0)
        if scale != 1.0:  # fp16's dynamic loss scale: the gradients as the engine's norm reports them
            flat[:total] /= scale
        self._grads = [(p, p.grad) for p in [*params, *self._outside]]
        for p in [*params, *self._outside]:
            p.grad = None
        if self._bit16:
            self._show_masters(zero, flat[total:])
        at = 0
        for p in params:
            n = p.numel()
            p.grad = flat[at : at + n].view(p.shape).to(p.dtype)
            at += n

    def _show_masters(self, zero: Any, masters: torch.Tensor) -> None:
        """The bit16 weights' `.data` are their fp32 masters until `_restore` (the ZeRO step never sees it)."""
        at = 0
        for p in self._params():
            n = p.numel()
            if len(self._data) < len(self._params()):
                self._data.append((p, p.data))
            p.data = masters[at : at + n].view(p.shape)
            at += n

    def _restore(self) -> None:
        grads, self._grads = self._grads, []
        data, self._data = self._data, []
        for p, _ in grads:
            p.grad = None
        for p, d in data:
            p.data = d
        for p, g in grads:
            if g is not None and (g.shape != p.data.shape or g.dtype != p.data.dtype):
                # ZeRO-3 leaves a tensor outside its optimizer a whole gradient on a (0,) weight: put it back
                # as it was (torch checks a gradient against the weight's shape only when it is assigned)
                d, p.data = p.data, g
                p.grad, p.data = g, d
            else:
                p.grad = g

    def _refresh(self, zero: Any) -> None:
        """The inner groups' current settings (a scheduler's lr) on the view's groups."""
        for mine, inner in zip(self.param_groups, zero.optimizer.param_groups):
            mine.update(_settings(inner))

    @staticmethod
    def _pairs(zero: Any) -> Iterator[tuple[list[nn.Parameter], dict[str, Any]]]:
        """(trained model tensors, inner param group) per ZeRO group."""
        yield from zip(zero.bit16_groups, zero.optimizer.param_groups)


@dataclass(frozen=True)
class Part:
    """Where this rank's part of one ZeRO-3 parameter lives: its layout (`shard`: the whole shape, which
    elements of the flattened tensor this rank holds), and for a trained one its sub-group, its index there
    (its gradient partition in `averaged_gradients[sub]`) and its offset in the sub-group's flat fp32 master."""

    shard: FlatShard
    sub: int = -1
    index: int = -1
    offset: int = 0


class Zero3View(ZeroView):
    """The model's parameters as the DeepSpeed ZeRO-3 optimizer trains them, measured as this rank's 1-D parts.

    Under ZeRO-3 a parameter is shape (0,) outside forward and backward (whole on every rank only when it is
    under DeepSpeed's persistence threshold), and each rank holds one contiguous slice of its flattened form:
    `partition_numel()` elements from `rank * partition_numel()` (the last rank's padded). That is FSDP1's
    layout, so each tensor is registered as a `FlatShard` and measured through the same code and collectives
    (`gradlog.measure.distributed`: each element lives on one rank, sums of squares and histogram buckets add
    up). While gradlog reads the weights (a measured step's hooks, `shown()`), every parameter's `.data` is
    this rank's part: a trained tensor's fp32 master (`fp32_partitioned_groups_flat[sub]` at
    `grad_position[ds_id]`), which the step updates in place, a frozen one's own partition (`ds_tensor`); and
    on a measured step's pre-hook a trained tensor's `.grad` is its averaged gradient partition
    (`averaged_gradients[sub]`, before clipping, unscaled). The ZeRO step itself runs with what DeepSpeed
    left there. No collective of its own: gradlog's sharded path adds the ranks' parts."""

    def __init__(self, zero: Any, parts: dict[int, tuple[nn.Parameter, Part]], outside: list[nn.Parameter]) -> None:
        self._parts = parts
        super().__init__(zero, outside)
        self._bit16 = False  # the masters are shown at every measured step, whatever the weights' dtype

    @staticmethod
    def _pairs(zero: Any) -> Iterator[tuple[list[nn.Parameter], dict[str, Any]]]:
        """(trained model tensors, inner param group) per param group (ZeRO-3 splits a group in sub-groups)."""
        groups: dict[int, list[nn.Parameter]] = {}
        for sub, params in enumerate(zero.fp16_groups):
            groups.setdefault(int(zero.sub_group_to_group_id[sub]), []).extend(params)
        for gid, inner in enumerate(zero.optimizer.param_groups):
            yield groups.get(gid, []), inner

    def step(self, closure: Any = None) -> Any:
        """The ZeRO step between gradlog's hooks: it runs with DeepSpeed's own `.data` and `.grad`; the
        post-hook then reads the updated fp32 masters."""
        zero = self._zero()
        self._restore()
        out = self._step(zero) if closure is None else self._step(zero, closure)
        self._skipped(zero)
        if self._measuring:
            self._show(zero, grads=False)
        return out

    def _whole(self, zero: Any) -> None:
        self._show(zero, grads=True)

    @contextlib.contextmanager
    def _showing(self) -> Iterator[None]:
        zero = self._zero()
        if zero is None or self._data:  # gone, or already shown (inside a measured step)
            yield
            return
        self._show(zero, grads=False)
        try:
            yield
        finally:
            self._restore()

    def shown(self) -> contextlib.AbstractContextManager[None]:
        """Every parameter's `.data` this rank's part of it while gradlog reads the weights outside a step
        (construction: the first fingerprints; the diagnosis: `changed`), as it is inside measured steps."""
        return self._showing()

    def _show(self, zero: Any, grads: bool) -> None:
        """Each parameter's `.data` (and with `grads`, a trained one's `.grad`) as this rank's part, until
        `_restore` puts DeepSpeed's back."""
        save = not self._data
        for p, _ in self._parts.values():
            if save:
                self._grads.append((p, p.grad))
                self._data.append((p, p.data))
            p.grad = None
        masters = zero.fp32_partitioned_groups_flat
        for p, part in self._parts.values():
            n = part.shard.numel
            own = masters[part.sub] if part.sub >= 0 else p.ds_tensor  # type: ignore[attr-defined]
            p.data = own.detach().reshape(-1).narrow(0, part.offset if part.sub >= 0 else 0, n)
        if not grads:
            return
        averaged = getattr(zero, "averaged_gradients", None) or {}
        scale = float(getattr(zero, "loss_scale", 1.0) or 1.0)
        for p, part in self._parts.values():
            partitions = averaged.get(part.sub) if part.sub >= 0 else None
            if not partitions:  # no gradient reached this sub-group (no backward): none to show
                continue
            g = partitions[part.index].detach().reshape(-1).narrow(0, 0, part.shard.numel).to(torch.float32)
            p.grad = g / scale if scale != 1.0 else g


def layout3(zero: Any, params: list[nn.Parameter]) -> dict[int, tuple[nn.Parameter, Part]]:
    """Each ZeRO-3 parameter's part on this rank, registered as a `FlatShard` (`gradlog.measure.flat_shards`)."""
    where = {id(p): (sub, i) for sub, group in enumerate(zero.fp16_groups) for i, p in enumerate(group)}
    parts: dict[int, tuple[nn.Parameter, Part]] = {}
    for p in params:
        group = getattr(p, "ds_process_group", None) or zero.dp_process_group
        size = int(p.partition_numel())  # type: ignore[attr-defined]
        start = torch.distributed.get_rank(group=group) * size
        numel = max(0, min(size, int(p.ds_numel) - start))  # type: ignore[attr-defined]
        shard = FlatShard(tuple(int(d) for d in p.ds_shape), start if numel else 0, numel)  # type: ignore[attr-defined]
        register_shard(p, shard)
        sub, index = where.get(id(p), (-1, -1))
        offset = int(zero.grad_position[p.ds_id][1]) if sub >= 0 else 0  # type: ignore[attr-defined]
        parts[id(p)] = (p, Part(shard, sub, index, offset))
    return parts


def _settings(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def _grad_fragment(p: nn.Parameter, numel: int) -> tuple[int, torch.Tensor] | None:
    """(offset in the flattened tensor, values) of this rank's part of `p`'s averaged gradient, or None
    when this rank holds none of `p`."""
    mapping = getattr(p, "_hp_mapping", None)
    if mapping is None:
        return None
    address = mapping.lp_fragment_address
    try:
        values = mapping.get_lp_grad_fragment(p._index_in_param_group).reshape(-1)  # type: ignore[attr-defined]
    except ValueError:  # DeepSpeed kept no gradient for this group (none reached it): zeros
        return None
    if values.numel() == numel and address.numel != numel:  # a whole-tensor buffer: this rank's part of it
        values = values.narrow(0, address.start, address.numel)
    return int(address.start), values.to(torch.float32)


def _all_reduce(t: torch.Tensor, group: Any) -> None:
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM, group=group)


#: what gradlog reads off DeepSpeed's objects: (object, attribute) per kind, checked before anything is hooked
_NEEDS = {
    "the ZeRO optimizer": ("bit16_groups", "dp_process_group", "optimizer"),
    "a trained parameter's _hp_mapping": ("lp_fragment_address", "hp_fragment", "get_lp_grad_fragment"),
}


def missing(zero: Any) -> str | None:
    """What this DeepSpeed version's ZeRO-1/2 optimizer lacks of what gradlog reads (None: nothing), so that
    a DeepSpeed release that renamed its internals is refused before training instead of failing in it."""
    lacks = [a for a in _NEEDS["the ZeRO optimizer"] if not hasattr(zero, a)]
    if lacks:
        return f"the ZeRO optimizer has no {', '.join(lacks)}"
    for group in zero.bit16_groups:
        for p in group:
            mapping = getattr(p, "_hp_mapping", None)
            if mapping is None:
                continue  # held on other ranks only
            lacks = [a for a in _NEEDS["a trained parameter's _hp_mapping"] if not hasattr(mapping, a)]
            if lacks or not hasattr(p, "_index_in_param_group"):
                return f"a trained parameter's _hp_mapping has no {', '.join(lacks or ['_index_in_param_group'])}"
    return None


_NEEDS3 = {
    "the ZeRO-3 optimizer": (
        "fp16_groups",
        "sub_group_to_group_id",
        "fp32_partitioned_groups_flat",
        "averaged_gradients",
        "grad_position",
        "dp_process_group",
        "optimizer",
    ),
    "a ZeRO-3 parameter": ("ds_id", "ds_shape", "ds_numel", "ds_tensor", "partition_numel"),
}


def missing3(zero: Any, params: list[nn.Parameter]) -> str | None:
    """What this DeepSpeed version's ZeRO-3 optimizer (or one of `params`) lacks of what gradlog reads, or a
    ZeRO-3 setup gradlog does not read (offloaded optimizer: the gradients live elsewhere); None: nothing."""
    lacks = [a for a in _NEEDS3["the ZeRO-3 optimizer"] if not hasattr(zero, a)]
    if lacks:
        return f"the ZeRO-3 optimizer has no {', '.join(lacks)}"
    for name in ("offload_optimizer", "swap_optimizer", "zenflow", "use_muon"):
        if getattr(zero, name, False):
            return f"{name} is on (its gradients and fp32 masters are kept where gradlog does not read them)"
    for p in params:
        lacks = [a for a in _NEEDS3["a ZeRO-3 parameter"] if not hasattr(p, a)]
        if lacks:
            return f"a parameter has no {', '.join(lacks)}"
    return None


def zero_stage(optimizer: Any) -> int | None:
    """1 or 2 for a DeepSpeed ZeRO-1/2 optimizer (`DeepSpeedZeroOptimizer`), 3 for ZeRO-3's, else None."""
    for cls in type(optimizer).__mro__:
        if (cls.__module__ or "").startswith("deepspeed") and cls.__name__ == ZERO12:
            return 2 if getattr(optimizer, "partition_gradients", False) else 1
        if (cls.__module__ or "").startswith("deepspeed") and cls.__name__ == ZERO3:
            return 3
    return None
