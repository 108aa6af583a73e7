"""The markdown tables gradlog writes to TensorBoard's Text tab, and their inverse.

Cells are escaped so that a `|` or a line break in a tensor name cannot break a table, and long cells
wrapped with `<br>` for the Text tab; `parse_markdown_table` reads the same tables back (the readers,
a resumed run, the gradlog tab).
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterator, Sequence

Table = tuple[list[str], list[list[str]]]

#: Long cells are wrapped at this many characters with <br>: TensorBoard's Text tab lets a table fill the
#: page and breaks words anywhere, so one long "detail" column squeezed the short ones to "shap|e", "nume|l".
WRAP_AT = 48


def _wrap(cell: str) -> str:
    if len(cell) <= WRAP_AT:
        return cell
    return "<br>".join(textwrap.wrap(cell, WRAP_AT, break_long_words=False, break_on_hyphens=False)) or cell


def escape_markdown(text: str) -> str:
    """Plain text inside markdown emphasis: characters markdown would act on are backslash-escaped."""
    return "".join("\\" + ch if ch in "\\`*_[]<>|#" else ch for ch in " ".join(text.split()))


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("\\", "\\\\").replace("|", "\\|") or " "


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[str]], wrap: bool = True) -> str:
    """A GitHub-style markdown table; cells are escaped so a `|` or newline in a name cannot break it, and
    long cells are wrapped (see WRAP_AT, unless `wrap=False`) so that short columns keep their words whole."""
    fit = _wrap if wrap else (lambda c: c)
    lines = ["| " + " | ".join(_cell(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fit(_cell(c)) for c in row) + " |" for row in rows]
    if not rows:
        lines += ["", "_(no rows)_"]
    return "\n".join(lines)


def _split_row(line: str) -> list[str]:
    """Cells of one `| a | b |` line; `\\|` is a literal bar and `\\\\` a literal backslash."""
    body = line.strip()
    if body.startswith("|"):
        body = body[1:]
    cells: list[str] = []
    cur: list[str] = []
    it: Iterator[str] = iter(body)
    for ch in it:
        if ch == "\\":
            nxt = next(it, "")
            cur.append(nxt if nxt in "|\\" else ch + nxt)
        elif ch == "|":
            cells.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        cells.append("".join(cur).strip())
    return [c.replace("<br>", " ") for c in cells]  # the writer wraps long cells with <br> (WRAP_AT)


def parse_markdown_table(text: str) -> Table:
    """The inverse of the markdown tables gradlog writes: header row, `|---|` rule, body rows."""
    lines = [ln for ln in text.splitlines() if ln.strip().startswith("|")]
    if len(lines) < 2 or not set(lines[1].replace("|", "").strip()) <= set("-: "):
        raise ValueError("not a markdown table")
    columns = _split_row(lines[0])
    rows = []
    for ln in lines[2:]:
        cells = _split_row(ln)
        cells += [""] * (len(columns) - len(cells))
        rows.append(cells[: len(columns)])
    return columns, rows
