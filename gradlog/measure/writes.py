"""Where a weight is set back: the user's line that writes it outside the optimizer.

The ledger's screen flags a tensor whose values before a measured step are those before the previous one
although that step updated it (`gradlog.verdict.ledger`). From then on, between optimizer steps only (from a
step's post-hook to the next step's pre-hook: the optimizer's own writes and gradlog's are never seen), a
`TorchFunctionMode` looks at each torch call for an in-place write to a flagged tensor: the ``.data`` setter
(``w.data = w0 * mask``), ``__setitem__`` on a tensor sharing its storage (``w.data[mask] = w0[mask]``),
``copy_`` (``load_state_dict``, ``p.data.copy_(init)``) or any other in-place op. The first write to each
keeps the user's frame (`gradlog.measure.trace.user_site`). It lasts `WINDOWS` gaps between steps at most,
then every hook goes: a run pays it once, and only when a tensor was flagged (a healthy run never is); while
it lasts, each torch call of the user's code between two steps (the forward and the loss) pays a few Python
operations, as a traced step does.

The mode is on the stack only in that gap, and never where compiled code may meet it: dynamo guards compiled
frames on the torch-function mode stack, so a mode pushed around a compiled ``optimizer.step()`` or model
recompiles them (and traces the mode into their graphs). It is not pushed once ``torch.compile`` has compiled
anything in the process (since the last ``torch._dynamo.reset()``), the watch ends if a compile starts while
it is on, it is pushed only on an empty stack and popped only from the top (another mode entered meanwhile is
never popped in its place), and `WriteWatch.stop` (close, or the optimizer garbage-collected) pops it.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from gradlog.measure.distributed import is_dtensor
from gradlog.measure.params import Tracked
from gradlog.measure.trace import Site, user_site

#: gaps between optimizer steps a watch lasts at most (the write it waits for falls in the first or second)
WINDOWS = 3
#: in-place calls that change no value
_METADATA = frozenset({"requires_grad_", "share_memory_", "retain_grad", "register_hook", "resize_as_", "detach_"})


def _writes(func: Callable[..., Any], name: str) -> bool:
    """Whether a torch call writes its first argument's values in place: the ``.data`` setter (not ``.grad``'s
    or ``.requires_grad``'s), ``__setitem__``, and in-place ops but those that change no value."""
    if name == "__set__":
        return getattr(getattr(func, "__self__", None), "__name__", None) == "data"
    if name == "__setitem__":
        return True
    return name.endswith("_") and not name.startswith("__") and name not in _METADATA


