"""Which tensors to watch: parameters keyed by identity, with clean names and aliases."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

_WRAPPER_PARTS = ("module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")


def clean_name(name: str) -> str:
    """Drop the path parts that DDP, torch.compile, FSDP and checkpoint wrappers insert."""
    parts = [p for p in name.split(".") if p not in _WRAPPER_PARTS]
    # A model whose own submodule is called "module" keeps at least its leaf name.
    return ".".join(parts) if parts else name


_PLAIN = (torch.Tensor, nn.Parameter)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of a (possibly DTensor-sharded) tensor that lives on this rank."""
    if type(t) in _PLAIN:  # the common case, without an attribute lookup that fails
        return t
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def is_materialized(p: torch.Tensor) -> bool:
    """Lazy (uninitialised) and meta parameters hold no values yet: skip them until they do."""
    if type(p) in _PLAIN:
        return not p.is_meta
    if isinstance(p, nn.parameter.UninitializedParameter):
        return False
    return not local_tensor(p).is_meta


@dataclass(eq=False)
class Tracked:
    """One parameter tensor. `index` is its row in every per-step statistic."""

    index: int
    param: torch.Tensor
    name: str
    aliases: tuple[str, ...] = ()
    in_model: bool = True
    group: int | None = None  # optimizer param group index, None when not in the optimizer
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.param.shape)

    @property
    def numel(self) -> int:
        return int(self.param.numel())


class ParamTable:
    """All parameters of the model plus any the optimizer holds that the model lacks.

    Rows are append-only: a tensor keeps its index for the whole run, so per-step arrays line up.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        self._model = model
        self._optimizer = optimizer
        self.rows: list[Tracked] = []
        self._by_id: dict[int, Tracked] = {}
        self._warned_foreign = False
        self._layout: tuple[object, ...] = ()
        self._live: list[Tracked] | None = None
        self.rescan()

    def rescan(self) -> bool:
        """Pick up parameters added or replaced since the last scan (to_empty, a layer added late).

        Returns True when the table grew.
        """
        before = len(self.rows)
        named = list(self._model.named_parameters(remove_duplicate=False))  # aliases of tied weights too
        param_groups = self._optimizer.param_groups if self._optimizer is not None else []
        layout = (
            *(n for n, _ in named),
            *(id(p) for _, p in named),
            *((len(g["params"]), *map(id, g["params"])) for g in param_groups),
        )
        if layout == self._layout:  # nothing added, replaced or regrouped: skip the rebuild (measured steps)
            return False
        self._layout = layout
        self._live = None
        names: dict[int, list[str]] = {}
        params: dict[int, torch.Tensor] = {}
        for name, p in named:
            names.setdefault(id(p), []).append(clean_name(name))
            params[id(p)] = p
        for old in self.rows:
            old.in_model = id(old.param) in params
        for pid, param in params.items():
            ns = names[pid]
            row = self._by_id.get(pid)
            if row is None:
                self._add(param, ns[0], tuple(ns[1:]), in_model=True)
            else:
                row.name, row.aliases, row.in_model = ns[0], tuple(ns[1:]), True
        groups: dict[int, int] = {}
        if self._optimizer is not None:
            for gi, group in enumerate(self._optimizer.param_groups):
                for pi, p in enumerate(group["params"]):
                    groups[id(p)] = gi
                    if id(p) not in self._by_id:
                        self._add(p, f"optimizer.param_groups.{gi}.params.{pi}", (), in_model=False)
                        if not self._warned_foreign:
                            self._warned_foreign = True
                            warnings.warn(
                                "gradlog: the optimizer holds a parameter the model does not have "
                                f"(shape {tuple(p.shape)}, group {gi}, position {pi}); it is tracked as "
                                f"'optimizer.param_groups.{gi}.params.{pi}'. Pass the model that owns it to name it.",
                                stacklevel=3,
                            )
            for row in self.rows:
                row.group = groups.get(id(row.param))
        return len(self.rows) > before

    def _add(self, p: torch.Tensor, name: str, aliases: tuple[str, ...], in_model: bool) -> None:
        row = Tracked(index=len(self.rows), param=p, name=name, aliases=aliases, in_model=in_model)
        self.rows.append(row)
        self._by_id[id(p)] = row

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def live(self) -> list[Tracked]:
        """Rows still held by the model or the optimizer (to_empty() replaces meta parameters).

        Rows change only in `rescan`, so the list is kept until the next rebuild (a copy is returned).
        """
        if self._live is None:
            self._live = [r for r in self.rows if r.in_model or r.group is not None]
        return list(self._live)

    def get(self, p: torch.Tensor) -> Tracked | None:
        return self._by_id.get(id(p))
