"""gradlog: which weights are learning, and which never did.

gl = gradlog.GradLogger(model, optimizer)        # or gradlog.watch(model, optimizer)
... optimizer.step(); gl.log(step) ...
report = gl.close()                               # the never-updated table

gradlog.check(model, optimizer, batch)            # one dry step before training, everything restored
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from gradlog.measure.distributed import DistributedMismatchError
from gradlog.measure.histogram import Histogram, Histograms
from gradlog.run.check import CheckReport, check
from gradlog.run.logger import GradLogger, clip_grad_norm_, close, log, watch
from gradlog.run.options import AlertOptions, HistogramOptions, Output
from gradlog.verdict.policy import Policy
from gradlog.verdict.report import (
    IdleExperts,
    NeverUpdated,
    NonFinite,
    PartlyUpdated,
    PrecisionLoss,
    Reason,
    Report,
    Stalled,
    StoppedSlice,
    WeightDecayWipe,
)
from gradlog.writers import REGISTRY as WRITERS
from gradlog.writers import MemoryWriter, Writer
from gradlog.writers.tensorboard import TensorBoardWriter  # imports tensorboard only when constructed

if TYPE_CHECKING:  # for type checkers and IDEs only; at run time see __getattr__ below
    from gradlog.writers.wandb import WandbWriter

__version__ = "0.1.0"

__all__ = [
    "WRITERS",
    "AlertOptions",
    "CheckReport",
    "DistributedMismatchError",
    "GradLogger",
    "Histogram",
    "HistogramOptions",
    "Histograms",
    "IdleExperts",
    "MemoryWriter",
    "NeverUpdated",
    "NonFinite",
    "Output",
    "PartlyUpdated",
    "Policy",
    "PrecisionLoss",
    "Reason",
    "Report",
    "Stalled",
    "StoppedSlice",
    "TensorBoardWriter",
    "WandbWriter",
    "WeightDecayWipe",
    "Writer",
    "__version__",
    "check",
    "clip_grad_norm_",
    "close",
    "log",
    "read_run",
    "watch",
]

#: writers whose backend package is optional: resolved on first attribute access, so `import gradlog`
#: never imports wandb (and the backend itself is imported only when a writer is constructed).
#: `read_run` (reading a run back, `views/health.py`) likewise: the training path never imports the readers.
_LAZY = {"WandbWriter": "gradlog.writers.wandb", "read_run": "gradlog.views.health"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'gradlog' has no attribute {name!r}")
