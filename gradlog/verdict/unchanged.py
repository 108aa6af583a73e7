"""Which slices of a tensor stayed bitwise equal: the per-slice definition shared by `gradlog diff` and
`gradlog.check`, when both values of a tensor are at hand (no fingerprints needed).

Slices: rows (dim 0) and columns (dim 1) of tensors with >= 2 dims, elements of 1-D tensors. A
slice "never changed" when every one of its entries holds the same value: bitwise equal, except
that +0.0 and -0.0 count as the same value (as they compare), and a NaN that stays bitwise the same
NaN is no change (NaN != NaN would call every NaN a change).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from gradlog.verdict.records import format_ranges
from gradlog.verdict.report import PartlyUpdated

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """An integer view of the same bytes (no copy), so equality is bitwise; bool/complex go through bytes."""
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    size = t.element_size()
    if t.is_complex() or size not in _INT_VIEW:
        return t.reshape(-1).contiguous().view(torch.uint8).reshape(*t.shape, size)
    return t.view(_INT_VIEW[size]) if t.dtype != _INT_VIEW[size] else t


def slice_dims(shape: tuple[int, ...]) -> tuple[int | None, ...]:
    """The slice kinds a tensor of this shape has: (0, 1) for >= 2 dims, (None,) for 1-D, () for scalars."""
    if len(shape) >= 2:
        return (0, 1)
    if len(shape) == 1:
        return (None,)
    return ()


def reduce_to_slices(mask: torch.Tensor, dim: int | None) -> torch.Tensor:
    """Per-slice any() of an element mask shaped like the tensor: rows (dim 0), columns (dim 1), or elements."""
    if dim is None:
        return mask.reshape(-1)
    if mask.dim() < 2:
        raise ValueError(f"rows/columns need a tensor with >= 2 dims, got shape {tuple(mask.shape)}")
    m = mask.reshape(mask.shape[0], mask.shape[1], -1)
    if m.shape[2] == 0:  # an empty trailing dim: no entry can differ
        return torch.zeros(m.shape[dim], dtype=torch.bool)
    if dim == 0:
        return m.any(dim=2).any(dim=1)
    return m.any(dim=2).any(dim=0)


def differs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Element mask of entries whose value changed, by the definition above."""
    if not (a.is_floating_point() or a.is_complex()):
        diff = bits(a) != bits(b)
        return diff.any(dim=-1) if diff.dim() > a.dim() else diff
    same = bits(a) == bits(b)
    if same.dim() > a.dim():  # byte view of an odd dtype: one trailing dim of bytes
        same = same.all(dim=-1)
    return (a != b) & ~(torch.isnan(a) & torch.isnan(b) & same)


def slice_word(dim: int | None, n: int = 2) -> str:
    word = "row" if dim == 0 else "column" if dim == 1 else "element"
    return word if n == 1 else word + "s"


def describe(dim: int | None, indices: list[int] | tuple[int, ...], total: int) -> str:
    """'rows 50-99 (50 of 100)'."""
    return f"{slice_word(dim, len(indices))} {format_ranges(indices, limit=12)} ({len(indices)} of {total})"


def partly_rows(records: Iterable[PartlyUpdated]) -> list[list[str]]:
    """Table rows (`PARTLY_COLUMNS`) of slice records, their indices described: one helper for the
    tables of `gradlog.check` and `gradlog diff`."""
    return [
        [
            p.name,
            slice_word(p.dim),
            str(p.never),
            str(p.total),
            describe(p.dim, p.indices, p.total),
            p.reason.value,
            p.detail,
        ]
        for p in records
    ]
