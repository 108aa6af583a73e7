"""The end of a run that does not reach `close()`: interpreter exit, SIGTERM, a fork, a model gone.

The open loggers are kept in `ACTIVE`; everything here talks to them through the small `Closable`
protocol (`close`, `on_sigterm`, `after_fork`), never through their private state.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import os
import signal
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch

from gradlog.measure import once
from gradlog.measure.distributed import DistributedMismatchError

if TYPE_CHECKING:
    from gradlog.verdict.report import Report

logger = logging.getLogger("gradlog")
logger.addHandler(logging.NullHandler())

__all__ = [
    "ACTIVE",
    "Closable",
    "LogCall",
    "caller",
    "clip_grad_norm_",
    "close",
    "describe",
    "end_on_sigterm",
    "log",
    "register",
    "replace_earlier",
    "set_aside",
    "unregister",
    "warn",
]

#: Seconds a collective at close may wait for the other ranks when a signal is ending the run.
SIGNAL_SYNC_TIMEOUT_S = 10.0


class Closable(Protocol):
    handle_signals: bool

    def close(self) -> object: ...

    def on_sigterm(self, ending: bool) -> None: ...

    def after_fork(self) -> None: ...


#: The open loggers, in the order they were made (`gradlog.log()` and `gradlog.close()` drive them all).
ACTIVE: list[Any] = []


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def warn(msg: str) -> None:
    """Trouble inside gradlog, pointing at the user's code (gradlog.measure.once)."""
    once.warn(msg, stacklevel=4)


#: the package's folder (`gradlog/`, above this one): frames in it are gradlog's own
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ours(frame: Any) -> bool:
    return bool(os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE + os.sep))


def caller() -> str:
    """The "file:line" of the first frame outside gradlog: where the user (or a framework) made the logger."""
    frame = sys._getframe(1)
    while frame is not None:
        if not _ours(frame):
            return f"{frame.f_code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return "<unknown>"


def warn_caller(msg: str) -> None:
    """`warn`, pointing at the first frame outside gradlog (the user's line that made the logger), however many
    of gradlog's frames lie between (the constructor's keyword check wraps `GradLogger.__init__`)."""
    frame, level = sys._getframe(1), 2  # `once.warn`'s stacklevel of this function's caller
    while frame.f_back is not None and _ours(frame):
        frame, level = frame.f_back, level + 1
    once.warn(msg, stacklevel=level)


def replace_earlier(gl: Any, model: object, optimizer: object) -> None:
    """A second logger on the same model and optimizer (a notebook cell run again) replaces the open one:
    two would both hook the same steps and write the same run twice. The earlier one is closed (its tables
    written, its report not printed) and named once, with where it was made."""
    for old in list(ACTIVE):
        if old is gl or id(old) in _SET_ASIDE or old.model is not model or old.optimizer is not optimizer:
            continue
        old.print_report = False
        try:
            old.close()
        except Exception as exc:  # closing the old run must not stop the new one
            logger.warning("gradlog: closing the replaced logger failed: %s", describe(exc))
            unregister(old)
        warn_caller(
            f"gradlog: a GradLogger on this model and optimizer was already open (made at {old.made_at}); "
            "it is closed and this one replaces it, so each step is measured once. Call close() on the old "
            "one first to keep this quiet"
        )


#: ids of the open loggers `set_aside` holds: not replaced, and their hooks do nothing meanwhile
_SET_ASIDE: set[int] = set()


@contextlib.contextmanager
def set_aside(model: object, optimizer: object) -> Iterator[None]:
    """`gradlog.check` while the user's logger on this model or optimizer is open: that logger neither
    counts nor measures the check's steps (its hooks do nothing: its pipeline is inert meanwhile) and the
    check's own logger does not replace it; both as before once the block ends (issue 41: a check closed
    the open logger, and the user's next `gl.log` raised)."""
    aside = [gl for gl in ACTIVE if gl.model is model or gl.optimizer is optimizer]
    inert = [gl.pipeline.inert for gl in aside]
    for gl in aside:
        _SET_ASIDE.add(id(gl))
        gl.pipeline.inert = True
    try:
        yield
    finally:
        for gl, was in zip(aside, inert):
            gl.pipeline.inert = was
            _SET_ASIDE.discard(id(gl))


