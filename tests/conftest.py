from __future__ import annotations

import os

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

    for gl in list(gradlog.lifecycle.ACTIVE):
        gl.print_report = False
        try:
            gl.close()
        except Exception:
            pass  # a strict-mode test's writer may raise again here
