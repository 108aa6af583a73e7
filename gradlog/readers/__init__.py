"""Reading runs back from disk: `run.load` (TensorBoard or W&B), `tfevents` (event files, resynchronising after
damage), `wandb_offline` (W&B's run file), and `files`, the one layer every open goes through (regular files
inside the run folder only, size caps, no symlink loops, escaped text).

Used by `gradlog report` and the tests; never by the training-loop path.
"""

from __future__ import annotations