class Registration:
    """What `register` set up for one logger: its atexit hook and the model's finalizer."""

    def __init__(self, gl: Closable, model: object) -> None:
        ref = weakref.ref(gl)
        self.atexit: Callable[[], None] = lambda: _close_ref(ref)
        atexit.register(self.atexit)
        # the model garbage-collected: nothing more can be measured, so the run is over
        self.model_gone = weakref.finalize(model, _close_gone, ref)
        self.model_gone.atexit = False  # interpreter exit is the atexit hook's job
        self.gone = False  # set when the model was garbage-collected (close then runs without collectives)

    def detach(self) -> None:
        self.model_gone.detach()
        atexit.unregister(self.atexit)


def register(gl: Closable, model: object) -> Registration:
    """Make `gl` one of the open loggers: closed at interpreter exit, on SIGTERM and when `model` is freed."""
    ACTIVE.append(gl)
    registration = Registration(gl, model)
    _registrations[id(gl)] = registration
    if gl.handle_signals:
        _install_sigterm()
    return registration


def unregister(gl: Closable) -> None:
    """`gl` closed: gone from every registry; the SIGTERM handler goes when no logger needs it."""
    if gl in ACTIVE:
        ACTIVE.remove(gl)
    registration = _registrations.pop(id(gl), None)
    if registration is not None:
        registration.detach()
    if not any(other.handle_signals for other in ACTIVE):
        _restore_sigterm()


_registrations: dict[int, Registration] = {}


# --- SIGTERM (torchrun, SLURM, Kubernetes, `kill`): atexit does not run, so gradlog closes here --------
class _Sigterm:
    installed = False
    previous: Any = None
    handling = False
    busy = 0  # log() calls in progress on the main thread
    deferred: int | None = None  # a SIGTERM that arrived during one: handled when it returns


class LogCall:
    """Around `log()`: a SIGTERM arriving meanwhile waits until the call is done (it may hold a writer
    queue's lock), then is handled."""

    def __enter__(self) -> None:
        self.main = threading.get_ident() == threading.main_thread().ident
        _Sigterm.busy += self.main

    def __exit__(self, *exc: object) -> None:
        _Sigterm.busy -= self.main
        if self.main and _Sigterm.deferred is not None and not _Sigterm.busy:
            signum, _Sigterm.deferred = _Sigterm.deferred, None
            on_sigterm(signum, None)


def _install_sigterm() -> None:
    """Once, from the main thread, when nobody else handles SIGTERM from C (a Python handler is chained)."""
    if threading.current_thread() is not threading.main_thread():
        return
    try:
        previous = signal.getsignal(signal.SIGTERM)
        if previous is on_sigterm:  # already ours (another logger, a forked child): nothing new to chain
            _Sigterm.installed = True
            return
        if previous is None or previous is signal.SIG_IGN:  # a C-level handler, or deliberately ignored
            return
        signal.signal(signal.SIGTERM, on_sigterm)
    except (ValueError, OSError):  # not the main interpreter, or no SIGTERM on this platform
        return
    _Sigterm.previous = previous
    _Sigterm.installed = True


def _restore_sigterm() -> None:
    """No logger left to close: put the previous handler back (if ours is still the one installed)."""
    if not _Sigterm.installed or threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signal.SIGTERM) is on_sigterm:
            signal.signal(signal.SIGTERM, _Sigterm.previous)
    except (ValueError, OSError):
        return
    _Sigterm.installed = False


def on_sigterm(signum: int, frame: Any) -> None:
    """Write the final tables, then do what the signal would have done without gradlog."""
    if _Sigterm.handling:  # a second SIGTERM while the first is handled: that one is already ending the run
        return
    if _Sigterm.busy:  # inside log(): finish it first, then come back here
        _Sigterm.deferred = signum
        return
    previous = _Sigterm.previous
    _Sigterm.handling = True
    try:
        # a program that handles SIGTERM itself may go on: its loggers only write provisional tables
        ending = not callable(previous)
        for gl in list(ACTIVE):
            if gl.handle_signals:
                gl.on_sigterm(ending)
    except Exception as exc:  # the signal must still end the run
        logger.warning("gradlog: writing the tables on SIGTERM failed: %s", describe(exc))
    finally:
        _Sigterm.handling = False
    if callable(previous):
        previous(signum, frame)
        return
    _restore_sigterm()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGTERM)  # the exit status stays the signal's (-15, or 143 in a shell)


