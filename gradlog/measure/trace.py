"""One traced training step: where the path from the loss to a weight is cut, and which tensors took part in
the step without being parameters of the model.

A report that says "grad None: unused, detached, or under torch.no_grad()" leaves the user three guesses and
no place. One step run under `StepTrace` answers with the place: a `TorchFunctionMode` sees every torch call
of the forward and the loss; a call that reads a tensor which requires grad and returns none that does (a
``.detach()``, ``.data``, an op under ``torch.no_grad()``, ``argmax``, a comparison, an integer cast,
``.item()``) is a *cut*, and so is an op whose gradient is zero everywhere (``round``, ``floor``, ``sign``) or,
read from its values at that step, zero here (a ReLU with no positive output, dropout with p >= 1, a product with
an all-zero mask, a ``where``/``maximum``/``minimum`` one side of which never won, a clamp whose every input lies
outside its bounds, a ``masked_fill`` whose mask covers everything).
Each cut keeps the user's frame (the first outside torch and gradlog) and the autograd node of what it read,
so after the step the cut that separates a weight with no gradient from the loss is the one whose input
reaches that weight. Cuts that parameters learn across (a straight-through estimator, an EMA teacher, a
stop-gradient branch, a detached target) are recorded too, and never reported: only weights that ended with
no gradient, or an exactly zero one, look for their cut.

Post-accumulate-grad hooks tell whether backward wrote a weight's gradient at all, so "computed, then cleared
before step()" (a misplaced ``zero_grad()``) is told apart from "the loss never reached it". Leaves that
require grad, get one, and are no parameter of the model, yet belong to it (held by its attributes: modules in
a Python list, a plain ``requires_grad=True`` tensor; or made during the step: a module built inside
``forward``, a tensor made there with ``requires_grad=True``) are recorded with the frame that first used them;
another model's weights the step uses (a GAN's discriminator) are not.

Everything goes through handles removed at the end (hooks) or a mode popped at the end: nothing is set on
the user's model or optimizer. The cost is one step's worth of Python per torch call (measured in
tests/test_trace.py); it runs once, never on the measured-step path.
"""

from __future__ import annotations

import linecache
import logging
import os
import sys
import time
import types
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
    register_module_parameter_registration_hook,
)
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from gradlog.measure.flat_shards import FSDP1_MARK

_log = logging.getLogger("gradlog")
_TORCH_DIR = os.path.dirname(torch.__file__)
_GRADLOG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LIBRARY = f"{os.sep}site-packages{os.sep}"
#: torch calls one traced step records at most: a run's trace that waits for a step through an evaluation
#: loop stops recording there
MAX_CALLS = 200_000
#: calls that turn a tensor into Python numbers: the graph ends there
_TO_PYTHON = frozenset({"item", "tolist", "numpy", "__float__", "__int__", "__index__"})
#: ops whose derivative is zero everywhere: a gradient through them is exactly zero
_ZERO_DERIVATIVE = frozenset({"round", "round_", "floor", "floor_", "ceil", "ceil_", "trunc", "trunc_", "sign", "sgn"})
_COMPARISONS = frozenset(
    {"gt", "ge", "lt", "le", "eq", "ne", "__gt__", "__ge__", "__lt__", "__le__", "__eq__", "__ne__", "greater"}
)
#: calls on a tensor that read no value (shapes, dtypes, devices, printing): never a cut
_NO_VALUE = frozenset({"size", "dim", "numel", "__len__", "__repr__", "__format__", "__bool__", "stride", "__hash__"})
#: the cuts that leave an exactly zero gradient (the others leave none): matched to weights whose gradient is zero
ZERO_KINDS = frozenset(
    {
        "zero_derivative",
        "times_zero",
        "all_ignored",
        "dead_relu",
        "all_dropped",
        "zero_mask",
        "where_unchosen",
        "clamped",
        "max_unchosen",
        "all_masked",
    }
)
_MULTIPLY = frozenset({"mul", "__mul__", "__rmul__", "multiply", "mul_", "__imul__"})
#: activations whose derivative is 0 wherever their output is 0: an all-zero output passes no gradient back
_RELU = frozenset({"relu", "relu_", "relu6"})
#: calls whose gradient to a weight is the product of the other input: an all-zero input gives it a zero one
_PRODUCTS = frozenset({"linear", "conv1d", "conv2d", "conv3d", "matmul", "mm", "bmm", "einsum", *_MULTIPLY})
#: clamps: the gradient passes only where the input lies within [min, max] (bounds included)
_CLAMPS = frozenset(
    {"clamp", "clamp_", "clip", "clip_", "clamp_min", "clamp_min_", "clamp_max", "clamp_max_", "hardtanh"}
)
#: element-wise max/min of two tensors: the gradient goes to the input that won (half each where they tie)
_PICKS = frozenset({"maximum", "minimum", "fmax", "fmin", "max", "min"})
#: masked_fill: the filled elements pass no gradient back to the input
_MASKED_FILL = frozenset({"masked_fill", "masked_fill_"})
#: dropout calls (torch.nn.functional's): with p >= 1 every element is dropped and the gradient is zero
_DROPOUT = frozenset({"dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout"})
#: losses whose targets may all be their ignore_index (a positional ignore_index is their 5th argument)
_IGNORING_LOSSES = frozenset({"cross_entropy", "nll_loss"})
#: in-place calls after backward() that write no value into a gradient they read
_NO_WRITE = frozenset({"requires_grad_", "retain_grad", "share_memory_", "detach_"})
#: torch's own autograd.Function machinery: a call under no_grad below it is a custom Function's forward (whose
#: backward() gives the gradient) or a reentrant checkpoint's (which needs an input that requires grad)
_FUNCTION_FILE = os.path.join(_TORCH_DIR, "autograd", "function.py")
_CHECKPOINT_FILE = os.path.join(_TORCH_DIR, "utils", "checkpoint.py")


@dataclass(frozen=True)
class Site:
    """A line of the user's code: the first stack frame outside torch and gradlog."""

    file: str
    line: int
    code: str  # the source line, stripped ("" when it cannot be read)
    #: the function the line is in ("train:12": its name and first line), to tell two lines of one loop body
    scope: str = field(default="", compare=False, repr=False)

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"

    def quoted(self) -> str:
        """ "model.py:41 (`h = self.enc(x).detach()`)"."""
        return f"{self}" + (f" (`{self.code}`)" if self.code else "")


