"""Reading runs back from disk: `run.load` (TensorBoard or W&B), `wandb_offline` (W&B's run file).

Used by `gradlog report` and the tests; never by the training-loop path.
"""

from __future__ import annotations