def end_on_sigterm(gl: Any, ending: bool) -> None:
    """SIGTERM for logger `gl`. `ending`: the process ends after this, so close, with bounded waits for
    other ranks (they may get the signal later, or never): if they do not join, the answer is this rank's
    own, written as provisional. Otherwise (the program handles SIGTERM itself and may go on) only the
    provisional tables are written."""
    if not ending:
        if gl.rank_zero:
            gl.write_provisional()
            gl.writers.flush()
            gl.writers.sync()
        return
    reducer = gl.meter.reducer
    if reducer is not None:
        reducer.timeout_s = min(reducer.timeout_s, SIGNAL_SYNC_TIMEOUT_S)
    try:
        gl.close()
    except DistributedMismatchError as exc:
        logger.warning("gradlog: ranks did not meet at close() after SIGTERM (%s); writing this rank's answer", exc)
        gl.meter.abandon()
        gl.write_provisional(exact=True)
        gl.writers.close()


def _after_fork_in_child() -> None:
    for gl in list(ACTIVE):
        registration = _registrations.pop(id(gl), None)
        if registration is not None:
            registration.detach()
        gl.after_fork()
    ACTIVE.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _close_gone(ref: weakref.ref[Any]) -> None:
    """The model was garbage-collected: close, at whatever point of the program that happened, so with no
    collective (other ranks are not there to meet it): under sharding the table is this rank's own."""
    gl = ref()
    if gl is not None:
        registration = _registrations.get(id(gl))
        if registration is not None:
            registration.gone = True
        _close_ref(ref)


def _close_ref(ref: weakref.ref[Any]) -> None:
    gl = ref()
    if gl is not None:
        try:
            gl.close()
        except Exception as exc:  # never turn interpreter exit into a traceback
            logger.warning("gradlog: closing at exit failed: %s", exc)


# --- the module-level API: every open logger ------------------------------------------------------
def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_`, same arguments and result, that also tells every open GradLogger.

    Clipping changes the gradients before the optimizer step, where gradlog reads them: without this,
    `weights/grad_norm/...` would read the clipped norms (pinned at max_norm), and a spike would go unseen.
    With it, the measured step reports the norms before clipping (per tensor and `gradlog/grad_norm_total`)
    and `gradlog/clip_coef`, computed from the clipped gradients and this total: no extra pass.
    """
    check_max_norm(max_norm)
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    total = torch.nn.utils.clip_grad_norm_(
        params, max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite, foreach=foreach
    )
    for gl in list(ACTIVE):
        gl.note_clip(params, total, max_norm)
    return total


def check_max_norm(max_norm: object) -> None:
    """torch takes any `max_norm`: a negative one multiplies every gradient by a negative factor (each update
    goes uphill) and NaN makes every gradient NaN, both silently. A number >= 0 is what a user means."""
    value = math.nan
    if isinstance(max_norm, (int, float)) or (isinstance(max_norm, torch.Tensor) and max_norm.numel() == 1):
        value = float(max_norm)
    if isinstance(max_norm, bool) or not value >= 0:
        raise ValueError(
            f"clip_grad_norm_(max_norm={max_norm!r}): must be a number >= 0, the largest total gradient norm to "
            "keep (e.g. 1.0); a negative one would flip every gradient's sign and NaN would make them NaN"
        )


def log(step: int | None = None) -> None:
    """Publish the latest measurement of every open GradLogger (see `GradLogger.log`)."""
    if not ACTIVE:
        raise RuntimeError("gradlog.log() needs an open logger: call gradlog.watch(model, optimizer) first")
    for gl in list(ACTIVE):
        gl.log(step)


def close() -> Report | None:
    """Close every open GradLogger; returns the last one's Report (None if none was open)."""
    report: Report | None = None
    for gl in list(ACTIVE):
        report = gl.close()
    return report
