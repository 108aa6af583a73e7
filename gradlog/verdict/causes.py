"""One finding per cause: which of a report's per-tensor records one mistake explains.

The records stay per tensor (and per slice) in the `Report` and in the run files: readers, resume and
the policy's tensor patterns work on them. What a person reads groups them first, here, between the
records and the presentation (the console, `gradlog report`, the TensorBoard tab) and in the verdict's
counts, so the per-tensor detection never needs to know about it:

- the tensors of one module that never updated for the same reason: a layer left out of the optimizer is
  one finding, not one for its weight and one for its bias; where a traced step located the cause
  (`gradlog.verdict.located`: the cut's file, line and fix), tensors cut at different places are different
  findings, so that each line to fix is named on the console;
- the tensors that stopped learning at the same step for the same reason: one block frozen at step k
  (GPT-2's `h.1.mlp`: its `c_fc` and `c_proj`) is one finding, named by the tensors' deepest common
  module (`label`), not one per layer of the block;
- the slices of one block with the same indices (and, for stopped slices, the same stop step) and a
  dead-unit reason: the units of a layer that never fired, or stopped firing at step k, show in the
  layer's weight rows, its bias and the next layer's input columns, and are one finding.

Records are read by their fields only (`name`, `reason`, `suspect`, `dim`, `indices`, `total`,
`since_step`), so the records a run's tables are read back into group the same as close()'s.
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Sequence
from typing import Any

from gradlog.runformat.cells import DIM_NAMES, bare_name

#: slice reasons whose records pair across the tensors a layer's units touch (rows, bias, next columns)
UNIT_REASONS = frozenset({"dead_units", "zero_grad"})


#: what a `not_in_optimizer` record's detail says where a filter on names left its tensor out
#: (`gradlog.verdict.knobs.explain_filtered`): the attribute it names is the cause, across modules
FILTERED = "left out by name"
_FILTERED_ATTR = re.compile(FILTERED + r": every `([^`]+)` of \d+ modules")

#: the traced step's label in a record's detail (`gradlog.measure.trace.TraceResult.label`); what follows it
#: is the cause that step located for the tensor
_TRACED = re.compile(r"traced step \((?:optimizer step \d+; )?\d+ torch calls\): ")


def located(record: Any) -> str:
    """The cause a traced step located for a record ("cut at model.py:41 (`h = ...`) by `.detach()`; fix:
    ..."): its detail after the trace's label; "" where no trace explains it."""
    detail = str(getattr(record, "detail", ""))
    found = _TRACED.search(detail)
    return detail[found.end() :] if found else ""


def module_of(name: str) -> str:
    """The module a tensor belongs to: its name less the attribute (`fc1.weight` -> `fc1`)."""
    bare = bare_name(name)
    return bare.rsplit(".", 1)[0] if "." in bare else bare


def block_of(name: str) -> str:
    """The block whose tensors a layer's units touch: the name less its module and attribute
    (`h.0.mlp.c_fc.weight` -> `h.0.mlp`; "" for a top-level layer)."""
    return ".".join(bare_name(name).split(".")[:-2])


def cause_key(table: str, record: Any) -> tuple[Hashable, ...]:
    """The cause a record of `table` (a `Report` field: never_updated, stalled, partly_updated,
    stopped_slices, precision, experts) belongs to; records with equal keys are one finding."""
    reason = str(getattr(record, "reason", ""))
    if table == "never_updated":
        # tensors one filter on names left out of the optimizer are one cause across their modules
        found = _FILTERED_ATTR.search(str(getattr(record, "detail", "")))
        where = f"{FILTERED}: {found.group(1)}" if found else module_of(record.name)
        return (table, where, reason, bool(getattr(record, "suspect", False)), located(record))
    if table == "stalled":
        return (table, reason, getattr(record, "since_step", None))
    if table in ("partly_updated", "stopped_slices") and reason in UNIT_REASONS and record.indices:
        since = getattr(record, "since_step", None)
        return (table, block_of(record.name), record.total, since, reason, tuple(record.indices))
    return (table, bare_name(str(getattr(record, "name", getattr(record, "layer", "")))), id(record))


def group(table: str, records: Sequence[Any]) -> list[list[Any]]:
    """`records` grouped by cause, each group in the records' order, groups in the order of their first record."""
    out: dict[tuple[Hashable, ...], list[Any]] = {}
    for r in records:
        out.setdefault(cause_key(table, r), []).append(r)
    return list(out.values())


def touched(table: str, records: Sequence[Any]) -> list[str]:
    """The tensors a cause touches, once each, with the slices where the records are of slices
    (`fc1.weight rows`, `fc1.bias elements`)."""
    out: list[str] = []
    for r in records:
        name = bare_name(r.name)
        if table in ("partly_updated", "stopped_slices"):
            name = f"{name} {DIM_NAMES.get(r.dim, f'dim {r.dim}')}"
        if name not in out:
            out.append(name)
    return out


def label(table: str, records: Sequence[Any]) -> str:
    """What a cause is named by: its one tensor, or the module of its first tensor when it has several; for
    tensors that stopped at one step, and never-updated tensors of several modules (one filter on names left
    them out of the optimizer), the deepest module they all belong to (`common_module`)."""
    if len(records) == 1:
        return str(records[0].name)
    if table == "stalled" or (table == "never_updated" and len({module_of(r.name) for r in records}) > 1):
        return common_module([str(r.name) for r in records])
    return module_of(records[0].name)


def common_module(names: Sequence[str]) -> str:
    """The deepest module holding every tensor of `names` (`h.1.mlp.c_fc.weight`, `h.1.mlp.c_proj.bias` ->
    `h.1.mlp`); where only the model itself holds them all, their modules, listed."""
    parts = [module_of(n).split(".") for n in names]
    common: list[str] = []
    for level in zip(*parts):
        if any(p != level[0] for p in level):
            break
        common.append(level[0])
    if common:
        return ".".join(common)
    return ", ".join(dict.fromkeys(module_of(n) for n in names))