@dataclass(frozen=True)
class Cut:
    """A call that read a tensor requiring grad and gave nothing a gradient can flow back through (or a
    zero one): `kind` is "detach", "data", "no_grad", "inference_mode", "python" (``.item()`` and friends),
    "integer" (an integer or boolean result: argmax, comparisons, casts), "checkpoint" (reentrant activation
    checkpointing of a block none of whose inputs requires grad), or one of the zero-gradient kinds
    (`ZERO_KINDS`): "zero_derivative", "times_zero" (multiplied by the number 0), "all_ignored" (a
    cross-entropy whose every target is its ignore_index)."""

    kind: str
    op: str
    site: Site | None
    seq: int = 0  # its place among the step's torch calls: the last cut is the nearest the loss
    module: str = ""  # the innermost module of the model whose forward made the call ("3 (ReLU)"), "" outside one
    decorator: Site | None = None  # the @torch.no_grad() / @torch.inference_mode() line the call ran under
    knob: str = ""  # the call's arguments that made it cut ("min=50.0"), where they are numbers

    def what(self) -> str:
        """The cut in words: "`.detach()`", "`linear` under torch.no_grad()"."""
        words = {
            "detach": f"`.{self.op}()`",
            "data": "`.data`",
            "no_grad": f"`{self.op}` run under torch.no_grad()",
            "inference_mode": f"`{self.op}` run under torch.inference_mode()",
            "python": f"`.{self.op}()` (a Python number: no graph back to the weights)",
            "integer": f"`{self.op}` (returns integers/booleans: not differentiable)",
            "zero_derivative": f"`{self.op}` (its gradient is zero everywhere)",
            "checkpoint": f"`{self.op}` run by reentrant activation checkpointing (torch.utils.checkpoint, "
            "use_reentrant=True) with no input that requires grad",
            "times_zero": "`* 0` (multiplied by the number 0: its gradient is zero)",
            "all_ignored": f"`{self.op}` whose every target is its ignore_index (no target counts: the loss "
            "and its gradient are 0)",
            "dead_relu": f"`{self.op}`{self._in()} none of whose outputs was positive (every unit dead: its inputs "
            "were all <= 0, where a ReLU passes no gradient back, and a weight that reads its zero output gets none)",
            "all_dropped": f"`{self.op}`{self._in()} with p >= 1 (every element dropped: its gradient is zero)",
            "zero_mask": f"`{self.op}`{self._in()} by an all-zero tensor (a mask with no non-zero entry: the "
            "product's gradient is zero)",
            "where_unchosen": f"`{self.op}`{self._in()} whose condition chose the other branch everywhere (this "
            "branch's gradient is zero)",
            "clamped": f"`{self.op}`{self._in()} whose every input lay outside its bounds{self._said()} (each output "
            "is a bound, whose gradient is zero)",
            "max_unchosen": f"`{self.op}`{self._in()} whose other input won everywhere (this input's gradient is zero)",
            "all_masked": f"`{self.op}`{self._in()} whose mask is True everywhere (every element filled: the "
            "input's gradient is zero)",
        }
        said = words.get(self.kind, f"`{self.op}`")
        if self.decorator is not None and self.kind in ("no_grad", "inference_mode"):
            said += f" (by the decorator at {self.decorator.quoted()})"
        return said

    def _in(self) -> str:
        return f" in module `{self.module}`" if self.module else ""

    def _said(self) -> str:
        return f" ({self.knob})" if self.knob else ""

    def fix(self) -> str:
        """What to change there, in one line."""
        if self.decorator is not None and self.kind in ("no_grad", "inference_mode"):
            return f"remove `{self.decorator.code}` from this function: it runs every call in it without a graph"
        return {
            "detach": "remove the .detach() (a straight-through estimator keeps a path: x + (q - x).detach())",
            "data": "use the tensor itself, not its .data",
            "no_grad": "move this call out of the torch.no_grad() block",
            "inference_mode": "move this call out of the torch.inference_mode() block",
            "python": "keep the loss a tensor: do not rebuild it from .item() (torch.tensor(loss.item(), "
            "requires_grad=True) is a new leaf with no path to the weights)",
            "integer": "argmax, comparisons and integer casts have no gradient: use a differentiable relaxation "
            "(softmax, Gumbel-softmax) or a straight-through estimator (soft + (hard - soft).detach())",
            "zero_derivative": f"{self.op} has zero gradient: use a straight-through estimator "
            f"(x + (x.{self.op.rstrip('_')}() - x).detach())",
            "checkpoint": "pass use_reentrant=False to checkpoint() (Hugging Face: gradient_checkpointing_enable("
            "gradient_checkpointing_kwargs={'use_reentrant': False}), or model.enable_input_require_grads())",
            "times_zero": "a term multiplied by 0 passes no gradient: drop the factor, or give the term a weight > 0",
            "all_ignored": "check the labels: every one is the ignore_index (-100), e.g. a padding or prompt mask "
            "that covers every token",
            "dead_relu": "the layer in front drives every unit below 0 (a large negative bias or init, an lr that "
            "overshot): re-initialise it (bias 0), lower the lr, or use a leaky activation",
            "all_dropped": "give dropout a p below 1 (p is the share dropped, not kept)",
            "zero_mask": "check the mask: it is zero everywhere (a wrong dtype, comparison or index?)",
            "where_unchosen": "check the condition: it has one value everywhere, so the other branch never counts",
            "clamped": f"the bounds{self._said()} lie beyond every input: check them (a wrong sign, or min and max "
            "swapped?) or the scale of what feeds them",
            "max_unchosen": f"the other input of {self.op} is "
            f"{'smaller' if self.op in ('minimum', 'fmin', 'min') else 'larger'} everywhere: check it (an offset, a "
            "scale or a wrong sign?)",
            "all_masked": "check the mask: it is True everywhere (inverted, or built with the wrong comparison?)",
        }.get(self.kind, "give it a differentiable path to the loss")

    def located(self) -> str:
        """ "cut at model.py:41 (`h = ...`) by `.detach()`"."""
        where = f" at {self.site.quoted()}" if self.site else ""
        return f"cut{where} by {self.what()}"


@dataclass(frozen=True)
class Foreign:
    """A leaf that required grad, took part in the traced step and got a gradient, but is no parameter of
    the model: `path` names it when the model's attributes hold it ("layers[2].weight"), `site` is where the
    step first used it."""

    tensor: torch.Tensor
    path: str | None
    site: Site | None
    container: str | None  # "a Python list of 6 Linear", when an attribute holds it


@dataclass(frozen=True)
class CustomFunction:
    """A custom ``torch.autograd.Function`` a weight's only path to the loss runs through: its class, where its
    backward() is defined, and which of forward's tensor arguments (1-based) leads to the weight."""

    name: str
    site: Site | None
    argument: int


@dataclass
class TraceResult:
    """What one traced step found: per weight (by `id`), whether backward wrote its gradient and whether the
    optimizer then saw none (or a zero one); the cut that explains each weight that got none; the foreign
    leaves; and what the trace cost."""

    #: ids of the weights backward wrote a gradient to (a post-accumulate-grad hook fired with one there)
    accumulated: set[int] = field(default_factory=set)
    #: ids of the weights whose gradient backward wrote had a non-zero entry
    nonzero_accumulated: set[int] = field(default_factory=set)
    #: id -> the last in-place call between backward() and step() that wrote the weight's gradient, and where
    zeroed_by: dict[int, tuple[str, Site | None]] = field(default_factory=dict)
    #: id -> its gradient hooks (register_hook), described, for weights whose gradient was zero at the step
    hooks_of: dict[int, str] = field(default_factory=dict)
    #: id -> the custom autograd.Function it reaches the loss through, for weights with no/zero gradient
    function_of: dict[int, CustomFunction] = field(default_factory=dict)
    #: ids of the weights whose gradient was None at the optimizer's step (or after backward, without one)
    none_at_step: set[int] = field(default_factory=set)
    #: ids of the weights whose gradient was exactly zero at the step
    zero_at_step: set[int] = field(default_factory=set)
    #: id -> the first cut (in call order) whose input reaches the weight, for weights with no/zero gradient
    cut_of: dict[int, Cut] = field(default_factory=dict)
    #: ids of the weights some traced call read (directly or through a module's forward)
    used: set[int] = field(default_factory=set)
    #: a parameter's name -> (id of the tensor its module held in that slot while its forward ran, where that
    #: forward was called), for slots that held a tensor the optimizer does not step (torch.func.functional_call)
    swapped: dict[str, tuple[int, Site | None]] = field(default_factory=dict)
    foreign: list[Foreign] = field(default_factory=list)
    #: the loss had no grad_fn: it was rebuilt as a new leaf (or never required grad); its cut, where one is known
    loss_leaf: bool = False
    #: a parameter's name -> where the traced step registered it anew on the model's module (an nn.Parameter
    #: made in forward: a new tensor at every call, never the one the optimizer steps)
    remade: dict[str, Site | None] = field(default_factory=dict)
    #: id -> where the traced step set the weight's requires_grad to False (``requires_grad_(False)`` in forward)
    frozen_by: dict[int, Site | None] = field(default_factory=dict)
    #: where the traced step's backward() and the optimizer's step() were called from
    backward_site: Site | None = None
    step_site: Site | None = None
    calls: int = 0  # torch calls traced
    seconds: float = 0.0  # wall time of the traced step, the step itself included
    step: int | None = None  # a run's optimizer step that was traced (None: gradlog.check's)

    def cleared(self, pid: int) -> bool:
        """Backward wrote a gradient, and the optimizer's step saw none: cleared in between."""
        return pid in self.accumulated and pid in self.none_at_step

    def zeroed(self, pid: int) -> bool:
        """Backward wrote a non-zero gradient, and the optimizer's step saw an all-zero one: zeroed in between
        (clipped with max_norm=0, zero_grad(set_to_none=False))."""
        return pid in self.nonzero_accumulated and pid in self.zero_at_step

    def step_before_backward(self) -> bool:
        """The loop's body calls step() on a line above backward() (one function, one file): each step() runs
        before the backward() of its iteration, after the next zero_grad() cleared the previous one's gradient."""
        b, s = self.backward_site, self.step_site
        return b is not None and s is not None and b.file == s.file and b.scope == s.scope != "" and s.line < b.line

    def cost(self) -> str:
        return f"one traced step: {self.calls} torch calls, {self.seconds * 1e3:.0f} ms"

    def label(self) -> str:
        """ "traced step (optimizer step 51; 812 torch calls)": what the records' causes come from, and its
        cost in torch calls (the same in every run of the same code: the records stay reproducible; the time
        it took is logged, `cost`)."""
        at = f"optimizer step {self.step}; " if self.step is not None else ""
        return f"traced step ({at}{self.calls} torch calls)"


