"""`RunData`: a run as read back, backend-neutral (the same shape `MemoryWriter` keeps in memory), and the
rule every reader applies to it: the final tables over the provisional ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gradlog.runformat import names, tags
from gradlog.runformat.cells import whole_number
from gradlog.runformat.points import Series

Table = tuple[list[str], list[list[str]]]

#: Tag prefixes gradlog writes (`weights/grad_norm/`, ..., `gradlog/`); a run with none of them is not a gradlog run.
GRADLOG_PREFIXES = (*tags.SCALAR_PREFIXES, tags.RUN)


class BadRun(Exception):
    """The path cannot be read as a gradlog run; the message says what was found and what to pass instead."""


def wanted_table(name: str) -> bool:
    """Whether a table of that name is gradlog's (`names.is_table`), or a provisional copy of one."""
    return names.is_table(name) or name.startswith(names.PROVISIONAL_PREFIX)


@dataclass
class RunData:
    """`scalars[tag]`: (step, value) points in step order (a `Series`: 16 bytes a point), `tables[name] =
    (columns, rows)`, what was skipped (damage: the report is partial) and `notes` (worth saying, not
    damage: a crashed run's torn tail)."""

    path: str
    backend: str
    scalars: dict[str, Sequence[tuple[int, float]]] = field(default_factory=dict)
    tables: dict[str, Table] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: Set when the run never closed and its tables are the last provisional ones: the step they are as of.
    provisional_step: int | None = None

    @classmethod
    def from_memory(cls, writer: Any, path: str = "<memory>") -> RunData:
        """From a `MemoryWriter` (notebooks, tests): the same analysis without a file in between."""
        scalars: dict[str, Sequence[tuple[int, float]]] = {t: Series(sorted(p)) for t, p in writer.scalars.items()}
        tables = {name: (list(cols), [list(r) for r in rows]) for name, (cols, rows) in writer.tables.items()}
        return settle_provisional(cls(path=path, backend="memory", scalars=scalars, tables=tables))

    def has_gradlog_data(self) -> bool:
        return any(t.startswith(GRADLOG_PREFIXES) for t in self.scalars) or any(names.is_table(n) for n in self.tables)

    def summary(self) -> dict[str, str]:
        """The `gradlog/summary` table as {key: value} (empty without one)."""
        return summary_dict(self.tables.get(names.SUMMARY))


def summary_dict(table: Table | None) -> dict[str, str]:
    """A summary table's rows as {key: value}; a row of fewer than two cells is left out."""
    return {r[0]: r[1] for r in table[1] if len(r) >= 2} if table is not None else {}


def settle_provisional(run: RunData) -> RunData:
    """The final tables win; a run that never closed gets its last provisional tables under the final
    names, with `provisional_step` saying which step they are as of."""
    provisional = {n: t for n, t in run.tables.items() if n.startswith(names.PROVISIONAL_PREFIX)}
    for n in provisional:
        del run.tables[n]
    if names.SUMMARY in run.tables or names.NEVER_UPDATED in run.tables or not provisional:
        return run
    for n, table in provisional.items():
        run.tables[names.final(n)] = table
    step = whole_number(run.summary().get("as_of_step", ""))
    run.provisional_step = step if step is not None else -1
    return run


def model_order(scalars: dict[str, Any], order: list[str]) -> dict[str, Any]:
    """`scalars` with each family's per-tensor tags in model order (tensors not in `order` after, as read).

    W&B writes a history row's keys in arbitrary order, so without this a heatmap's rows would be shuffled."""
    if not order:
        return scalars
    rank = {name: i for i, name in enumerate(order)}
    names = list(scalars)
    first = {tag: i for i, tag in enumerate(names)}

    def family(tag: str) -> tuple[str, str]:
        """(metric, tensor name) of a per-tensor tag (`weights/grad_norm/fc.weight`), else (group, rest)."""
        split = tags.split(tag)
        if split is not None:
            return split
        group, _, rest = tag.partition("/")
        return group, rest

    def key(tag: str) -> tuple[str, int, int]:
        fam, name = family(tag)
        return (fam, rank.get(name, len(rank)), first[tag])

    families = {family(tag)[0]: i for i, tag in reversed(list(enumerate(names)))}
    return {t: scalars[t] for t in sorted(names, key=lambda t: (families[family(t)[0]], *key(t)))}
