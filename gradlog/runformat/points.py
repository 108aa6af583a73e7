"""A tag's (step, value) points read back from a run, kept as two flat arrays.

A list of `(step, value)` tuples costs ~90 bytes a point (the tuple, the int, the float); a long run of
thousands of tensors holds tens of millions of points, so `gradlog report` needed gigabytes for what
is 16 bytes a point of numbers. `Series` reads like that list (iteration, indexing, `len`, `==`) so the
views and the verdict do not care which they are given.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import overload


def _steps_array(steps: list[int]) -> array[int] | list[int]:
    """int64 where every step fits (always for TensorBoard, whose steps are int64), else the list."""
    try:
        return array("q", steps)
    except OverflowError:
        return steps


class Series(Sequence[tuple[int, float]]):
    """Points in the order given (the readers give them in step order, one per step)."""

    __slots__ = ("_steps", "_values")

    def __init__(self, points: Iterable[tuple[int, float]] = ()) -> None:
        pts = points if isinstance(points, (list, tuple)) else list(points)
        self._steps = _steps_array([int(s) for s, _ in pts])
        self._values = array("d", (float(v) for _, v in pts))

    @classmethod
    def _of(cls, steps: array[int] | list[int], values: array[float]) -> Series:
        out = cls.__new__(cls)
        out._steps, out._values = steps, values
        return out

    def __len__(self) -> int:
        return len(self._values)

    @overload
    def __getitem__(self, i: int) -> tuple[int, float]: ...

    @overload
    def __getitem__(self, i: slice) -> Series: ...

    def __getitem__(self, i: int | slice) -> tuple[int, float] | Series:
        if isinstance(i, slice):
            return Series._of(self._steps[i], self._values[i])
        return self._steps[i], self._values[i]

    def __iter__(self) -> Iterator[tuple[int, float]]:
        return zip(self._steps, self._values)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        if len(other) != len(self):
            return False
        return all(tuple(o) == p for o, p in zip(other, self))  # NaN != NaN (no shared float objects here)

    __hash__ = None  # type: ignore[assignment]  # mutable-looking, like the list it stands for

    def __repr__(self) -> str:
        return f"Series({list(self)!r})"


class SeriesBuilder:
    """Collects one tag's points as they are read, in any order, then `build()` sorts them by step and keeps
    the last one written for a step (a resumed run writes a step twice)."""

    __slots__ = ("_sorted", "_steps", "_values")

    def __init__(self) -> None:
        self._steps: array[int] | list[int] = array("q")
        self._values: array[float] = array("d")
        self._sorted = True  # strictly increasing so far: nothing to sort or drop

    def add(self, step: int, value: float) -> None:
        if self._sorted and self._steps and step <= self._steps[-1]:
            self._sorted = False
        try:
            self._steps.append(step)
        except OverflowError:  # a step beyond int64 (only W&B or a MemoryWriter can carry one)
            self._steps = list(self._steps)
            self._steps.append(step)
        self._values.append(value)

    def build(self) -> Series:
        if self._sorted:
            return Series._of(self._steps, self._values)
        steps, values = self._steps, self._values
        order = sorted(range(len(steps)), key=steps.__getitem__)  # stable: a step's writes stay in order
        keep = [i for n, i in enumerate(order) if n + 1 == len(order) or steps[order[n + 1]] != steps[i]]
        kept: array[int] | list[int] = (
            [steps[i] for i in keep] if isinstance(steps, list) else array("q", (steps[i] for i in keep))
        )
        return Series._of(kept, array("d", (values[i] for i in keep)))
