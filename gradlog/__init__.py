"""gradlog: which weights are learning, and which never did.

gl = gradlog.GradLogger(model, optimizer)        # or gradlog.watch(model, optimizer)
... optimizer.step(); gl.log(step) ...
report = gl.close()                               # the never-updated table
"""

from __future__ import annotations

from gradlog.histogram import Histogram
from gradlog.logger import GradLogger, close, log, watch
from gradlog.report import NeverUpdated, NonFinite, Reason, Report
from gradlog.writers import REGISTRY as WRITERS
from gradlog.writers import MemoryWriter, Writer
from gradlog.writers.tensorboard import TensorBoardWriter  # imports tensorboard only when constructed

__version__ = "0.1.0"

__all__ = [
    "WRITERS",
    "GradLogger",
    "Histogram",
    "MemoryWriter",
    "NeverUpdated",
    "NonFinite",
    "Reason",
    "Report",
    "TensorBoardWriter",
    "Writer",
    "__version__",
    "close",
    "log",
    "watch",
]
