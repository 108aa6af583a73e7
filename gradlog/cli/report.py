"""`gradlog report PATH`: read a run back, print its health, exit 0 (healthy), 1 (problems) or 2 (bad input).

A file that is only partly readable (torn or corrupt event file) still gets the report of what could be
read, followed by exit 2; a run that never closed (no never-updated table) exits 1.

Everything printed may hold text from someone else's run files: the console output escapes control and
escape characters (`runformat.files.shown`), and `--json` is strict JSON (no NaN, no lone surrogates).

Kept apart from `cli.entry` so the argument parser stays importable without tensorboard or matplotlib.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from typing import TextIO

from gradlog.cli.paths import plot_target
from gradlog.readers.run import BadRun, load
from gradlog.runformat.cells import bare_name
from gradlog.runformat.files import Limits, shown_lines, valid_text
from gradlog.verdict.alerts import DEFAULT_RATIO_BAND, check_band
from gradlog.verdict.policy import Policy
from gradlog.views.health import DEFAULT_SPIKE_FACTOR, analyze

OK, PROBLEMS, BAD_INPUT = 0, 1, 2


def _write(text: str, stream: TextIO) -> None:
    """Print `text` with anything non-printable escaped; characters the stream cannot encode as `\\u....`."""
    text = shown_lines(text) + "\n"
    try:
        stream.write(text)
    except UnicodeEncodeError:
        encoding = getattr(stream, "encoding", None) or "ascii"
        stream.write(text.encode(encoding, "backslashreplace").decode(encoding, "replace"))
    stream.flush()


def _fail(message: str) -> int:
    _write(f"gradlog report: {message}", sys.stderr)
    return BAD_INPUT


def _plain(obj: object) -> object:
    """JSON has no NaN/Inf: write them as null; lone surrogates become U+FFFD: any JSON parser reads the report."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, str):
        return valid_text(obj)
    if isinstance(obj, dict):
        return {valid_text(str(k)): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


def run_report(
    path: str,
    as_json: bool = False,
    plot: str | None = None,
    band: Sequence[float] | None = None,
    spike: float | None = None,
    limits: Limits | None = None,
    rules: Sequence[tuple[str, str]] = (),
) -> int:
    """Never raises: bad input, an unreadable file or a missing extra is a message on stderr and exit 2.

    `limits` caps what reading the run may cost (`runformat.files.Limits`: file and table sizes, files searched).
    `rules` are ("KIND[:PATTERN]", severity) pairs (--fail-on, --warn, --note, --ignore): they override the
    policy the run recorded.
    """
    try:
        override = Policy(rules)
    except ValueError as exc:
        return _fail(str(exc))
    try:
        lo_hi = check_band(band if band is not None else DEFAULT_RATIO_BAND)
    except ValueError as exc:
        return _fail(str(exc).replace("ratio_band", "--band LO HI"))
    factor = DEFAULT_SPIKE_FACTOR if spike is None else float(spike)
    if not factor > 1:
        why = "a gradient norm at least this many times its running median"
        return _fail(f"--spike must be a factor > 1 ({why}), got {spike}")
    try:
        plot = plot_target(plot) if plot else None
    except ValueError as exc:
        return _fail(str(exc))
    try:
        run = load(path, limits=limits)
        # Without --band/--spike: the warnings the run recorded at close (what close() said)
        health = analyze(run, None if band is None else lo_hi, None if spike is None else factor, policy=override)
    except BadRun as exc:
        return _fail(str(exc))
    except Exception as exc:  # a file we could not make sense of: a message, never a traceback
        return _fail(f"cannot read {path!r} ({type(exc).__name__}: {exc})")
    if as_json:
        _write(json.dumps(_plain(health.to_dict()), indent=2, allow_nan=False, default=str), sys.stdout)
    else:
        _write(health.text(), sys.stdout)
    if plot:
        try:
            from gradlog.views import plot as plotting

            first = health.first_nonfinite
            never = {bare_name(r.name): r.reason for r in health.never_updated}
            plotting.save(
                plot,
                run.scalars,
                never,
                band=lo_hi,
                title=f"gradlog: {path}",
                first_nonfinite=None if first is None else (first.step, first.tensor),
            )
        except ImportError as exc:
            return _fail(str(exc))
        except Exception as exc:
            return _fail(f"cannot write the plot to {plot!r} ({type(exc).__name__}: {exc})")
        _write(f"plot written to {plot}", sys.stderr)
    if health.skipped:  # a partial report: say so, and let scripts tell it from a clean read
        n = len(health.skipped)
        return _fail(f"{n} unreadable part{'' if n == 1 else 's'} of {path!r} skipped; the report above is partial")
    return OK if health.healthy else PROBLEMS
