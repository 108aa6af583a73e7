from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")


@pytest.fixture(autouse=True)
def _run_in_tmp(tmp_path, monkeypatch):
    """The default writer creates runs/ in the working directory: keep the checkout clean."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(autouse=True)
def _close_loggers():
    """A test that fails mid-run must not leave hooks or atexit reports behind for the next one."""
    yield
    import gradlog

    for gl in list(gradlog.run.lifecycle.ACTIVE):
        gl.print_report = False
        try:
            gl.close()
        except Exception:
            pass  # a strict-mode test's writer may raise again here


@pytest.fixture
def wandb_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The real wandb package in offline mode, every file it writes kept under tmp_path."""
    wandb = pytest.importorskip("wandb")
    for var, sub in (("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data")):
        monkeypatch.setenv(var, str(tmp_path / sub))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    yield wandb
    if wandb.run is not None:  # a failed test must not leave a run for the next one to adopt
        wandb.run.finish()
