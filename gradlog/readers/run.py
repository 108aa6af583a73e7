"""Read a finished (or crashed) gradlog run back from disk.

TensorBoard: a log dir or one event file, read by gradlog's own record reader (`runformat.tfevents`):
each file opened once, a corrupt record skipped (reading resumes at the next intact one) and named.

W&B: an offline run dir (or the `.wandb` file in it), or the folder holding every segment of a resumed
run, through `runformat.wandb_run`.

The run folder may come from someone else: every file goes through `runformat.files` (regular files inside
the folder only, size caps), and a bad row or value is skipped and named in `RunData.skipped`, never fatal.

The result is backend-neutral `RunData`: the same shape `MemoryWriter` keeps in memory.
"""

from __future__ import annotations

import os
import stat

from gradlog.runformat.files import (
    Limits,
    Refused,
    find_files,
    open_regular,
    real_root,
    shown,
)
from gradlog.runformat.markdown import parse_markdown_table
from gradlog.runformat.rundata import GRADLOG_PREFIXES, BadRun, RunData, model_order, settle_provisional
from gradlog.runformat.tb_run import is_event_file, read_event_files, run_key
from gradlog.runformat.wandb_run import groups, read_run_files
from gradlog.verdict.tables import closed_report

#: What readers of a run import from here: the run format's own types and codecs, and `load`.
__all__ = [
    "BadRun",
    "RunData",
    "closed_report",
    "load",
    "model_order",
    "parse_markdown_table",
]
#: At most this many "Skipped (unreadable)" lines are kept; the last one counts the rest.
MAX_SKIPPED_LINES = 200


def load(path: str, *, limits: Limits | None = None) -> RunData:
    """Read the run at `path`: a TensorBoard log dir or event file, or a W&B offline run dir or `.wandb` file.

    Only regular files inside `path` (symlinks resolved) are opened, within `limits` (`runformat.files.Limits`).
    """
    limits = limits if limits is not None else Limits()
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise BadRun(
            f"{path!r} does not exist; pass a TensorBoard log dir, an event file or a W&B offline run dir"
        ) from None
    except OSError as exc:
        raise BadRun(f"{path!r} cannot be read ({exc.strerror or exc})") from None
    try:
        kind, target, root, files = _detect(path, st, limits)
        if kind == "tensorboard":
            _one_run(target, [os.path.basename(f) for f in files])
            run = read_event_files(target, root, files, limits)
        else:
            run = read_run_files(files, root, limits)
        run = settle_provisional(run)
    except Refused as exc:
        raise BadRun(str(exc)) from None
    if not run.has_gradlog_data():
        what = ", ".join(sorted(run.scalars)[:5]) or "no scalars"
        skipped = f"; skipped: {'; '.join(run.skipped[:5])}" if run.skipped else ""
        raise BadRun(
            f"{path!r} holds no gradlog data (found {what}{skipped}); "
            "pass the log dir a GradLogger wrote (log_dir=...) or its W&B offline run dir"
        )
    if len(run.skipped) > MAX_SKIPPED_LINES:
        extra = len(run.skipped) - MAX_SKIPPED_LINES + 1
        run.skipped[MAX_SKIPPED_LINES - 1 :] = [f"... and {extra} more unreadable parts ({len(run.skipped)} in all)"]
    return run


def _is_candidate(name: str) -> bool:
    return is_event_file(name) or name.endswith(".wandb")


_PROBE_BYTES = 1 << 16


def _looks_like_gradlog(run_dir: str, candidates: list[str], limits: Limits) -> bool:
    """Whether a folder's own event files hold gradlog tags, from their first 64 KB (tags are plain bytes)."""
    for full in candidates:
        if os.path.dirname(full) != run_dir or not is_event_file(os.path.basename(full)):
            continue
        try:
            with open_regular(full, run_dir, max_bytes=limits.max_file_bytes, what="event file") as f:
                head = f.read(_PROBE_BYTES)
        except (OSError, Refused):
            continue
        if any(p.encode() in head for p in GRADLOG_PREFIXES):
            return True
    return False


