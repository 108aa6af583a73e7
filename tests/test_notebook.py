"""notebooks/quickstart.ipynb runs clean from top to bottom, in a kernel on this very interpreter."""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "quickstart.ipynb"
KERNEL = "gradlog-test-python"


def _kernel_on_this_python(root: Path) -> None:
    """A kernelspec (first on JUPYTER_PATH) that starts ipykernel with sys.executable: no `ipykernel install`,
    and no chance of picking up some other `python3` kernel installed on the machine."""
    spec = root / "kernels" / KERNEL
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": KERNEL, "language": "python"}))


def test_repository_copy_has_outputs_stripped() -> None:
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, "the quickstart has no code cells"
    assert all(not c.outputs and c.execution_count is None for c in code)


@pytest.mark.slow
def test_quickstart_notebook_runs_top_to_bottom(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    _kernel_on_this_python(tmp_path / "jupyter")
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    # The kernel imports the gradlog this test imports (a worktree on PYTHONPATH, or the installed one).
    root = str(NOTEBOOK.parent.parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])]))
    # One torch thread in the kernel, as in the suite's other child processes: on a busy 2-core machine
    # torch's thread pool made the notebook's three small training loops 6x slower (113 s -> 23 s at load 11).
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    work = tmp_path / "cwd"
    work.mkdir()
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        nb, kernel_name=KERNEL, timeout=240, resources={"metadata": {"path": str(work)}}, allow_errors=False
    )
    client.execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    errors = [o for o in outputs if o.output_type == "error"]
    assert not errors
    # The plot cell really drew a picture, and the table cell really rendered the planted bugs.
    assert any("image/png" in o.get("data", {}) for o in outputs)
    text = "\n".join(str(o.get("data", {}).get("text/markdown", "")) + str(o.get("text", "")) for o in outputs)
    assert "head_aux.weight" in text and "late.weight" in text and "not_in_optimizer" in text
    # Alerts showed up while training (logging to stderr in the kernel).
    assert "gradlog alert" in text
    # issue 41: a first notebook reads runs back through the public API, shows no stray repr, leaves no folder
    sources = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert "gradlog.read_run(" in sources and not re.search(r"gradlog\.(cli|readers|views)\.", sources)
    shown = "\n".join(str(o.get("data", {}).get("text/plain", "")) for o in outputs)
    assert "Generator" not in shown
    assert not list(Path(tempfile.gettempdir()).glob("gradlog-quickstart-*"))
