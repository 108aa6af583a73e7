"""Refuse the training engines gradlog cannot measure exactly, before training starts.

Some engines keep gradients, fp32 masters or the parameters themselves in flat per-rank partitions
(DeepSpeed ZeRO, FSDP1) or place different layers on different ranks (pipeline parallelism). gradlog's
numbers would then be one rank's slice presented as the whole model's: wrong without a warning (a
total gradient norm of 0.13 for a true 0.58, "all tensors were updated" while a frozen layer never
changed). Such setups are refused with a `NotImplementedError` that names the engine, what would be
wrong and what to do instead. Everything is duck-typed (class names, the marks engines put on
parameters): gradlog never imports deepspeed, and ``import gradlog`` only needs torch.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from gradlog.measure.flat_shards import (
    FSDP1_MARK,
    REPLICATED,
    SHARDED,
    handle_params,
    is_flat_shard,
    is_fsdp1,
    register,
    strategy,
)
from gradlog.measure.zero import Zero3View, ZeroView, layout3, missing, missing3, zero_stage

#: DeepSpeed's model wrappers: the optimizer steps inside `engine.step()`, over flat partitions
_DS_ENGINES = ("DeepSpeedEngine", "PipelineEngine", "DeepSpeedHybridEngine")
#: DeepSpeed's optimizers that keep fp32 masters and gradients as flat per-rank partitions
_DS_OPTIMIZERS = ("ZeROOptimizer", "DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3", "BF16_Optimizer")
#: attributes DeepSpeed sets on model parameters: ZeRO-3 partitions (ds_*), ZeRO-1/2 and bf16 fp32 masters
_DS_PARAM_MARKS = ("ds_id", "ds_shape", "ds_status", "ds_tensor", "_hp_mapping")
_HOLDERS = ("optimizer", "_optimizer")

_DS_WHAT = (
    "DeepSpeed ZeRO keeps each rank's gradients and fp32 master weights in flat partitions (ZeRO-3 also the "
    "weights: each parameter is shape (0,) outside forward/backward), so gradlog would report one rank's "
    "slice as the model's: wrong gradient norms, and frozen or dead layers reported as fine"
)
_DS_FIX = (
    "gradlog measures ZeRO-1, -2 and -3 through the engine: `GradLogger(engine)` or `GradLogger(engine.module, "
    "engine.optimizer)` (the HF and Lightning callbacks do the latter)"
)
_FSDP1_WHAT = (
    "FSDP1 flattens parameters into per-rank slices, so every number would be "
    "shard-local: wrong norms, and tensors held on other ranks reported as never updated"
)
_FSDP1_FIX = (
    "Pass the FullyShardedDataParallel wrapper itself, built with use_orig_params=True (gradlog then measures "
    "your original parameters globally), or shard with FSDP2: `from torch.distributed.fsdp import fully_shard; "
    "fully_shard(layer); fully_shard(model)`"
)
_FSDP1_FLAT = (
    "without use_orig_params=True its parameters are flat per-rank slices of many tensors (FlatParameter) that "
    "gradlog cannot map back to yours, so every number would be shard-local: wrong norms, and tensors held on "
    "other ranks reported as never updated"
)
_FSDP1_HYBRID = (
    "each shard is replicated across groups of ranks that gradlog does not know, so it would count each "
    "element once per replica: wrong norms"
)
_FSDP1_HYBRID_FIX = (
    "Use sharding_strategy FULL_SHARD, SHARD_GRAD_OP or NO_SHARD over the whole world (with use_orig_params=True), "
    "or shard with FSDP2 (`fully_shard`)"
)


def _mro_names(obj: object) -> Iterator[tuple[str, str]]:
    """(module, name) of every class `obj` is an instance of."""
    for cls in type(obj).__mro__:
        yield getattr(cls, "__module__", "") or "", cls.__name__


def _deepspeed_class(obj: object, names: tuple[str, ...]) -> str | None:
    """The name of `obj`'s class when it (or a base) is one of DeepSpeed's `names`."""
    for module, name in _mro_names(obj):
        if module.startswith("deepspeed") and name in names:
            return type(obj).__name__
    return None


def _refuse(engine: str, what: str, fix: str) -> NotImplementedError:
    return NotImplementedError(f"gradlog does not support {engine}: {what}. {fix}.")


def _check_model(model: nn.Module) -> None:
    """A DeepSpeed engine or an FSDP1 wrapper anywhere in the module tree."""
    for m in model.modules():
        ds = _deepspeed_class(m, _DS_ENGINES)
        if ds is not None:
            pipeline = "Pipeline" in ds
            stage3 = _deepspeed_class(getattr(m, "optimizer", None), ("DeepSpeedZeroOptimizer_Stage3",))
            raise _refuse(
                f"a DeepSpeed {'ZeRO-3 ' if stage3 else ''}{ds} passed as the model",
                "pipeline parallelism puts different layers on different ranks, so no rank sees the whole model"
                if pipeline
                else _DS_WHAT,
                "Pipeline parallelism is not supported. " + _DS_FIX if pipeline else _DS_FIX,
            )
        if is_fsdp1(m):
            _check_fsdp1(m)


def _check_fsdp1(m: nn.Module) -> None:
    """FSDP1 is measured with use_orig_params=True over the whole world (`gradlog.measure.flat_shards`)."""
    if not getattr(m, "_use_orig_params", False):
        raise _refuse("FSDP1 (FullyShardedDataParallel) without use_orig_params=True", _FSDP1_FLAT, _FSDP1_FIX)
    kind = strategy(m)
    if kind not in SHARDED + REPLICATED:
        raise _refuse(
            f"FSDP1 (FullyShardedDataParallel) with sharding_strategy {kind}", _FSDP1_HYBRID, _FSDP1_HYBRID_FIX
        )
    group = getattr(m, "process_group", None)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    size = group.size() if group is not None else world
    if size != world:
        raise _refuse(
            f"FSDP1 (FullyShardedDataParallel) sharded over {size} of the {world} ranks",
            "the other ranks hold copies or other shards that gradlog does not know how to count",
            _FSDP1_HYBRID_FIX,
        )
    try:
        for _ in handle_params(m):
            pass
    except AttributeError as exc:  # a torch whose FSDP1 keeps its layout elsewhere: never guessed
        raise _refuse(
            "this torch's FSDP1 (FullyShardedDataParallel)",
            f"its flat parameter does not keep the layout gradlog reads ({exc})",
            "Shard with FSDP2 (`fully_shard`)",
        ) from exc


def _check_params(model: nn.Module, allowed: tuple[str, ...] = ()) -> None:
    """Parameters marked by DeepSpeed or FSDP1 (the wrapper was unwrapped, e.g. `engine.module`, `fsdp.module`;
    FSDP1's own with use_orig_params=True in `model` are measured); `allowed`: DeepSpeed marks of an engine
    gradlog measures (ZeRO-1/2's `_hp_mapping`)."""
    managed = register(model)
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    many = distributed and torch.distributed.get_world_size() > 1
    for name, p in model.named_parameters():
        marks = [a for a in _DS_PARAM_MARKS if hasattr(p, a) and a not in allowed]
        if marks:
            raise _refuse(
                f"DeepSpeed-managed parameters (the model's {name!r} carries DeepSpeed's {marks[0]!r}; "
                "a model or optimizer taken from inside a DeepSpeed engine)",
                _DS_WHAT,
                _DS_FIX,
            )
        if getattr(p, FSDP1_MARK, False) and id(p) not in managed:
            raise _refuse(
                f"FSDP1-managed parameters (the model's {name!r} carries FSDP1's {FSDP1_MARK!r}: a module "
                "taken from inside FullyShardedDataParallel, such as `fsdp.module`)",
                _FSDP1_WHAT,
                _FSDP1_FIX,
            )
        if many and tuple(p.shape) == (0,) and not hasattr(p, "placements") and not is_flat_shard(p):
            raise _refuse(
                f"parameters partitioned across ranks by an engine gradlog does not know (the model's {name!r} "
                f"is shape (0,) on rank {torch.distributed.get_rank()} of {torch.distributed.get_world_size()})",
                "its values live on other ranks, so gradlog would report it as never updated and leave it out of "
                "every norm",
                "Measure a model whose parameters have their full shape on every rank (DDP), or shard with FSDP2 "
                "(`fully_shard`), whose DTensor shards gradlog combines",
            )


def _chain(optimizer: Any) -> Iterator[Any]:
    """`optimizer` and every object it holds in `.optimizer` / `._optimizer`, outermost first."""
    seen: set[int] = set()
    current = optimizer
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        held = getattr(current, "__dict__", {})
        current = next((held[a] for a in _HOLDERS if a in held), None)


def _check_optimizer(model: nn.Module, optimizer: Any) -> None:
    """A DeepSpeed ZeRO optimizer anywhere in the wrapper chain, or a wrapper whose inner optimizer holds
    none of the model's parameters (flat partitions of an unknown ZeRO-like engine)."""
    chain = list(_chain(optimizer))
    for opt in chain:
        ds = _deepspeed_class(opt, _DS_OPTIMIZERS)
        if ds is not None:
            raise _refuse(f"a DeepSpeed {ds} optimizer", _DS_WHAT, _DS_FIX)
    inner = chain[-1]
    if len(chain) < 2 or not isinstance(inner, torch.optim.Optimizer):
        return
    model_params = {id(p) for p in model.parameters() if p.requires_grad}
    held = [p for g in inner.param_groups for p in g["params"]]
    if model_params and held and not any(id(p) in model_params for p in held):
        wrapper = type(chain[0]).__name__
        raise _refuse(
            f"the optimizer wrapper {wrapper}",
            f"the {type(inner).__name__} it steps holds none of the model's parameters (flat partitions or copies "
            "of them, as ZeRO-style optimizers keep), so gradlog would measure tensors that are not the model's",
            "Pass an optimizer built on the model's own parameters",
        )


def refuse_unsupported(model: nn.Module, optimizer: Any = None) -> None:
    """Raise NotImplementedError when gradlog's numbers for this model/optimizer would be silently wrong.

    Checked before anything is hooked: a DeepSpeed engine (ZeRO or pipeline), a DeepSpeed ZeRO optimizer
    at any depth of the wrapper chain, parameters marked by DeepSpeed or FSDP1 (their wrapper was unwrapped
    or only the inner optimizer was passed), FSDP1 modules without use_orig_params=True or with a hybrid
    strategy, and parameters of shape (0,) partitioned on other ranks. FSDP1 with use_orig_params=True
    passes: its layout is registered here (`gradlog.measure.flat_shards`).
    """
    _check_model(model)
    if optimizer is not None:
        _check_optimizer(model, optimizer)
    _check_params(model)


def _zero_engine(model: nn.Module, optimizer: Any) -> tuple[nn.Module, Any] | None:
    """(the module trained, the ZeRO optimizer) when gradlog is handed a DeepSpeed ZeRO engine (stage 1-3)
    (`GradLogger(engine)`, with or without `engine.optimizer`) or a module with its ZeRO optimizer
    (`GradLogger(engine.module, engine.optimizer)`); None for anything else."""
    if type(model).__name__ == "DeepSpeedEngine" and _deepspeed_class(model, _DS_ENGINES):
        zero = getattr(model, "optimizer", None)
        if zero_stage(zero) is None or (optimizer is not None and all(o is not zero for o in _chain(optimizer))):
            return None
        module = model.module
        return (module, zero) if isinstance(module, nn.Module) else None
    zero = next((o for o in _chain(optimizer) if zero_stage(o) is not None), None) if optimizer is not None else None
    return (model, zero) if zero is not None else None


def refuse_check(model: nn.Module, optimizer: Any) -> None:
    """`refuse_unsupported` for `gradlog.check`, which also refuses DeepSpeed ZeRO-1/2: its dry step would
    have to restore ZeRO's flat fp32 partitions and optimizer state, and DeepSpeed's gradient reduction
    hooks would already have reduced the check's gradients (training's first step would then fail)."""
    if _zero_engine(model, optimizer) is not None:
        raise _refuse(
            "gradlog.check (check_first=True) on a DeepSpeed ZeRO engine",
            "its dry step would run through ZeRO's gradient partitions and optimizer state, which it cannot "
            "restore exactly",
            "Run gradlog.check on the plain model and a torch optimizer before deepspeed.initialize, or leave "
            "check_first off: GradLogger(engine) measures ZeRO training itself",
        )
    refuse_unsupported(model, optimizer)


def refuse_unmeasured(model: nn.Module, optimizer: Any = None) -> None:
    """Raise what `GradLogger(model, optimizer)` would refuse, without hooking anything: for callbacks that must
    refuse before the first step but start their logger later (Lightning's, after `check_first` or a restored
    checkpoint). A DeepSpeed ZeRO engine's module with its optimizer passes, as `attach` measures it (Lightning's
    DeepSpeed strategy hands the callback the LightningModule and the ZeRO optimizer)."""
    if _zero_engine(model, optimizer) is None:
        refuse_unsupported(model, optimizer)


def attach(model: nn.Module, optimizer: Any = None) -> tuple[nn.Module, Any, ZeroView | None]:
    """What GradLogger measures: (model, optimizer, the ZeRO view or None).

    DeepSpeed ZeRO-1/2 (see `gradlog.measure.zero`): the engine's module and a `ZeroView` of its
    optimizer, which gradlog hooks in place of the optimizer. Everything `refuse_unsupported` refuses
    stays refused; otherwise the model and optimizer come back as given.
    """
    found = _zero_engine(model, optimizer)
    if found is None:
        refuse_unsupported(model, optimizer)
        return model, optimizer, None
    module, zero = found
    stage3 = zero_stage(zero) == 3
    lacks = missing3(zero, list(module.parameters())) if stage3 else missing(zero)
    if lacks is not None:
        raise _refuse(
            f"this DeepSpeed {type(zero).__name__}",
            f"{lacks}, which gradlog reads to rebuild each tensor's gradient from the ranks' partitions",
            "Use a DeepSpeed release gradlog is tested with (0.19), or train with FSDP2",
        )
    _check_model(module)
    parts = layout3(zero, list(module.parameters())) if stage3 else {}  # registered: (0,) is a known part
    _check_params(module, allowed=_DS_PARAM_MARKS if stage3 else ("_hp_mapping",))
    groups_of = zero.fp16_groups if stage3 else zero.bit16_groups
    trained = {id(p) for group in groups_of for p in group}
    if trained and not any(id(p) in trained for p in module.parameters()):
        raise ValueError(
            f"gradlog: the DeepSpeed {type(zero).__name__} trains none of the parameters of the "
            f"{type(module).__name__} given; pass the engine (`GradLogger(engine)`) or its own module"
        )
    groups = {id(g) for g in getattr(zero, "real_dp_process_group" if not stage3 else "sub_group_process_groups", [])}
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if len(groups) > 1 or (stage3 and torch.distributed.get_world_size(group=zero.dp_process_group) != world):
        raise _refuse(
            "DeepSpeed ZeRO with param groups on different data-parallel groups (MoE expert parallelism)"
            if len(groups) > 1
            else "DeepSpeed ZeRO-3 partitioned over fewer ranks than the world",
            "each group's gradients are partitioned over its own ranks",
            "Measure a model without expert parallelism, or train it with FSDP2",
        )
    outside = [p for p in module.parameters() if p.requires_grad and id(p) not in trained]
    view = Zero3View(zero, parts, outside) if stage3 else ZeroView(zero, outside)
    return module, view, view
