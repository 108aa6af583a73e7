"""`gradlog diff A B [C ...]`: compare checkpoints of one model; exit 0 (all learned), 1 (findings), 2 (bad input).

Kept apart from `cli.entry` so the argument parser stays importable without safetensors or matplotlib.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

from gradlog.cli.paths import plot_target
from gradlog.cli.report import _plain
from gradlog.compare.checkpoints import CannotCompare, Progress, diff, open_all
from gradlog.readers.checkpoints import BadCheckpoint
from gradlog.verdict.policy import Policy
from gradlog.views.diff_plot import plot

OK, FINDINGS, BAD_INPUT = 0, 1, 2


def _fail(message: str) -> int:
    print(f"gradlog diff: {message}", file=sys.stderr)
    return BAD_INPUT


def run_diff(
    paths: Sequence[str],
    as_json: bool = False,
    plot_to: str | None = None,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
    progress: bool | None = None,
    rules: Sequence[tuple[str, str]] = (),
) -> int:
    """Never raises: unreadable input, different models or a missing extra is a message on stderr and exit 2.
    `rules` are ("KIND[:PATTERN]", severity) pairs (--fail-on, --warn, --note, --ignore)."""
    try:
        policy = Policy(rules)
    except ValueError as exc:
        return _fail(str(exc))
    if len(paths) < 2:
        return _fail(f"needs two or more checkpoints of one model, in training order; got {len(paths)}")
    try:
        plot_to = plot_target(plot_to) if plot_to else None
    except ValueError as exc:
        return _fail(str(exc))
    bar: Progress | None = None
    try:
        checkpoints = open_all(paths)
        bar = Progress(0, force=progress)  # diff() tells it the size of what it compares
        result = diff(
            checkpoints,
            include=list(include) if include else None,
            exclude=list(exclude) if exclude else None,
            progress=bar,
            policy=policy,
        )
    except (BadCheckpoint, CannotCompare, ValueError) as exc:
        return _fail(str(exc))
    except MemoryError:
        return _fail("ran out of memory reading a tensor (gradlog holds two values of one tensor at a time)")
    except Exception as exc:  # a file we could not make sense of: a message, never a traceback
        return _fail(f"cannot compare {list(paths)!r} ({type(exc).__name__}: {exc})")
    finally:
        if bar is not None:
            bar.close()
    if as_json:
        print(json.dumps(_plain(result.to_dict()), indent=2, allow_nan=False, default=str))
    else:
        print(result.text())
    if plot_to:
        try:
            plot(result, plot_to)
        except ImportError as exc:
            return _fail(str(exc))
        except Exception as exc:
            return _fail(f"cannot write the plot to {plot_to!r} ({type(exc).__name__}: {exc})")
        print(f"plot written to {plot_to}", file=sys.stderr)
    return OK if result.healthy else FINDINGS