def _storage(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # a tensor without storage (meta, some subclasses)
        return -1


class _Mode(TorchFunctionMode):
    def __init__(self, seen: Callable[[str, Any], None]) -> None:
        super().__init__()
        self._seen = seen
        self.off = False  # left on the stack under another mode: a pass-through until it can be popped

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if args and not self.off and not torch.compiler.is_compiling():
            name = getattr(func, "__name__", "")
            if _writes(func, name):
                self._seen(name, args[0])
        return func(*args, **(kwargs or {}))


def compiled_frames() -> int:
    """Frames torch.compile has compiled in this process since the last ``torch._dynamo.reset()`` (a positive
    number where it cannot be read: compiled code may exist, so no mode is pushed)."""
    convert = sys.modules.get("torch._dynamo.convert_frame")
    if convert is None:
        return 0
    count = getattr(convert, "FRAME_COUNTER", 1)
    return count if isinstance(count, int) else 1


def _mode_stack() -> list[Any]:
    return list(torch.overrides._get_current_function_mode_stack())  # type: ignore[no-untyped-call]


class WriteWatch:
    """The sites of the first writes outside the optimizer to the watched tensors, by `Tracked.index`, and the
    optimizer step after which each was written (`after`: written between that step and the next)."""

    def __init__(self, steps: Callable[[], int] = lambda: 0) -> None:
        self.sites: dict[int, Site] = {}
        self.after: dict[int, int] = {}
        #: why the line was not looked for, where it was wanted ("torch.compile": compiled code in the process)
        self.skipped = ""
        self._steps = steps  # optimizer steps so far (the post-hook of step k sees k + 1)
        self._targets: dict[int, tuple[int, int]] = {}  # tracked index -> (id of the tensor, its storage)
        self._tried: set[int] = set()  # tracked indices ever watched: each is watched once in a run
        self._handles: list[RemovableHandle] = []
        self._mode: _Mode | None = None
        self._windows = 0
        self._finalizer: weakref.finalize[[], None] | None = None  # pops the mode when the optimizer goes

    @property
    def active(self) -> bool:
        return bool(self._handles)

    @property
    def pushed(self) -> bool:
        """Whether the mode is on the stack now."""
        return self._mode is not None

    def watch(self, rows: Sequence[Tracked], optimizer: torch.optim.Optimizer) -> None:
        """Watch these tensors from the next optimizer step's end on: once each in a run (a write it never
        sees, a healthy clipping every step, costs one watch, not one per step), and not sharded ones, whose
        set-back the ledger does not prove. The mode goes on after `optimizer`'s steps only (its own post-hook,
        after gradlog's: a logger left unclosed never acts on another optimizer's steps), and off before any
        optimizer's step (a global pre-hook, before gradlog's)."""
        for r in rows:
            if r.index not in self._tried and not is_dtensor(r.param):
                self._tried.add(r.index)
                self._targets[r.index] = (id(r.param), _storage(r.param))
        if self._targets and not self._handles:
            if compiled_frames():
                self._give_up("torch.compile")
                return
            self._windows = 0
            # untraced, as gradlog's step hooks: a compiled optimizer.step() skips them and runs them eagerly
            untraced: Callable[[Callable[..., Any]], Any] = torch.compiler.disable  # untyped in torch
            self._handles = [
                register_optimizer_step_pre_hook(untraced(self._step_begins)),
                optimizer.register_step_post_hook(untraced(self._step_ended)),
            ]
            self._finalizer = weakref.finalize(optimizer, self.stop)  # type: ignore[arg-type]

    def _give_up(self, why: str) -> None:
        self.skipped = why
        self.stop()

    def _step_begins(self, *_: Any) -> None:
        self._pause()
        if compiled_frames():  # something was compiled while the mode was on (or before): never again
            self._give_up("torch.compile")

    def _step_ended(self, *_: Any) -> None:
        if self._windows >= WINDOWS or not self._targets:
            self.stop()
            return
        self._windows += 1
        if compiled_frames():
            self._give_up("torch.compile")
        elif self._mode is None and not _mode_stack():  # under another mode: this gap is not watched
            self._mode = _Mode(self._seen)
            self._mode.__enter__()  # type: ignore[no-untyped-call]

    def _seen(self, name: str, first: Any) -> None:
        tensors = [first] if isinstance(first, torch.Tensor) else [t for t in first if isinstance(t, torch.Tensor)]
        for t in tensors if isinstance(first, (torch.Tensor, list, tuple)) else ():
            at = _storage(t)
            for index, (tid, storage) in list(self._targets.items()):
                if id(t) == tid or (at == storage and at > 0 and name != "__set__"):
                    site = user_site()
                    if site is not None:
                        self.sites[index] = site
                        self.after[index] = self._steps() - 1
                    del self._targets[index]

    def _pause(self) -> None:
        """Pop the mode if it is on top of the stack; one under another mode is turned off, popped later."""
        mode = self._mode
        if mode is None:
            return
        stack = _mode_stack()
        if stack and stack[-1] is mode:
            self._mode = None
            mode.__exit__(None, None, None)
        else:
            mode.off = True  # another mode above it (or gone from the stack): never popped in its place
            if mode not in stack:
                self._mode = None

    def stop(self) -> None:
        """Pop the mode and remove the hooks (at the end of the watch, at close, when the optimizer goes)."""
        self._pause()
        for h in self._handles:
            h.remove()
        self._handles = []
        self._targets = {}
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None

    def words(self) -> dict[int, str]:
        """Per tracked index, "tests/x.py:12 (`w.data = w0 * mask`)": where it was set back."""
        return {index: site.quoted() for index, site in self.sites.items()}
