"""The cells of gradlog's tables whose text has a form of its own: the name cell of a tensor with tied
aliases, the shape, the slice dimension, and the summary values W&B stores typed.

Each is built and parsed here, once: the writers build them, the readers, the health view, the
TensorBoard tab and the command line parse them (the tab's JavaScript splits the name cell the same way).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

#: `w (= a, b)`: a tensor and the other names it is tied to.
ALIAS_OPEN = " (= "
ALIAS_SEP = ", "
ALIAS_CLOSE = ")"
#: The shape cell of a 0-d tensor, and of a lazy one never materialised (no shape yet).
SCALAR_SHAPE = "scalar"
LAZY_SHAPE = "not materialised"
#: How a slice dimension reads in tables (`PartlyUpdated.dim`, `StoppedSlice.dim`), and back.
DIM_NAMES: dict[int | None, str] = {0: "rows", 1: "columns", None: "elements"}


def name_cell(name: str, aliases: Sequence[str] = ()) -> str:
    """`name`, or `name (= a, b)` when other names share the tensor."""
    return f"{name}{ALIAS_OPEN}{ALIAS_SEP.join(aliases)}{ALIAS_CLOSE}" if aliases else name


def split_name_cell(cell: str) -> tuple[str, tuple[str, ...]]:
    """The inverse of `name_cell`: (`name`, aliases)."""
    name, _, aliases = cell.partition(ALIAS_OPEN)
    if not aliases:
        return name, ()
    return name, tuple(a for a in aliases.rstrip(ALIAS_CLOSE).split(ALIAS_SEP) if a)


def bare_name(cell: str) -> str:
    """The tensor's own name in a name cell, without its aliases."""
    return cell.split(ALIAS_OPEN, 1)[0]


def table_cells(
    table: tuple[Sequence[str], Sequence[Sequence[str]]], wanted: Sequence[str]
) -> Iterator[dict[str, str]]:
    """Each row of a (columns, rows) table as {column: cell} for the `wanted` columns, found by name (a
    column or cell a run did not write reads as "")."""
    columns, rows = table
    index = {c: i for i, c in enumerate(columns)}
    for r in rows:
        yield {c: (r[index[c]] if c in index and index[c] < len(r) else "") for c in wanted}


def shape_cell(shape: Sequence[int], numel: int = 1) -> str:
    """`3x4`; `scalar` for a 0-d tensor; `not materialised` for a lazy one (no shape, no elements)."""
    return "x".join(map(str, shape)) or (SCALAR_SHAPE if numel else LAZY_SHAPE)


def parse_shape(cell: str) -> tuple[int, ...] | None:
    """The inverse of `shape_cell` (a cell with no dims gives `()`); None for a cell that is not a shape."""
    if cell in ("", SCALAR_SHAPE, LAZY_SHAPE):
        return ()
    try:
        return tuple(int(d) for d in cell.split("x"))
    except ValueError:
        return None


#: The largest magnitude a step or count read from a run file may have: what an int64 event step holds.
_INT64_DIGITS = 18


def whole_number(text: str) -> int | None:
    """A step or count cell read from a run file: an optional "-" and ASCII digits that fit an int64, else
    None. `str.isdigit` is not enough: "²" and "٣" pass it and `int("²")` raises; "--5".lstrip("-") passes
    it too. A 5,000-digit cell would cost int() time and a 30-digit one overflows the arrays it goes into."""
    digits = text[1:] if text.startswith("-") else text
    if not (digits.isascii() and digits.isdigit() and len(digits) <= _INT64_DIGITS):
        return None
    return int(text)


def summary_value(text: str) -> Any:
    """A summary cell as W&B stores it: numbers and booleans show better as themselves."""
    if text in ("True", "False"):
        return text == "True"
    try:
        return int(text)
    except ValueError:
        return text


def summary_text(value: Any) -> str:
    """The inverse of `summary_value` (and of W&B's JSON, where 40 may come back as 40.0)."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)