def user_site(skip: Iterable[str] = ()) -> Site | None:
    """The user's line: from the caller outwards, the first frame outside torch and gradlog (and `skip`),
    preferring one outside installed libraries (site-packages), so that a cut inside a Hugging Face model
    under the user's torch.no_grad() names the user's call, not transformers' line."""
    frame = _user_frame(skip)
    if frame is None:
        return None
    path = frame.f_code.co_filename
    code = linecache.getline(path, frame.f_lineno).split("  #")[0].strip()  # the statement, not its comment
    code = code if len(code) <= 80 else code[:77] + "..."
    return Site(_shown(path), frame.f_lineno, code, f"{frame.f_code.co_name}:{frame.f_code.co_firstlineno}")


def grad_decorator() -> Site | None:
    """The ``@torch.no_grad()`` / ``@torch.inference_mode()`` line that decorates the user's function now running
    (the frame `user_site` names), or None: a cut under it comes from the decorator, not from a block."""
    frame = _user_frame(())
    if frame is None:
        return None
    path, line = frame.f_code.co_filename, frame.f_code.co_firstlineno  # a decorated def's first decorator
    while (text := linecache.getline(path, line).split("#")[0].strip()).startswith("@"):
        if "no_grad" in text or "inference_mode" in text:
            return Site(_shown(path), line, text)
        line += 1
    return None


def _user_frame(skip: Iterable[str]) -> types.FrameType | None:
    """The first frame outside torch and gradlog (and `skip`), preferring one outside installed libraries."""
    frame: types.FrameType | None = sys._getframe(1)
    dirs = (_TORCH_DIR, _GRADLOG_DIR, *skip)
    fallback: types.FrameType | None = None
    while frame is not None:
        path = frame.f_code.co_filename
        if not path.startswith(dirs) and not path.startswith("<frozen"):
            if _LIBRARY not in path and "dist-packages" not in path:
                break
            fallback = fallback or frame
        frame = frame.f_back
    return frame or fallback


#: the distributed wrappers' own code (DDP, FSDP, DTensor's sharding, collectives): its calls are no part of the step
_WRAPPER_DIRS = (os.path.join(_TORCH_DIR, "distributed", ""), os.path.join(_TORCH_DIR, "nn", "parallel", ""))


def _wrapper_call() -> bool:
    """The torch call was made by a distributed wrapper (an all-gather, a gradient bucket, DTensor's local op),
    not by the model's code: a frame of the wrapper lies between it and the first frame outside torch and
    gradlog. Such calls are left out of the traced step's count, so that the count is the code's, the same
    on one process and on each rank of a sharded or replicated run (test_distributed)."""
    frame: types.FrameType | None = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(_WRAPPER_DIRS):
            return True
        if not path.startswith((_TORCH_DIR, _GRADLOG_DIR)) and not path.startswith("<frozen"):
            return False
        frame = frame.f_back
    return False


def _shown(path: str) -> str:
    """A path as the report shows it: relative to the working directory when under it."""
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        return path
    return path if rel.startswith("..") else rel


