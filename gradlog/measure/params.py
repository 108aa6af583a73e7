"""Which tensors to watch: parameters keyed by identity, with clean names and aliases."""

from __future__ import annotations

import fnmatch
import inspect
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
from torch import nn

from gradlog.measure.flat_shards import flat_shard, register
from gradlog.measure.owners import Owners, describe

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


def _ref(p: torch.Tensor) -> Callable[[], torch.Tensor | None]:
    """A weak reference where the tensor type allows one (tensors do), else a strong one."""
    try:
        return weakref.ref(p)
    except TypeError:
        return lambda: p


@dataclass(eq=False)
class Tracked:
    """One parameter tensor. `index` is its row in every per-step statistic.

    The tensor is held weakly: a parameter the model and optimizer let go of (replaced during
    training) is freed, and its row keeps only its name, shape and the ledger's evidence. A freed
    tensor reads as a meta tensor of the same shape, which every statistic skips as unmaterialised.
    """

    index: int
    _param: Callable[[], torch.Tensor | None]
    name: str
    aliases: tuple[str, ...] = ()
    in_model: bool = True
    group: int | None = None  # optimizer param group index, None when not in the optimizer
    extra: dict[str, object] = field(default_factory=dict)
    _shape: tuple[int, ...] = ()
    _dtype: torch.dtype = torch.float32
    #: this rank holds a 1-D slice of the tensor (FSDP1, `gradlog.measure.flat_shards`): `_shape` is the whole one's
    flat: bool = False

    @classmethod
    def of(cls, index: int, p: torch.Tensor, name: str, **kw: object) -> Tracked:
        row = cls(index, _ref(p), name, _dtype=p.dtype, **kw)  # type: ignore[arg-type]
        shard = flat_shard(p)
        if shard is not None:
            row._shape, row.flat = shard.shape, True
        elif is_materialized(p):
            row._shape = tuple(p.shape)
        return row

    def held(self) -> torch.Tensor | None:
        """The tensor, or None once it was freed (`param` without the placeholder, for hot loops)."""
        return self._param()

    @property
    def alive(self) -> bool:
        return self._param() is not None

    @property
    def param(self) -> torch.Tensor:
        p = self._param()
        if p is None:  # released: a placeholder with no values, skipped like a meta parameter
            return torch.empty(self._shape, dtype=self._dtype, device="meta")
        return p

    @property
    def shape(self) -> tuple[int, ...]:
        p = self._param()
        if isinstance(p, nn.parameter.UninitializedParameter):  # lazy, never materialised: no shape yet
            return ()
        if p is not None and not self.flat:
            self._shape = tuple(p.shape)  # remembered for after it is freed
        return self._shape

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= int(d)
        return n if self.shape else (0 if isinstance(self._param(), nn.parameter.UninitializedParameter) else 1)


#: `include=` / `exclude=`: a glob, a list of globs, or a predicate on the tensor's (clean) name.
NameFilter = Optional[Union[str, Sequence[str], Callable[[str], bool]]]


def _matcher(spec: NameFilter, arg: str) -> Callable[[str], bool] | None:
    if spec is None:
        return None
    if callable(spec):
        _check_one_argument(spec, arg)
        return spec
    patterns = [spec] if isinstance(spec, str) else list(spec) if isinstance(spec, (Sequence, set, frozenset)) else None
    if not patterns or not all(isinstance(p, str) for p in patterns):
        raise ValueError(
            f"{arg} must be a glob like 'encoder.*', a non-empty list of globs, or a callable name -> bool; "
            f"got {spec!r}"
        )
    return lambda name: any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _check_one_argument(fn: Callable[..., Any], arg: str) -> None:
    """A callable filter is called with one tensor name: `include=lambda: True` failed at the first scan with
    "<lambda>() takes 0 positional arguments but 1 was given", naming neither the argument nor the fix."""
    try:
        inspect.signature(fn).bind("name")
    except TypeError:
        raise TypeError(
            f"{arg}={fn!r}: a callable filter is called with one argument, the tensor's name, and returns True to "
            f"watch it (e.g. {arg}=lambda name: name.startswith('encoder.'))"
        ) from None
    except ValueError:  # no signature to read (some builtins): it is called as it is
        pass


