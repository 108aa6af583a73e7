"""README's promises: the Quickstart runs as written, and the demo needs only the tensorboard extra."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _quickstart() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Quickstart") :]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None, "README's Quickstart has no python block"
    return match.group(1)


def test_quickstart_runs_as_written(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-c", _quickstart()], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert "gradlog OK" in out.stdout and "True gradlog OK" in out.stdout
    assert "[(0, " in out.stdout and "(90, " in out.stdout  # the MemoryWriter's series, read back


BLOCKER = """
import sys, importlib.abc
EXTRAS = ("wandb", "matplotlib", "transformers", "lightning", "pytorch_lightning", "accelerate", "peft")
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in EXTRAS:
            raise ImportError(f"{name} is not installed (only the tensorboard extra is)")
        return None
sys.meta_path.insert(0, Block())
from gradlog.cli.entry import main
sys.exit(main(["demo", "--steps", "30", "--every", "5"]))  # bug 1, a freeze at step 10, needs 3 quiet measured steps
"""


def test_demo_needs_only_the_tensorboard_extra(tmp_path: Path) -> None:
    """README's first command installs torch and '.[tensorboard]' only: the demo must not import anything else."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-c", BLOCKER], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert "TensorBoard event files in runs" in out.stdout and "tensorboard --logdir runs" in out.stdout
    assert "frozen.weight" in out.stdout
    # README says what the console shows in the order it shows it: where the files went first, the verdict last
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("gradlog PROBLEM: ") and "(30 optimizer steps, 6 measured" in last
    # bug 1: the freeze at step 10 (a third of 30) is a stalled finding from step 10, not a note
    assert "stopped learning (zero_lr 2, frozen 1), the first from step 10 " in last
    console = re.search(r"\*\*The console\.\*\*.*?```text\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert console is not None
    shown = console.group(1).strip().splitlines()
    assert shown[0].startswith("gradlog: TensorBoard event files in ") and shown[-1].startswith("gradlog PROBLEM: ")
    assert "pip install torch==2.13.0 -e '.[tensorboard]' && .venv/bin/gradlog demo" in (ROOT / "README.md").read_text()


def test_readme_and_demo_help_count_the_same_planted_bugs() -> None:
    """`gradlog demo --help` said three planted bugs, README five (issue 41): both from `PLANTED` now."""
    from gradlog.cli.planted import PLANTED, planted_summary

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-m", "gradlog", "demo", "--help"], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and planted_summary() in " ".join(out.stdout.split())
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"with {planted_summary()} (" in readme and planted_summary() == "five planted bugs"
    assert all(bug in readme for bug in PLANTED)
