"""Writers and the one registry that maps `writer="name"` to a class."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Union

from gradlog.writers.base import Writer
from gradlog.writers.memory import MemoryWriter

#: name -> "module:Class"; backends import their package only when constructed.
REGISTRY: dict[str, str] = {
    "memory": "gradlog.writers.memory:MemoryWriter",
    "tensorboard": "gradlog.writers.tensorboard:TensorBoardWriter",
    "wandb": "gradlog.writers.wandb:WandbWriter",
}

WriterSpec = Union[str, Writer, Sequence[Union[str, Writer]]]


def writer_class(name: str) -> Callable[..., Writer]:
    if name not in REGISTRY:
        valid = ", ".join(repr(n) for n in sorted(REGISTRY))
        raise ValueError(f"unknown writer {name!r}; valid names are {valid}, or pass a gradlog.Writer instance")
    module, _, cls = REGISTRY[name].partition(":")
    factory: Callable[..., Writer] = getattr(importlib.import_module(module), cls)
    return factory


def _items(spec: WriterSpec) -> list[str | Writer]:
    return [spec] if isinstance(spec, (str, Writer)) else list(spec)


def writer_names(spec: WriterSpec) -> list[str]:
    """The writer names in `writer=` (a name, an instance, or a list of either), as `make_writers` reads it."""
    return [item for item in _items(spec) if isinstance(item, str)]


def make_writers(
    spec: WriterSpec, log_dir: str | None = None, strict: bool | None = None, **options: Any
) -> list[Writer]:
    """Turn `writer=` into Writer instances: a name, an instance, or a list of either.

    `log_dir` and `strict` go to the writers whose constructor takes them; `options` where they belong
    (`route_options`: one flat dict, or one dict per writer name).
    """
    items = _items(spec)
    routed = route_options(writer_names(spec), options)
    out: list[Writer] = []
    for item in items:
        if isinstance(item, Writer):
            out.append(item)
        elif isinstance(item, str):
            cls = writer_class(item)
            kwargs = dict(routed.get(item, {}))
            if log_dir is not None and "log_dir" in inspect.signature(cls).parameters:
                kwargs["log_dir"] = log_dir  # file writers only: writer=["memory", "tensorboard"] works
            if strict is not None and "strict" in inspect.signature(cls).parameters:
                kwargs["strict"] = strict  # the logger's strict mode reaches background threads too
            out.append(cls(**kwargs))
        else:
            raise TypeError(
                f"writer must be a name ({', '.join(sorted(REGISTRY))}), a gradlog.Writer or a list of them; "
                f"got {type(item).__name__}"
            )
    return out


def route_options(names: list[str], options: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Each named writer's keyword arguments. `options` is either one dict per writer name
    (``{"wandb": {"project": "p"}, "tensorboard": {...}}``) or one flat dict: then a key goes to the writers
    whose constructor names it, and a key none names to those that take any (`WandbWriter`'s wandb.init
    keywords), so ``writer=["tensorboard", "wandb"], options={"project": "p"}`` works. A key no writer
    takes is an error that names it."""
    if options and all(k in REGISTRY and isinstance(v, Mapping) for k, v in options.items()):
        return {name: dict(options.get(name, {})) for name in names}
    params = {name: inspect.signature(writer_class(name)).parameters for name in names}
    open_ended = [n for n in names if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params[n].values())]
    out: dict[str, dict[str, Any]] = {name: {} for name in names}
    for key, value in options.items():
        takers = [n for n in names if key in params[n] and params[n][key].kind is not inspect.Parameter.VAR_KEYWORD]
        for name in takers or open_ended:
            out[name][key] = value
        if names and not (takers or open_ended):
            known = sorted({k for n in names for k, p in params[n].items() if p.kind is not p.VAR_KEYWORD})
            raise TypeError(
                f"Output(options=...): {key!r} is not an option of the writer{'s' * (len(names) > 1)} "
                f"{', '.join(names)} (they take: {', '.join(known)}); give one dict per writer, e.g. "
                f"options={{{names[0]!r}: {{...}}}}"
            )
    return out


__all__ = ["REGISTRY", "MemoryWriter", "Writer", "make_writers", "route_options", "writer_class", "writer_names"]