class Selection:
    """Which tensors gradlog watches: `include` (default all), minus `exclude`, matched on every name
    a tensor has (tied weights: any alias)."""

    def __init__(self, include: NameFilter = None, exclude: NameFilter = None) -> None:
        self.include = _matcher(include, "include")
        self.exclude = _matcher(exclude, "exclude")
        self.specs = (include, exclude)

    @property
    def everything(self) -> bool:
        return self.include is None and self.exclude is None

    def __call__(self, row: Tracked) -> bool:
        names = (row.name, *row.aliases)
        if self.include is not None and not any(self.include(n) for n in names):
            return False
        return self.exclude is None or not any(self.exclude(n) for n in names)


class ParamTable:
    """All parameters of the model plus any the optimizer holds that the model lacks.

    Rows are append-only: a tensor keeps its index for the whole run, so per-step arrays line up.
    """

    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, select: Selection | None = None
    ) -> None:
        self._model = weakref.ref(model)  # weak: the logger must not keep a dropped model alive
        self._optimizer = weakref.ref(optimizer) if optimizer is not None else None
        self._select = select or Selection()
        self.rows: list[Tracked] = []
        self._by_id: dict[int, Tracked] = {}
        self._warned_foreign = False
        self._layout: list[int] = []
        self._live: list[Tracked] | None = None
        self.generation = 0  # bumped whenever the rows or their membership change (see `rescan`, `released`)
        self.freed: list[int] = []  # appended from a finalizer; drained by `take_freed`
        self._owners = Owners()  # the tensors' owning modules as last described (see `owners`)
        self.rescan()

    def rescan(self) -> bool:
        """Pick up parameters added or replaced since the last scan (to_empty, a layer added late).

        Returns True when the table grew.
        """
        before = len(self.rows)
        model = self._model()
        if model is None:  # garbage-collected (the logger is closing): the rows are what is left
            return False
        optimizer = self._optimizer() if self._optimizer is not None else None
        param_groups = optimizer.param_groups if optimizer is not None else []
        layout = _identity(model, param_groups)
        if layout is not None and layout == self._layout:  # nothing added, replaced or regrouped (measured steps)
            return False
        self._layout = layout if layout is not None else []
        self._live = None
        self.generation += 1
        register(model)  # FSDP1's slices (use_orig_params=True): their whole shapes, before rows are made
        named = list(model.named_parameters(remove_duplicate=False))  # aliases of tied weights too
        names: dict[int, list[str]] = {}
        params: dict[int, torch.Tensor] = {}
        for name, p in named:
            names.setdefault(id(p), []).append(clean_name(name))
            params[id(p)] = p
        for old in self.rows:
            old.in_model = old.alive and self._by_id.get(id(old.param)) is old and id(old.param) in params
        for pid, param in params.items():
            ns = names[pid]
            row = self._by_id.get(pid)
            if row is None:
                self._add(param, ns[0], tuple(ns[1:]), in_model=True)
            else:
                row.name, row.aliases, row.in_model = ns[0], tuple(ns[1:]), True
        groups: dict[int, int] = {}
        if optimizer is not None:
            for gi, group in enumerate(optimizer.param_groups):
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
                row.group = groups.get(id(row.param)) if row.alive else None
        self._owners = self._describe(model)
        return len(self.rows) > before

    def owners(self) -> Owners:
        """The tracked tensors' owning modules, for the diagnosis (`gradlog.measure.owners`): described
        again from the model while it lives (a module's attributes may change without its tensors
        changing), else as described the last time it was there (the model was garbage-collected)."""
        model = self._model()
        if model is not None:
            self._owners = self._describe(model)
        return self._owners

    def _describe(self, model: nn.Module) -> Owners:
        return describe(model, {pid: row.index for pid, row in self._by_id.items()})

    def follow(self, optimizer: torch.optim.Optimizer) -> None:
        """Track `optimizer`'s parameters instead of the previous optimizer's (a new optimizer mid-run):
        the tensors it adds join the table now; the previous one's extra tensors leave the live rows."""
        self._optimizer = weakref.ref(optimizer)
        self.rescan()

    def _add(self, p: torch.Tensor, name: str, aliases: tuple[str, ...], in_model: bool) -> None:
        row = Tracked.of(len(self.rows), p, name, aliases=aliases, in_model=in_model)
        self.rows.append(row)
        self._by_id[id(p)] = row
        try:  # when it is freed, its id may be reused by a new tensor: forget it, and rebuild at the next scan
            weakref.finalize(p, _forget, weakref.ref(self), id(p), row).atexit = False
        except TypeError:
            pass

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def live(self) -> list[Tracked]:
        """Rows still held by the model or the optimizer (to_empty() replaces meta parameters), and
        selected by `include` / `exclude`: every statistic, the ledger and the report use these.

        Rows change only in `rescan`, so the list is kept until the next rebuild (a copy is returned).
        """
        if self._live is None:
            self._live = [r for r in self.rows if (r.in_model or r.group is not None) and self._select(r)]
        return list(self._live)

    def check_selection(self) -> None:
        """A filter that leaves nothing to watch is a typo, not a wish: say what the names look like."""
        if self._select.everything or self.live or not self.rows:
            return
        include, exclude = self._select.specs
        names = [r.name for r in self.rows if r.in_model or r.group is not None]
        shown = ", ".join(repr(n) for n in names[:6]) + (", ..." if len(names) > 6 else "")
        raise ValueError(
            f"include={include!r}, exclude={exclude!r} leave none of the model's {len(names)} tensors to watch; "
            f"names look like {shown} (glob patterns, matched on these names with wrapper prefixes "
            "such as 'module.' and '_orig_mod.' removed)"
        )

    def get(self, p: torch.Tensor) -> Tracked | None:
        row = self._by_id.get(id(p))
        return row if row is not None and row._param() is p else None

    def released(self, pid: int, row: Tracked) -> None:
        """`row`'s tensor was freed: it leaves the live rows now (its evidence stays in the ledger)."""
        if self._by_id.get(pid) is row:
            del self._by_id[pid]
        row.in_model = False
        row.group = None
        self._layout = []
        self._live = None
        self.generation += 1
        self.freed.append(row.index)

    def take_freed(self) -> list[int]:
        """Indices of rows whose tensor was freed since the last call (their per-slice state can go)."""
        out, self.freed = self.freed, []
        return out


def _identity(model: nn.Module, param_groups: list[dict[str, Any]]) -> list[int] | None:
    """The identities of every module and parameter of `model` and of the optimizer's groups, in walk
    order: an equal list means nothing was added, replaced, removed or regrouped since the last scan.

    A walk over `_modules` / `_parameters` without building names: `named_parameters` on every measured
    step was ~2 us per tensor, the biggest cost a frozen backbone's tensors still had. (A submodule
    renamed in place, objects unchanged, is not a change here: its rows keep their names.) None when
    a module does not have the usual attributes: then every scan rebuilds."""
    out: list[int] = []
    stack: list[nn.Module | None] = [model]
    try:
        while stack:
            m = stack.pop()
            if m is None:
                continue
            out.append(id(m))
            out.extend(map(id, m._parameters.values()))
            stack.extend(m._modules.values())
        for g in param_groups:
            out.append(len(g["params"]))
            out.extend(map(id, g["params"]))
    except (AttributeError, TypeError, KeyError):
        return None
    return out


def _forget(table: weakref.ref[ParamTable], pid: int, row: Tracked) -> None:
    t = table()
    if t is not None:
        t.released(pid, row)
