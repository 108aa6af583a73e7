"""The package's folders are the stages of the data flow; a lower stage never imports a higher one.

Every `import` in every module is read with `ast` (imports inside functions included, since a lazy
import is still a dependency), and checked against the stages each folder may use.
"""

from __future__ import annotations

import ast
from pathlib import Path

import gradlog

PACKAGE = Path(gradlog.__file__).parent

#: stage -> the stages its modules may import (itself included). "api" is the package's top level.
ALLOWED: dict[str, set[str]] = {
    "measure": {"measure"},
    "writers": {"writers", "measure"},
    "verdict": {"verdict", "measure"},
    "api": {"api", "measure", "verdict", "writers"},
    "readers": {"readers", "verdict", "measure"},
    "compare": {"compare", "readers", "verdict", "measure"},
    "views": {"views", "compare", "readers", "verdict", "measure"},
    "integrations": {"integrations", "api", "verdict", "measure", "writers"},
    "cli": {"cli", "views", "compare", "readers", "api", "verdict", "measure", "writers"},
}
#: (file, module) -> why: the one upward import allowed. A resumed run reads the earlier segment's tables back
#: once, at GradLogger() before training starts, and only with Output(resume=...) (docs/resume.md).
EXCEPTIONS: dict[tuple[str, str], str] = {
    ("gradlog/resume.py", "gradlog.readers.run"): "Output(resume=...): the earlier segment, read once at start",
}
#: what runs inside the user's training loop: it must never pull in what runs after the run.
TRAINING_LOOP = {"api", "measure", "verdict", "writers"}


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
