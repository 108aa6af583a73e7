"""Read a W&B run file (`run-<id>.wandb`) without a W&B server: the public name of the reader.

The reader itself lives in `gradlog.runformat.wandb_offline`, beside the rest of the run format, so that
a resumed run (gradlog/run/resume.py, on the training path) can read its earlier W&B segment without
importing the readers.
"""

from gradlog.runformat.wandb_offline import (
    OfflineRun,
    WandbFileError,
    find_run_files,
    read_chunks,
    read_finished_run,
    read_offline_run,
)

__all__ = ["OfflineRun", "WandbFileError", "find_run_files", "read_chunks", "read_finished_run", "read_offline_run"]
