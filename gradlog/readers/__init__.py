"""Reading runs back from disk: `run.load` (TensorBoard or W&B: which run a path holds, and reading it),
`wandb_offline` (W&B's run file), and `checkpoints`. The event-file records (`gradlog.runformat.tfevents`,
resynchronising after damage), the one layer every open goes through (`gradlog.runformat.files`: regular
files inside the run folder only, size caps, no symlink loops, escaped text) and the tables' codecs are
the run format's (`gradlog.runformat`), shared with the writers and a resumed run.

Used by `gradlog report` and the tests; never by the training-loop path.
"""

from __future__ import annotations