def _detect(path: str, st: os.stat_result, limits: Limits) -> tuple[str, str, str, list[str]]:
    """(kind, target, root, files): ('tensorboard', log dir or event file, ...) or ('wandb', .wandb file, ...).

    `root` is the resolved folder every file read must stay inside: `path` itself, or a file's folder;
    `files` are the files to read, each once.
    """
    if not stat.S_ISDIR(st.st_mode):
        real = os.path.realpath(path)
        root = os.path.dirname(real)
        if not stat.S_ISREG(st.st_mode):
            raise BadRun(f"{path!r} is not a regular file or a folder; pass a run folder or an event file")
        if is_event_file(os.path.basename(path)) or is_event_file(os.path.basename(real)):
            return "tensorboard", real, root, [real]
        if path.endswith(".wandb") or real.endswith(".wandb"):
            return "wandb", real, root, [real]
        raise BadRun(
            f"{path!r} is neither a TensorBoard event file (events.out.tfevents.*) nor a W&B run file (*.wandb)"
        )
    root = real_root(path)
    notes: list[str] = []
    candidates = find_files(root, _is_candidate, limits, notes)
    tb_runs = sorted({os.path.dirname(f) for f in candidates if is_event_file(os.path.basename(f))})
    # Lightning writes its own event files in lightning_logs/version_N/ and the callback's run in its
    # gradlog/ subfolder: other programs' runs do not count when gradlog's are there.
    ours = [r for r in tb_runs if _looks_like_gradlog(r, candidates, limits)]
    if root in tb_runs and (len(tb_runs) == 1 or root in ours):  # event files right here: this is the run
        tb_runs = [root]
    else:
        tb_runs = ours or tb_runs
    wandb_runs = groups([f for f in candidates if f.endswith(".wandb")])
    runs = [("tensorboard", r) for r in tb_runs] + [("wandb", group[-1]) for group in wandb_runs.values()]
    if root in tb_runs or len(runs) == 1:
        kind, target = runs[0]
        if kind == "wandb":  # every segment of a resumed W&B run: one logical run
            return kind, target, root, next(g for g in wandb_runs.values() if g[-1] == target)
        here = [f for f in candidates if os.path.dirname(f) == target and is_event_file(os.path.basename(f))]
        return kind, target, root, here
    if not runs:
        unlisted = f" ({'; '.join(notes[:3])})" if notes else ""
        raise BadRun(
            f"{path!r} holds no TensorBoard event file and no W&B offline run{unlisted}; "
            "pass the log dir a GradLogger wrote (log_dir=...) or a wandb/offline-run-* dir"
        )
    # one escaped line per run: a folder name holding a line break cannot fake a line of the message
    listed = "\n  ".join(shown(r if kind == "tensorboard" else os.path.dirname(r)) for kind, r in runs[:20])
    more = f"\n  ... and {len(runs) - 20} more" if len(runs) > 20 else ""
    raise BadRun(f"{path!r} holds {len(runs)} runs; pass one of them:\n  {listed}{more}")


def _one_run(path: str, event_files: list[str]) -> None:
    """Two GradLoggers that wrote into one folder are two runs: list them instead of merging them."""
    runs: dict[str, list[str]] = {}
    for name in event_files:
        runs.setdefault(run_key(name), []).append(name)
    if len([k for k in runs if k]) < 2:  # files of other writers (no mark) alone do not make a second run
        return
    listed = "\n  ".join(
        f"{key or 'other writers'}: "
        + ", ".join(os.path.join(path, n) for n in files[:3])
        + (f" (+{len(files) - 3} more)" if len(files) > 3 else "")
        for key, files in sorted(runs.items())
    )
    raise BadRun(
        f"{path!r} holds {len(runs)} runs written into the same folder (one per GradLogger); "
        f"pass one event file of the run you want:\n  {listed}"
    )
