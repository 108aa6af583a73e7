"""The package's folders are the stages of the data flow; a lower stage never imports a higher one.

Every `import` in every module is read with `ast` (imports inside functions included, since a lazy
import is still a dependency), and checked against the stages each folder may use.
"""

from __future__ import annotations

import ast
from pathlib import Path

import gradlog

PACKAGE = Path(gradlog.__file__).parent

#: The run format (`gradlog/runformat/`: names, cells, tags, markdown, event records, safe file reads, a run
#: read back) imports nothing else of gradlog: the bottom stage every other imports. The codecs between a
#: `Report` and its tables live beside the records, in `verdict` (`gradlog/verdict/tables.py`).
_BASE = {"runformat", "verdict", "measure"}
#: stage -> the stages its modules may import (itself included). "api" is the package's top level (its
#: `__init__.py`: the public names), "run" the logger and its parts (`gradlog/run/`), which wire the stages
#: below them into a training run.
ALLOWED: dict[str, set[str]] = {
    "runformat": {"runformat"},
    "measure": {"measure", "runformat"},
    "writers": {"writers", "measure", "runformat"},
    "verdict": {"verdict", "measure", "runformat"},
    "run": {"run", "writers", *_BASE},
    "api": {"api", "run", "writers", *_BASE},
    "readers": {"readers", *_BASE},
    "compare": {"compare", "readers", *_BASE},
    "views": {"views", "compare", "readers", *_BASE},
    "integrations": {"integrations", "api", "run", "writers", *_BASE},
    "cli": {"cli", "views", "compare", "readers", "api", "run", "writers", *_BASE},
}
#: (file, module) -> why: upward imports allowed (none: a resumed run reads its earlier segment through the
#: run format, not the readers).
EXCEPTIONS: dict[tuple[str, str], str] = {}
#: what runs inside the user's training loop: it must never pull in what runs after the run.
TRAINING_LOOP = {"api", "run", "measure", "verdict", "writers", "runformat"}


def _stage_of_module(dotted: str) -> str:
    parts = dotted.split(".")
    assert parts[0] == "gradlog", dotted
    if len(parts) > 1 and parts[1] in ALLOWED and parts[1] != "api":
        return parts[1]
    return "api"


def _stage_of_file(path: Path) -> str:
    rel = path.relative_to(PACKAGE).parts
    if rel[-1] == "__main__.py":
        return "cli"  # `python -m gradlog` is the command line
    return rel[0] if len(rel) > 1 else "api"


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, dotted module) for every gradlog import in the file."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "gradlog"]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}:{node.lineno}: use absolute imports"
            mod = node.module or ""
            if mod.split(".")[0] != "gradlog":
                continue
            if mod == "gradlog":  # `from gradlog import x`: x is a stage (folder) or a top-level name
                out += [(node.lineno, f"gradlog.{a.name}") for a in node.names]
            else:
                out.append((node.lineno, mod))
    return out


def _violations() -> list[str]:
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        stage = _stage_of_file(path)
        for line, mod in _imports(path):
            target = _stage_of_module(mod)
            if target not in ALLOWED[stage] and (str(path.relative_to(PACKAGE.parent)), mod) not in EXCEPTIONS:
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line} ({stage}) imports {mod} ({target})")
    return bad


def test_every_module_belongs_to_a_known_stage() -> None:
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and not p.name.startswith("__")}
    assert folders == set(ALLOWED) - {"api"}


def test_no_module_imports_a_higher_stage() -> None:
    assert _violations() == []


def test_the_training_loop_path_never_reaches_views_readers_cli_or_integrations() -> None:
    for stage in TRAINING_LOOP:
        assert ALLOWED[stage] <= TRAINING_LOOP, stage


def test_the_check_itself_catches_an_upward_import(tmp_path: Path) -> None:
    """The walker must see a lazy import inside a function, and `from gradlog import views`."""
    src = "def f():\n    from gradlog.views import health\n    from gradlog import cli\n"
    probe = tmp_path / "probe.py"
    probe.write_text(src)
    found = {_stage_of_module(m) for _, m in _imports(probe)}
    assert found == {"views", "cli"}
    assert not {"views", "cli"} & ALLOWED["measure"]


def test_every_stage_may_take_the_run_format_and_resume_reads_through_it() -> None:
    """Every stage takes its names from the run format: its bottom stage must stay at the bottom, and the
    resumed run's reading (run/resume.py) goes through it rather than through the readers."""
    assert all("runformat" in allowed for allowed in ALLOWED.values())
    resume = {m for _, m in _imports(PACKAGE / "run" / "resume.py")}
    assert not {_stage_of_module(m) for m in resume} & {"readers", "views", "cli", "compare", "integrations"}
    assert ALLOWED["runformat"] == {"runformat"}


def test_the_top_level_holds_only_the_entry_points() -> None:
    """The logger and its parts live in `gradlog/run/`; the top keeps the package's entry points only."""
    assert sorted(p.name for p in PACKAGE.glob("*.py")) == ["__init__.py", "__main__.py"]


def test_measuring_never_reaches_back_into_the_logger() -> None:
    """Within the run, data flows one way: the measured-step path and the diagnosis import neither the
    logger nor the resume that drive them."""
    drivers = {"gradlog.run.logger", "gradlog.run.resume", "gradlog.run.check"}
    for name in ("measuring.py", "diagnosing.py"):
        assert not {m for _, m in _imports(PACKAGE / "run" / name)} & drivers, name
