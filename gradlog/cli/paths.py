"""Where `--plot OUT` goes, checked before a run is read: a folder, a missing folder or an unknown format is
named at once, not after minutes of reading (and matplotlib, given a name without a suffix, writes `OUT.png`
beside it: `--plot runs/` wrote `runs.png` next to the folder while saying "plot written to runs/")."""

from __future__ import annotations

import os

#: The formats matplotlib's Agg backend writes (matplotlib 3.x).
FORMATS = frozenset(
    {"png", "pdf", "svg", "svgz", "jpg", "jpeg", "eps", "ps", "tif", "tiff", "webp", "gif", "pgf", "raw", "rgba"}
)


def plot_target(path: str) -> str:
    """The file `--plot path` will write (".png" added to a name without a suffix); ValueError says why not."""
    if os.path.isdir(path) or path.endswith(("/", os.sep)):
        example = os.path.join(path, "gradlog.png")
        raise ValueError(f"--plot {path!r} is a folder; pass a file name such as {example!r}")
    parent = os.path.dirname(path) or "."
    if not os.path.isdir(parent):
        what = "is not a folder" if os.path.exists(parent) else "does not exist"
        raise ValueError(f"--plot {path!r}: {parent!r} {what}; create the folder or pass a file in an existing one")
    ext = os.path.splitext(path)[1][1:].lower()
    if not ext:
        return path + ".png"
    if ext not in FORMATS:
        raise ValueError(f"--plot {path!r}: {ext!r} is not an image format; end the name with .png, .pdf or .svg")
    return path