def _tensors(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """The tensors in a call's arguments or result: tensors, and those in lists, tuples and dicts (two deep)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 2 and isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x, depth + 1)
    elif depth < 2 and isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x, depth + 1)


def _name(func: Any) -> str:
    name = getattr(func, "__name__", None) or repr(func)
    if name == "__get__":  # a property: Tensor.data, Tensor.grad, ...
        owner = getattr(func, "__self__", None)
        name = getattr(owner, "__name__", name)
    return str(name)


def _kind(name: str, args: Any, kwargs: dict[str, Any], outs: list[torch.Tensor]) -> str | None:
    """Whether a call that read a tensor requiring grad cut the path (and how), from what it returned."""
    if name in _NO_VALUE:
        return None
    if name in _TO_PYTHON:
        return "python"
    if not outs:
        return None
    if name in _ZERO_DERIVATIVE and any(o.requires_grad for o in outs):
        return "zero_derivative"
    if any(o.requires_grad for o in outs):
        if name in _MULTIPLY and any(_is_zero_number(a) for a in args):
            return "times_zero"
        if name in _IGNORING_LOSSES and _all_ignored(args, kwargs):
            return "all_ignored"
        return _zero_gradient(name, args, kwargs, outs)
    return _cut_kind(name, outs)


def _zero_gradient(name: str, args: Any, kwargs: dict[str, Any], outs: list[torch.Tensor]) -> str | None:
    """A differentiable call whose gradient back to its inputs is exactly zero at this step, seen from its
    values: a ReLU none of whose outputs is positive (every unit dead), dropout with p >= 1, a product with an
    all-zero tensor (a mask of zeros), a `torch.where` whose condition is all one value (the other branch)."""
    if name in _RELU:
        return "dead_relu" if outs[0].numel() and not bool(outs[0].any()) else None
    if name in _DROPOUT:
        p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
        training = kwargs.get("training", args[2] if len(args) > 2 else True)
        return "all_dropped" if isinstance(p, (int, float)) and p >= 1 and training else None
    if name in _MULTIPLY:
        factors = [a for a in args[:2] if isinstance(a, torch.Tensor) and not a.requires_grad]
        return "zero_mask" if any(f.numel() and not bool(f.any()) for f in factors) else None
    if name == "where" and _where_unchosen(args, kwargs) is not None:
        return "where_unchosen"
    if name in _CLAMPS and _clamped(name, args, kwargs) is not None:
        return "clamped"
    if name in _PICKS and _unpicked(name, args) is not None:
        return "max_unchosen"
    if name in _MASKED_FILL and _all_masked(args, kwargs):
        return "all_masked"
    return None


def _number(value: Any) -> float | None:
    """A bound given as a Python number or a one-element tensor; None otherwise."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.requires_grad:
        return float(value.item())
    return None


def _clamped(name: str, args: Any, kwargs: dict[str, Any]) -> str | None:
    """A clamp none of whose input elements lies within its bounds (each output is a bound: the gradient is zero
    everywhere), as its bounds in words ("min=50.0"); None when some input passes, or the bounds are not numbers."""
    x = args[0] if args else kwargs.get("input")
    if not isinstance(x, torch.Tensor) or not x.numel() or not x.is_floating_point():
        return None
    if name == "hardtanh":
        lo: Any = kwargs.get("min_val", args[1] if len(args) > 1 else -1.0)
        hi: Any = kwargs.get("max_val", args[2] if len(args) > 2 else 1.0)
    elif name.startswith("clamp_max"):
        lo, hi = None, kwargs.get("max", args[1] if len(args) > 1 else None)
    else:
        lo = kwargs.get("min", args[1] if len(args) > 1 else None)
        hi = None if name.startswith("clamp_min") else kwargs.get("max", args[2] if len(args) > 2 else None)
    low, high = _number(lo), _number(hi)
    if (lo is not None and low is None) or (hi is not None and high is None) or (low is None and high is None):
        return None
    with torch.no_grad():
        inside = torch.ones_like(x, dtype=torch.bool)
        if low is not None:
            inside &= x >= low
        if high is not None:
            inside &= x <= high
        if bool(inside.any()):
            return None
    return ", ".join(f"{k}={v:g}" for k, v in (("min", low), ("max", high)) if v is not None)


def _unpicked(name: str, args: Any) -> int | None:
    """An element-wise max/min of two tensors one of which the other beat everywhere: the loser's position (0 or
    1), whose gradient is zero; None when each wins somewhere (or they tie: the gradient is split)."""
    if len(args) < 2 or not all(isinstance(a, torch.Tensor) and a.is_floating_point() for a in args[:2]):
        return None
    a, b = args[0], args[1]
    if not a.numel() or not b.numel():
        return None
    with torch.no_grad():
        a_wins = a > b if name in ("maximum", "fmax", "max") else a < b
        if bool(a_wins.all()):
            return 1
        b_wins = b > a if name in ("maximum", "fmax", "max") else b < a
        return 0 if bool(b_wins.all()) else None


def _all_masked(args: Any, kwargs: dict[str, Any]) -> bool:
    """`x.masked_fill(mask, value)` whose mask is True at every element of x: x gets a zero gradient."""
    x = args[0] if args else kwargs.get("input")
    mask = args[1] if len(args) > 1 else kwargs.get("mask")
    if not isinstance(x, torch.Tensor) or not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        return False
    if not x.numel() or not mask.numel():
        return False
    return bool(mask.broadcast_to(x.shape).all()) if mask.dim() <= x.dim() else False


def _where_unchosen(args: Any, kwargs: dict[str, Any]) -> int | None:
    """`torch.where(cond, a, b)` whose condition is all True (2: `b` is never chosen) or all False (1: `a`)."""
    cond = args[0] if args else kwargs.get("condition")
    if not isinstance(cond, torch.Tensor) or cond.dtype != torch.bool or not cond.numel() or len(args) < 3:
        return None
    if bool(cond.all()):
        return 2
    return 1 if not bool(cond.any()) else None


def _cut_kind(name: str, outs: list[torch.Tensor]) -> str | None:
    """How a call that returned nothing requiring grad cut the path."""
    if name in ("detach", "detach_"):
        return "detach"
    if name == "data":
        return "data"
    if torch.is_inference_mode_enabled():
        return "inference_mode"
    if not torch.is_grad_enabled():
        inside = _under_function()
        return "no_grad" if inside is None else inside or None
    if not any(o.is_floating_point() or o.is_complex() for o in outs):
        return "integer"
    return "other"


def _freezes(func: Any, args: Any, kwargs: dict[str, Any]) -> bool:
    """``t.requires_grad_(False)`` or ``t.requires_grad = False``: a call that turns a tensor's gradient off."""
    name = getattr(func, "__name__", "")
    if name == "requires_grad_":
        flag = args[1] if len(args) > 1 else kwargs.get("requires_grad", True)
        return flag is False
    owner = getattr(func, "__self__", None)
    return name == "__set__" and getattr(owner, "__name__", "") == "requires_grad" and len(args) > 1 and not args[1]


def _is_zero_number(value: Any) -> bool:
    """The Python number 0 (a factor `0 * loss_b`), not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0


def _all_ignored(args: Any, kwargs: dict[str, Any]) -> bool:
    """A cross-entropy / NLL call whose every target is its ignore_index: no target counts, the gradient is 0."""
    target = args[1] if len(args) > 1 else kwargs.get("target")
    ignore = kwargs.get("ignore_index", args[4] if len(args) > 4 else -100)
    if not isinstance(target, torch.Tensor) or target.is_floating_point() or target.numel() == 0:
        return False
    return bool((target == ignore).all())


def _under_function() -> str | None:
    """A call under no_grad made inside an autograd.Function's forward: "checkpoint" inside a reentrant
    torch.utils.checkpoint (its block learns only through an input that requires grad), "" inside any other
    Function (its forward runs under no_grad by design; its backward() gives the gradients: no cut), None
    outside one."""
    frame: types.FrameType | None = sys._getframe(2)
    inside = None
    while frame is not None:
        path = frame.f_code.co_filename
        if path == _CHECKPOINT_FILE:
            return "checkpoint"
        if path == _FUNCTION_FILE:
            inside = ""
        frame = frame.f_back
    return inside


class _Recorder(TorchFunctionMode):
    """Sees every torch call while pushed; hands each to the trace (never failing the user's call)."""

    def __init__(self, trace: StepTrace) -> None:
        super().__init__()
        self.trace = trace

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        try:
            self.trace.saw(func, args, kwargs or {}, out)
        except Exception:  # the trace is advice: a call it cannot read is skipped, the step goes on
            pass
        return out


class StepTrace:
    """Trace one training step of `model` (and its `optimizer`, when given).

    ``with StepTrace(model, optimizer) as trace: <forward, loss, backward, step>`` then ``trace.result()``;
    or `start()` / `stop()` from two places (a forward pre-hook and the next optimizer step pre-hook). The
    loss, when known (`loss(t)`), lets the result say whether it had a grad_fn at all.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        self.model = model
        self.optimizer = optimizer
        params: dict[int, torch.Tensor] = {id(p): p for p in model.parameters()}
        if optimizer is not None:
            for group in optimizer.param_groups:
                params.update({id(p): p for p in group["params"]})
        self.params = params
        self.attributes = unregistered(model, set(params))
        self._mode = _Recorder(self)
        self._handles: list[RemovableHandle] = []
        self._cuts: list[tuple[Cut, list[Any]]] = []
        self._foreign: dict[int, tuple[torch.Tensor, Site | None]] = {}
        self._made: set[int] = set()  # leaves requiring grad created during the step (by a factory call)
        self._foreign_grad: set[int] = set()
        self._functions: dict[int, Any] = {}  # the custom autograd.Function nodes the step's calls read
        self._grad_ids: dict[int, int] | None = None  # id of a weight's gradient -> the weight's, after backward
        self._result = TraceResult()
        self._seen = 0  # torch calls seen, the wrappers' included: the cap and the order of cuts
        self._started = 0.0
        self._stepped = False
        self._recording = False
        self._after_backward = False  # backward() began: later calls (a copy of the weights, logging) are no cut
        self._names = {id(m): name for name, m in model.named_modules() if name}
        self._prefixes = {id(m): f"{name}." if name else "" for name, m in model.named_modules()}
        self._stepped_ids = (
            {id(p) for g in optimizer.param_groups for p in g["params"]} if optimizer is not None else None
        )
        self._stack: list[nn.Module] = []  # the modules whose forward is running, innermost last
        self._call_site: Site | None = None  # where the outermost module's forward was called
        self._dead: dict[int, tuple[torch.Tensor, Cut]] = {}  # a dead ReLU's all-zero output (held) -> its cut
        self.active = False

    # --- start and stop -------------------------------------------------------------------------------
    def __enter__(self) -> StepTrace:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self._started = time.perf_counter()
        self._call_site = user_site()  # started from the model's forward pre-hook: the line that called it
        for pid, p in self.params.items():
            if p.requires_grad and p.is_leaf:
                self._handles.append(p.register_post_accumulate_grad_hook(self._accumulated_hook(pid)))  # type: ignore[no-untyped-call]
        # a global pre-hook runs before every per-optimizer one (gradlog's own measuring included): the mode
        # is off before anything reads the weights for the step
        self._handles.append(register_optimizer_step_pre_hook(self._step_pre_hook))
        self._handles.append(register_module_forward_pre_hook(self._entered))
        self._handles.append(register_module_parameter_registration_hook(self._registered))
        self._handles.append(register_module_forward_hook(self._left, always_call=True))
        self._mode.__enter__()  # type: ignore[no-untyped-call]
        self._recording = True
        self.active = True

    def stop(self) -> None:
        """Pop the mode, remove every hook, and read the gradients if no optimizer step did."""
        if not self.active:
            return
        self.active = False
        self._pause()
        if not self._stepped:
            self._read_grads()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._result.seconds = time.perf_counter() - self._started

    def loss(self, loss: torch.Tensor) -> None:
        """The step's loss, when the caller has it: a loss without grad_fn is a finding of its own."""
        self._result.loss_leaf = loss.grad_fn is None

    @property
    def stepped(self) -> bool:
        """The traced optimizer's step began: the step's forward, loss and backward are recorded."""
        return self._stepped

    # --- hooks ----------------------------------------------------------------------------------------
    def _accumulated_hook(self, pid: int) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            # the hook fires for a weight whose gradient a custom Function's backward() gave as None, with none
            if p.grad is not None:
                self._result.accumulated.add(pid)
                # a plain tensor only: counting a sharded gradient's entries (a DTensor) would be a collective
                if type(p.grad) is torch.Tensor and (p.grad.is_sparse or p.grad.count_nonzero().item()):
                    self._result.nonzero_accumulated.add(pid)
            self._after_backward = True

        return hook

    def _entered(self, module: nn.Module, *_: Any) -> None:
        self._stack.append(module)
        prefix = self._prefixes.get(id(module))
        if prefix is None or self._stepped_ids is None or not self._recording:
            return
        if module is self.model:  # the user's call of the model (a functional_call's line, not one in forward)
            self._call_site = user_site()
        # gradlog's own look, not one of the step's torch calls: a DTensor's (FSDP2) `requires_grad` goes through the
        # recorder as a torch function, which made a sharded run's traced step longer than one process's
        with torch._C.DisableTorchFunction():
            for pname, t in module._parameters.items():  # what forward reads: the optimizer's tensors, or others
                if t is not None and id(t) not in self._stepped_ids and t.requires_grad:
                    self._result.swapped.setdefault(prefix + pname, (id(t), self._call_site))

    def _registered(self, module: nn.Module, name: str, param: Any) -> None:
        """A parameter registered on a module of the model during the step (``self.w = nn.Parameter(...)`` in
        forward): the model's tensor of that name is new at every call."""
        prefix = self._prefixes.get(id(module))
        if prefix is not None and param is not None and self._recording:
            self._result.remade.setdefault(prefix + name, user_site())

    def _left(self, module: nn.Module, *_: Any) -> None:
        if self._stack and self._stack[-1] is module:
            self._stack.pop()

    def _module_now(self) -> str:
        """The innermost module of the model whose forward is running: "drop (Dropout(p=1.0, inplace=False))"
        for a module without children, "blocks.0 (Block)" for one with; "" outside the model's submodules."""
        for m in reversed(self._stack):
            name = self._names.get(id(m))
            if name is not None:
                said = repr(m) if not next(m.children(), None) else type(m).__name__
                return f"{name} ({said if len(said) <= 60 else type(m).__name__})"
        return ""

    def _pause(self) -> None:
        if self._recording:
            self._recording = False
            self._mode.__exit__(None, None, None)  # type: ignore[no-untyped-call]

    def _step_pre_hook(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        """The step of the traced optimizer (any, without one) ends the trace: what it does is not the forward."""
        if self._stepped or (self.optimizer is not None and optimizer is not self.optimizer):
            return
        self._stepped = True
        self._pause()
        self._result.step_site = user_site()
        self._read_grads()

    def _read_grads(self) -> None:
        with torch.no_grad():
            for pid, p in self.params.items():
                if not p.requires_grad:
                    continue
                if p.grad is None:
                    self._result.none_at_step.add(pid)
                elif not p.grad.is_sparse and p.grad.count_nonzero().item() == 0:
                    self._result.zero_at_step.add(pid)

    # --- the mode's callback ----------------------------------------------------------------------------
    def saw(self, func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> None:
        """One torch call: note the weights it read, foreign leaves, and whether it cut the graph."""
        self._seen += 1
        if self._seen > MAX_CALLS:  # a step that never ends (an evaluation loop before the next step)
            self._pause()
            return
        if args and isinstance(args[0], torch.Tensor) and id(args[0]) in self.params and _freezes(func, args, kwargs):
            self._result.frozen_by.setdefault(id(args[0]), user_site())
        if func is torch.Tensor.backward:
            self._result.backward_site = self._result.backward_site or user_site()
            self._after_backward = True
            self._grad_ids = None  # the gradients as backward() left them, read at the next in-place call
            return
        if self._after_backward:
            # between backward() and the step: what the loop does there cuts no path from the loss, but it may
            # write the gradients (clip_grad_norm_, zero_grad(set_to_none=False))
            self._grad_write(_name(func), args)
            return
        if not _wrapper_call():
            self._result.calls += 1
        inputs = [*_tensors(args), *_tensors(kwargs)]
        name = _name(func)
        outs = list(_tensors(out))
        for o in outs:  # a leaf requiring grad made during the step: torch.randn(..., requires_grad=True)
            if o.is_leaf and o.requires_grad and id(o) not in self.params and not inputs:
                self._made.add(id(o))
        graded = [t for t in inputs if t.requires_grad]
        if not graded:
            return
        for t in graded:
            if isinstance(t.grad_fn, torch.autograd.function.BackwardCFunction):  # a custom Function's output
                self._functions.setdefault(id(t.grad_fn), t.grad_fn)
            if id(t) in self.params:
                self._result.used.add(id(t))
                continue
            if t.is_leaf and id(t) not in self._foreign:
                self._foreign[id(t)] = (t, user_site())
                self._handles.append(t.register_post_accumulate_grad_hook(self._foreign_hook(id(t))))  # type: ignore[no-untyped-call]
            if getattr(func, "__module__", None) == "torch.nn.init":
                self._made.add(id(t))  # initialised during the step: a module built in forward
        kind = _kind(name, args, kwargs, outs)
        if kind is not None:
            if kind in ("where_unchosen", "max_unchosen", "all_masked"):  # only the side that lost gets a zero one
                at = {"where_unchosen": _where_unchosen(args, kwargs), "max_unchosen": _unpicked(name, args)}.get(kind)
                side = args[at or 0]
                graded = [side] if isinstance(side, torch.Tensor) and side.requires_grad else []
            deco = grad_decorator() if kind in ("no_grad", "inference_mode") else None
            knob = (_clamped(name, args, kwargs) or "") if kind == "clamped" else ""
            cut = Cut(kind, name, user_site(), self._seen, self._module_now(), deco, knob)
            self._cuts.append((cut, [t.grad_fn if t.grad_fn is not None else t for t in graded]))
            if kind == "dead_relu":
                self._dead[id(outs[0])] = (outs[0], cut)
        elif self._dead and name in _PRODUCTS:
            # a weight multiplied by a dead ReLU's all-zero output gets a zero gradient from it: the same cause
            held = [self._dead[id(t)][1] for t in inputs if id(t) in self._dead]
            weights = [t for t in graded if id(t) in self.params]
            if held and weights:
                self._cuts.append((held[0], weights))

    def _grad_write(self, name: str, args: Any) -> None:
        """An in-place call after backward() whose first argument holds weights' gradients: the last one per
        weight is what the step's all-zero gradient came from, when backward() wrote a non-zero one."""
        if not name.endswith("_") or name in _NO_WRITE or not args:
            return
        if self._grad_ids is None:
            self._grad_ids = {id(p.grad): pid for pid, p in self.params.items() if p.grad is not None}
        hit = [self._grad_ids[id(t)] for t in _tensors(args[0]) if id(t) in self._grad_ids]
        if hit:
            site = user_site()
            for pid in hit:
                self._result.zeroed_by[pid] = (name, site)

    def _foreign_hook(self, tid: int) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            self._foreign_grad.add(tid)

        return hook

    # --- after the step ---------------------------------------------------------------------------------
    def result(self) -> TraceResult:
        """The findings (call after `stop`): cuts matched to the weights they starve, foreign leaves named."""
        res = self._result
        trainable = [pid for pid, p in self.params.items() if p.requires_grad]
        # no gradient: a cut stopped backward; an exactly zero one: backward got there through a zero derivative
        none = [pid for pid in trainable if pid in res.none_at_step]
        zero = [pid for pid in trainable if pid in res.zero_at_step]
        stops = [c for c in self._cuts if c[0].kind not in ZERO_KINDS]
        flats = [c for c in self._cuts if c[0].kind in ZERO_KINDS]
        res.cut_of = {**_match(stops, none), **_match(flats, zero)}
        uncut = [pid for pid in [*none, *zero] if pid not in res.cut_of and not res.cleared(pid)]
        res.hooks_of = {pid: h for pid in zero if pid in uncut and (h := _hooks(self.params[pid]))}
        res.function_of = _through_functions(list(self._functions.values()), uncut)
        res.foreign = self._named_foreign()
        self._cuts.clear()  # the autograd nodes they hold keep activations alive
        self._dead.clear()
        self._functions.clear()
        return res

    def _named_foreign(self) -> list[Foreign]:
        by_id = {id(t): (path, container) for path, container, t in self.attributes}
        out = []
        for tid, (t, site) in self._foreign.items():
            if tid not in self._foreign_grad:
                continue
            path, container = by_id.get(tid, (None, None))
            # another model's weights (a GAN's discriminator) are not this model's to hold: only leaves the
            # model's attributes hold, or that the step made (a module built in forward), are named; a 0-dim
            # leaf the step made is a loss rebuilt from a number, not a weight
            if path is None and (tid not in self._made or (t.dim() == 0 and not isinstance(t, nn.Parameter))):
                continue
            out.append(Foreign(t, path, site, container))
        self._foreign.clear()
        return out


def starved(rows: Sequence[Any], has_grad: Sequence[bool], nonzero: Sequence[float]) -> bool:
    """A measured step's rows (`Tracked`) show a trainable tensor of the model, in the optimizer, with no
    gradient or an all-zero one: what makes a run trace one step (a C-speed test first: most steps have none)."""
    if False not in has_grad and 0.0 not in nonzero:
        return False
    for row, has, nz in zip(rows, has_grad, nonzero):
        if (not has or nz == 0.0) and row.in_model and row.group is not None:
            p = row.held()
            if p is not None and p.requires_grad:
                return True
    return False


class OnceTrace:
    """A run's one traced step: armed when the model's attributes hold tensors outside its parameters (at
    once), when the model's first forward creates parameters (a module built inside `forward`: torch's global
    parameter-registration hook, on for that one forward), or when the first measured step shows a trainable
    tensor without a gradient or with an all-zero one (`after_log`); it then traces from the next forward of
    the model to the next optimizer step, is read out at the next `log()` (or at close), and is done. A
    healthy run pays one scan of the modules' attributes at the start, two hook calls around its first
    forward and one test of the first measured step: nothing on the measured-step path.
    Holds the model and optimizer weakly (a logger never keeps them alive); every hook has a handle."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        self._model = weakref.ref(model)
        self._optimizer = weakref.ref(optimizer) if optimizer is not None else None
        self.state = "waiting"  # -> "armed" (a forward pre-hook) -> "tracing" -> "done"
        self._handle: RemovableHandle | None = None
        self._trace: StepTrace | None = None
        self.result: TraceResult | None = None
        known = {id(p) for p in model.parameters()}
        if optimizer is not None:
            known |= {id(p) for g in optimizer.param_groups for p in g["params"]}
        #: ids of the model's tensors that required grad at the start: one frozen since arms the trace, which
        #: then names the line that freezes it, where that line runs at every step (in forward)
        self.trainable = frozenset(id(p) for p in model.parameters() if p.requires_grad)
        #: the first forward's hooks and, during it, the global parameter-registration hook (`_first_forward`)
        self._first: list[RemovableHandle] = []
        self.made_in_forward = 0  # parameters registered during the model's first forward
        if unregistered(model, known):
            self.arm()
        else:
            self._first = [
                model.register_forward_pre_hook(self._first_forward),
                model.register_forward_hook(self._first_forward_done, always_call=True),
            ]

    def refrozen(self) -> bool:
        """A tensor of the model that required grad at the start and is frozen now, while the optimizer holds it
        (measured steps leave frozen tensors out, so `starved` cannot see it): the trace names the line that
        freezes it, where that line runs at every step. One pass over the parameters, at the first measured
        step only."""
        model = self._model()
        optimizer = self._optimizer() if self._optimizer is not None else None
        if model is None or optimizer is None:
            return False
        held = {id(p) for g in optimizer.param_groups for p in g["params"]}
        return any(not p.requires_grad and id(p) in self.trainable and id(p) in held for p in model.parameters())

    def _first_forward(self, module: nn.Module, args: Any) -> None:
        """Before the model's first forward: count the parameters any module registers until it returns. Inside a
        forward that torch.compile traces, nothing: a hook registered or removed there is a graph break (two more
        compiled frames on a small model); such a model's modules made inside `forward` go unseen by this hook."""
        if torch.compiler.is_compiling():
            return
        register = torch.nn.modules.module.register_module_parameter_registration_hook
        self._first.append(register(self._registered))

    def _registered(self, module: nn.Module, name: str, param: Any) -> None:
        if param is not None:
            self.made_in_forward += 1

    def _first_forward_done(self, module: nn.Module, args: Any, output: Any) -> None:
        """After the first forward: every hook of it goes; parameters made during it arm the trace (modules
        built inside `forward` are made again at every call, and the traced step names them). Traced by
        torch.compile: nothing (see `_first_forward`); the hooks stay, inert, until an eager forward or close."""
        if torch.compiler.is_compiling():
            return
        self._unhook_first()
        if self.made_in_forward:
            self.arm()

    def _unhook_first(self) -> None:
        for handle in self._first:
            handle.remove()
        self._first = []

    def disable(self) -> None:
        """No traced step in this run: DeepSpeed ZeRO moves every gradient into its partitions between
        backward() and step(), which a trace would read as gradients cleared in between."""
        self._unhook_first()
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self.state = "done"

    def arm(self) -> None:
        model = self._model()
        if self.state != "waiting" or model is None:
            return
        self._handle = model.register_forward_pre_hook(self._pre_forward)
        self.state = "armed"

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        optimizer = self._optimizer() if self._optimizer is not None else None
        self._trace = StepTrace(module, optimizer)
        self._trace.start()
        self.state = "tracing"

    def after_log(self, starved: Callable[[], bool] | None, step: int) -> None:
        """After `log()`: a traced step that reached its optimizer step is read out; a new measurement whose
        `starved()` says a trainable tensor got no (or a zero) gradient arms the trace. `step`: optimizer steps."""
        if self.state == "tracing" and self._trace is not None and self._trace.stepped:
            self._finish(step - 1)  # the traced step was the last one taken
        elif self.state == "waiting" and starved is not None:
            # only the first measured step decides: a tensor that had a gradient there can never be reported
            # as never getting one (no_grad, zero_grad need it at every measured step); after it, log() pays
            # one comparison
            if starved():
                self.arm()
            else:
                self.state = "done"

    def _finish(self, step: int | None) -> None:
        trace, self._trace = self._trace, None
        if trace is not None:
            trace.stop()
            self.result = trace.result()
            self.result.step = step
            _log.info("gradlog: traced optimizer step %d to locate the causes (%s)", step, self.result.cost())
        self.state = "done"

    def close(self, step: int) -> TraceResult | None:
        """At close(): remove what is still hooked; the result, if a step was traced."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self._unhook_first()
        if self.state == "tracing":
            stepped = self._trace is not None and self._trace.stepped
            self._finish(step - 1)
            if not stepped:
                self.result = None  # a forward without its optimizer step: nothing to say
        self.state = "done"
        return self.result


def _match(cuts: list[tuple[Cut, list[Any]]], starved: list[int]) -> dict[int, Cut]:
    """For each starved weight, the first cut (in call order) whose input reaches it in the autograd graph."""
    if not cuts or not starved:
        return {}
    bit = {pid: 1 << i for i, pid in enumerate(starved)}
    memo: dict[Any, int] = {}
    out: dict[int, Cut] = {}
    for cut, sources in cuts:
        mask = 0
        for s in sources:
            mask |= bit.get(id(s), 0) if isinstance(s, torch.Tensor) else _reach(s, bit, memo)
        for pid, b in bit.items():
            if mask & b and pid not in out:
                out[pid] = cut
        if len(out) == len(bit):
            break
    return out


def _reach(node: Any, bit: dict[int, int], memo: dict[Any, int]) -> int:
    """The starved weights (a bit mask) an autograd node leads to: an iterative post-order walk, memoised."""
    stack = [(node, False)]
    while stack:
        n, expanded = stack.pop()
        if n in memo:
            continue
        nexts = [m for m, _ in getattr(n, "next_functions", ()) if m is not None]
        if not expanded:
            stack.append((n, True))
            stack.extend((m, False) for m in nexts if m not in memo)
            continue
        mask = 0
        var = getattr(n, "variable", None)
        if isinstance(var, torch.Tensor):
            mask |= bit.get(id(var), 0)
        for m in nexts:
            mask |= memo.get(m, 0)
        memo[n] = mask
    return memo.get(node, 0)


def _code_site(fn: Any) -> Site | None:
    """Where a Python function is defined: its `def` line (after any decorators), or None (a C function)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    line = code.co_firstlineno
    while linecache.getline(code.co_filename, line).lstrip().startswith("@"):  # past the decorators
        line += 1
    text = linecache.getline(code.co_filename, line).split("  #")[0].strip()
    return Site(_shown(code.co_filename), line, text if len(text) <= 80 else text[:77] + "...")


def _hooks(p: torch.Tensor) -> str:
    """A weight's gradient hooks (``register_hook``), described: "`<lambda>` at model.py:40 (`...`)"; "" if none."""
    hooks = list(getattr(p, "_backward_hooks", None) or {})
    said = []
    for key in hooks:
        fn = p._backward_hooks[key]  # type: ignore[index]
        site = _code_site(getattr(fn, "func", fn))  # a functools.partial: its function
        name = getattr(fn, "__qualname__", type(fn).__name__)
        said.append(f"`{name}`" + (f" at {site.quoted()}" if site else ""))
    return ", ".join(said)


def _through_functions(nodes: list[Any], starved: list[int]) -> dict[int, CustomFunction]:
    """For each starved weight, the first custom autograd.Function (of the user's, not torch's own) one of whose
    inputs leads to it: its backward() gave that input no gradient, or a zero one, as nothing else cut it."""
    if not nodes or not starved:
        return {}
    bit = {pid: 1 << i for i, pid in enumerate(starved)}
    memo: dict[Any, int] = {}
    out: dict[int, CustomFunction] = {}
    for node in nodes:
        cls = getattr(node, "_forward_cls", None)
        if cls is None or str(getattr(cls, "__module__", "")).startswith("torch."):
            continue
        for i, (nxt, _) in enumerate(node.next_functions):
            mask = _reach(nxt, bit, memo) if nxt is not None else 0
            for pid, b in bit.items():
                if mask & b and pid not in out:
                    out[pid] = CustomFunction(cls.__qualname__, _code_site(cls.backward), i + 1)
    return out


def unregistered(model: nn.Module, known: set[int]) -> list[tuple[str, str, torch.Tensor]]:
    """Tensors requiring grad that the model's attributes hold outside its parameters: modules or tensors in
    a Python list, tuple or dict, a plain tensor attribute, or a buffer made with requires_grad=True. Each as
    (path, what holds it, tensor), e.g. ("layers[2].weight", "a Python list of 6 Linear", w); tensors the model
    does hold as parameters are left out (a list of references to registered layers is fine)."""
    internal = set(vars(nn.Module()))
    out: list[tuple[str, str, torch.Tensor]] = []
    seen: set[int] = set()
    for mod_name, module in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        held = [
            found for key, value in vars(module).items() if key not in internal for found in _held(prefix + key, value)
        ]
        # register_buffer keeps a tensor out of parameters() even with requires_grad=True: one meant to learn
        held += [(prefix + k, b, BUFFER) for k, b in module._buffers.items() if isinstance(b, torch.Tensor)]
        for path, t, container in held:
            if getattr(t, FSDP1_MARK, False):  # FSDP1's flat parameter: the model's own parameters, flattened
                continue
            if id(t) not in known and id(t) not in seen and t.requires_grad and t.is_leaf:
                seen.add(id(t))
                out.append((path, container, t))
    return out


#: what holds a buffer that requires grad (`unregistered`)
BUFFER = "a buffer (register_buffer), not an nn.Parameter"


def _held(path: str, value: Any) -> Iterator[tuple[str, torch.Tensor, str]]:
    """The grad-requiring tensors an attribute value holds, with their paths and a description of the holder."""
    if isinstance(value, torch.Tensor):
        yield path, value, "a plain tensor attribute (not an nn.Parameter)"
        return
    if isinstance(value, dict):
        items = [(f"{path}[{k!r}]", v) for k, v in value.items()]
        kind = "dict"
    elif isinstance(value, (list, tuple)):
        items = [(f"{path}[{i}]", v) for i, v in enumerate(value)]
        kind = type(value).__name__ if type(value) in (list, tuple) else "sequence"
    else:
        return
    if not items or len(items) > 10_000:
        return
    classes = [type(v).__name__ for _, v in items if isinstance(v, (nn.Module, torch.Tensor))]
    if not classes:
        return
    names = sorted(set(classes))
    container = f"a Python {kind} of {len(classes)} {'/'.join(names)}"
    for item_path, v in items:
        if isinstance(v, nn.Module):
            for pname, p in v.named_parameters():
                yield f"{item_path}.{pname}", p, container
        elif isinstance(v, torch.Tensor):
            yield item_path, v, container


#: steps of other optimizers after which the pass watch gives up waiting for its own (hooks cost a call each)
MAX_OTHER_STEPS = 16


@dataclass(frozen=True)
class ClearedPasses:
    """The first optimizer step of a run took `passes` backward() passes (gradient accumulation) and the
    gradients were cleared before `cleared` of the later ones: only the last pass's gradient reached step().
    `site`: the user's backward() line; `step`: the optimizer step (0-based, of the run)."""

    passes: int
    cleared: int
    site: Site | None
    step: int


class PassWatch:
    """Watches the backward() passes up to the first optimizer step gradlog sees (its own `optimizer`): a
    post-accumulate-grad hook on each trainable tensor marks a pass; a forward pre-hook of every module finds
    whether the tensors the last pass wrote have lost their gradient since (``zero_grad()``: None, or zeros for
    one tensor under ``set_to_none=False``). A step of another optimizer in between (a GAN's other half
    consumed what its backward wrote into these tensors) starts the count again. At that first step, every pass
    but the last cleared is the accumulation bug (`result`); the hooks go at the next `close()` (the logger's
    next log()). A healthy run pays one hook call per tensor and pass, and one check per forward, for one
    optimizer step."""

    def __init__(self, optimizer: torch.optim.Optimizer, steps: int) -> None:
        self._optimizer = weakref.ref(optimizer)
        self._steps = steps
        # weakly, and only until the first step (`release`): a parameter the loop replaces, or a model that is
        # gone, must be freed (test_nothing_lost)
        self._params = {id(p): weakref.ref(p) for g in optimizer.param_groups for p in g["params"]}
        self._written: dict[int, int] = {}  # tensors the pass since the last forward wrote -> their _version then
        self.passes = 0
        self.cleared = 0
        self.site: Site | None = None
        self.result: ClearedPasses | None = None
        self._others = 0  # steps of other optimizers seen before its own
        self.done = False  # the first step came (or the watch failed): the hooks do nothing and go at `close()`
        # The two global hooks stay until `close()` (inert after the first step): removing one mid-run changed
        # what a compiled optimizer.step() or model had been compiled against, and it compiled again (a compiled
        # step: 10 frames against 8 without gradlog). The step hook is untraced, as gradlog's own; the forward
        # hook returns at once while dynamo traces it (an untraced one breaks a fullgraph=True model's graph).
        untraced: Callable[[Callable[..., Any]], Any] = torch.compiler.disable  # untyped in torch
        self._global: list[RemovableHandle] = [  # any module's forward: a loop may call the model's parts
            register_module_forward_pre_hook(self._forward),
            register_optimizer_step_pre_hook(untraced(self._stepping)),
        ]
        self._handles: list[RemovableHandle] = []
        try:
            for pid, ref in self._params.items():
                p = ref()
                if p is not None and p.requires_grad and p.is_leaf:
                    self._handles.append(p.register_post_accumulate_grad_hook(untraced(self._wrote(pid))))
            p = None
        except Exception:  # a tensor that takes no hook: no watch, and nothing left behind
            self.close()
            raise

    def _wrote(self, pid: int) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            if self.done:
                return
            if not self._written:
                self.site = user_site()
            self._written[pid] = p._version

        return hook

    def _pass_ended(self) -> None:
        """A pass wrote since the last check: count it, and whether its gradients are gone now. Weights written
        in place since (SAM's perturbation, a hand-written update) used that gradient: the count starts again."""
        if not self._written:
            return
        refs = [(self._params[pid](), version) for pid, version in self._written.items() if pid in self._params]
        held = [(p, version) for p, version in refs if p is not None]
        self._written = {}
        if not held:
            return
        if any(p._version != version for p, version in held):
            self.passes = self.cleared = 0
            return
        self.passes += 1
        first = held[0][0].grad
        if all(p.grad is None for p, _ in held) or (first is not None and not first.is_sparse and not first.any()):
            self.cleared += 1

    def _forward(self, module: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling() or self.done:  # traced into a compiled graph: nothing
            return
        try:
            self._pass_ended()
        except Exception:  # advice: a gradient it cannot read ends the watch
            self.done = True

    def _stepping(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        if self.done:
            return
        if optimizer is not self._optimizer():
            self.passes = self.cleared = 0  # another optimizer consumed the passes so far
            self._written = {}
            self._others += 1
            self.done = self._others >= MAX_OTHER_STEPS  # its own never steps (a loop that replaced it)
            return
        self.done = True  # the hooks go at the next `close()`: torch is iterating over this one's dict now
        try:
            self._pass_ended()
        except Exception:  # advice: a gradient it cannot read says nothing
            return
        if self.passes >= 2 and self.cleared == self.passes - 1:
            self.result = ClearedPasses(self.passes, self.cleared, self.site, self._steps)

    @property
    def hooked(self) -> bool:
        return bool(self._handles)

    def release(self) -> None:
        """Remove the per-tensor hooks (never from inside one of them: torch iterates over the hooks' dicts); the
        two global ones stay, inert, until `close()`."""
        self.done = True
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._params.clear()
        self._written = {}

    def close(self) -> None:
        """Remove every hook."""
        self.release()
        for h in self._global:
            h.remove()
        self._global.clear()


@dataclass(frozen=True)
class PaddingUse:
    """How the first batch used an embedding's padding_idx: its share of the ids, and in how many of the
    sequences (rows of 2-D or deeper ids) it sat between other ids, where padding never sits."""

    padding_idx: int
    share: float
    inside: int  # sequences with the padding id between two other ids
    rows: int


def padding_use(ids: Any, padding_idx: int) -> PaddingUse | None:
    """`PaddingUse` of one batch of ids; None for ids it cannot read (floats, an empty batch, one sequence)."""
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.dim() < 2 or not ids.numel():
        return None
    with torch.no_grad():
        rows = ids.reshape(-1, ids.shape[-1])
        pad = rows == padding_idx
        pos = torch.arange(rows.shape[1], device=rows.device).expand_as(rows)
        big = rows.shape[1]
        first = torch.where(~pad, pos, big).min(1).values.unsqueeze(1)
        last = torch.where(~pad, pos, -1).max(1).values.unsqueeze(1)
        inside = int((pad & (pos > first) & (pos < last)).any(1).sum())
        return PaddingUse(padding_idx, float(pad.float().mean()), inside, rows.shape[0])


class PaddingWatch:
    """The first forward of each embedding of the model with a padding_idx: how its batch used that id
    (`found`, by module name). Its row never learns by design, which is right for padding and wrong for a
    real token: padding sits at a sequence's start or end, a token between others is a real one. One forward
    pre-hook per such embedding: it looks at the first call and returns at once after it (removed at close)."""

    def __init__(self, model: nn.Module) -> None:
        self.found: dict[str, PaddingUse] = {}
        self._seen: set[str] = set()  # embeddings whose first forward was looked at
        self._handles: dict[str, RemovableHandle] = {}
        for name, m in model.named_modules():
            pad = getattr(m, "padding_idx", None)
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and isinstance(pad, int):
                self._handles[name] = m.register_forward_pre_hook(self._first(name, pad))

    def _first(self, name: str, pad: int) -> Callable[[nn.Module, Any], None]:
        def hook(module: nn.Module, args: Any) -> None:
            # traced into a compiled model: nothing (and the hook stays until close(): removing it changed what
            # the model was compiled against, and it compiled again)
            if torch.compiler.is_compiling() or name in self.found or name in self._seen:
                return
            self._seen.add(name)
            try:
                use = padding_use(args[0] if args else None, pad)  # torch keeps it >= 0 (a negative one counted)
            except Exception:  # advice: ids it cannot read say nothing
                return
            if use is not None:
                self.found[name] = use

        return hook

    def close(self) -> None:
        for handle in self._handles.values():
            handle.remove()
        self._handles.clear()
