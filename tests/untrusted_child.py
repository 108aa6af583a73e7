"""`gradlog report` in a child process that records every file it opens and every folder it lists.

python tests/untrusted_child.py LOG.json report PATH [options]

Everything the report needs is imported first; then an audit hook (`sys.addaudithook`) records the
"open" events (built-in `open`, `io.open`, `os.open`) and the "os.scandir" / "os.listdir" events, and
`gradlog.cli.entry.main` runs. At exit the records go to LOG.json through a descriptor opened before the
hook. tests/test_untrusted_runs.py checks that nothing outside the run folder was opened.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def main() -> int:
    log_path, argv = sys.argv[1], sys.argv[2:]
    # Import what a report can import, so the hook sees the report's own opens, not the import system's.
    import crc32c  # noqa: F401
    import tensorboard.compat.proto.event_pb2  # noqa: F401
    import wandb.proto.wandb_internal_pb2  # noqa: F401

    import gradlog.cli.entry
    import gradlog.cli.report
    import gradlog.readers.run
    import gradlog.readers.wandb_offline
    import gradlog.runformat.tfevents
    import gradlog.views.health

    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    opened: list[str] = []
    listed: list[str] = []

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
            opened.append(os.fsdecode(args[0]))
        elif event in ("os.scandir", "os.listdir") and args and isinstance(args[0], (str, bytes, os.PathLike)):
            listed.append(os.fsdecode(args[0]))

    sys.addaudithook(hook)
    try:
        code = gradlog.cli.entry.main(argv)
    finally:
        os.write(log_fd, json.dumps({"opened": opened, "listed": listed}).encode())
        os.close(log_fd)
    return code


if __name__ == "__main__":
    sys.exit(main())
