"""A finding is one typed record, and one codec derives its table, its row, its JSON and its reading back.

Each kind of finding is a frozen dataclass deriving `Record` (`gradlog.verdict.report`): it declares its kind
(`KIND`: the `Report` field that holds its records, and its table's name, `gradlog/<KIND>`), its title (the
heading a person reads) and its fields, each with its cell (`cell(...)`: how the value reads in a table and
in JSON, and how it is read back). From those alone, with nothing written per kind:

- `columns()`: the table's columns, its fields' cells in field order (the written table's also hold the
  cells marked `shown=False`);
- `row()`: a record's cells (`limit` cuts long index lists for the console);
- `to_dict()`: plain JSON types, the fields in order, then whether the record is intentional (where the kind
  says) and its severity under a policy;
- `from_cells()`: the record read back from a row of its table, by column name (`gradlog report`, the tab,
  a resumed run). A damaged cell raises ValueError or KeyError (the row is skipped and named); a cell a
  reader can make sense of anyway (a count, a reason this version does not know) reads leniently.

So a change to a field changes the close() tables, the TensorBoard and W&B tables, `gradlog report`, the
resume merge and the tab at once, and the type checker sees every one of them. A field without a cell is
not in the table and reads back as its default (an alert's value and reference).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch

from gradlog.runformat import names
from gradlog.runformat.cells import DIM_NAMES, name_cell, parse_shape, shape_cell, split_name_cell
from gradlog.verdict import policy as policies
from gradlog.verdict.policy import Policy

if TYPE_CHECKING:
    from gradlog.measure.params import Tracked
    from gradlog.verdict.ledger import Evidence

#: the key of a field's `Cell` in its `dataclasses.field` metadata
CELL = "gradlog.cell"

_Cells = Mapping[str, str]


def _same(value: Any) -> Any:
    return value


@dataclass(frozen=True)
class Cell:
    """How one field reads in a table and in JSON.

    `write(value, record, limit)`: its cells, one per column (`extra` adds columns after the field's own; a
    field folded into another's cell, `own=False`, has none); `read(name, cells)`: its value back from the
    row's cells by column name; `plain(value)`: its JSON form. `shown=False`: in the written table only, not
    in the tables a person reads."""

    write: Callable[[Any, Any, int | None], list[str]]
    read: Callable[[str, _Cells], Any]
    plain: Callable[[Any], Any] = _same
    own: bool = True
    #: the field whose cell this one is folded into (`own=False`); in JSON it follows that field
    into: str | None = None
    extra: tuple[str, ...] = ()
    shown: bool = True

    def columns(self, name: str) -> list[str]:
        return [*([name] if self.own else []), *self.extra]


def simple(text: Callable[[Any], str], parse: Callable[[str], Any], plain: Callable[[Any], Any] = _same) -> Cell:
    """A cell of its own that is the field's value as text (`text`) and back (`parse`)."""
    return Cell(write=lambda v, _r, _limit: [text(v)], read=lambda name, c: parse(c[name]), plain=plain)


def cell(format_: Cell, shown: bool = True, **kwargs: Any) -> Any:
    """A dataclass field whose table cell is `format_` (`shown=False`: in the written table only)."""
    if not shown:
        format_ = dataclasses.replace(format_, shown=False)
    return field(metadata={CELL: format_}, **kwargs)


def lenient_int(text: str, default: int = 0) -> int:
    """A count from a cell: a damaged one reads as `default` (the row is still worth reading), and so does one
    beyond an int64 (no step or count gradlog writes is: a table from disk is untrusted, and such a count
    overflows the event steps and arrays it goes into)."""
    try:
        value = int(text)
    except ValueError:
        return default
    return value if -(2**63) <= value < 2**63 else default


_DIMS = {v: k for k, v in DIM_NAMES.items()}

TEXT = simple(str, str)
INT = simple(str, int)
#: a count the row is read without: damaged, it reads 0
COUNT = simple(str, lenient_int)
#: a share printed to three decimals (what the table keeps of it)
SHARE = simple(lambda v: f"{v:.3f}", float)
FLAG = simple(str, lambda t: t == "True")
#: a slice dimension: "rows", "columns", "elements" (`DIM_NAMES`)
DIM = simple(lambda d: DIM_NAMES.get(d, f"dim {d}"), lambda t: _DIMS[t])
#: a tensor's shape, read with its element count (`shape_cell`: "not materialised" has no elements); a damaged
#: dimension reads as 0 and the row is kept
SHAPE = Cell(
    write=lambda v, r, _limit: [shape_cell(v, r.numel)],
    read=lambda name, c: _shape(c[name]),
    plain=list,
)
#: a tensor's name with its tied aliases in one cell (`name_cell`), and the aliases read back from it
NAME_WITH_ALIASES = Cell(
    write=lambda v, r, _limit: [name_cell(v, r.aliases)], read=lambda name, c: split_name_cell(c[name])[0]
)
ALIASES = Cell(
    write=lambda v, _r, _limit: [],
    read=lambda _name, c: split_name_cell(c["name"])[1],
    plain=list,
    own=False,
    into="name",
)


def _shape(text: str) -> tuple[int, ...]:
    shape = parse_shape(text)
    return shape if shape is not None else tuple(lenient_int(d) for d in text.split("x"))


def ranges(total: str, cap: int, cut: bool = True, count: str | None = None) -> Cell:
    """Sorted indices as compressed ranges ("0-7, 12"): cut to `limit` ranges on the console where `cut`;
    read back at most min(the `total` cell, `cap`) of them (a table from disk is untrusted); `count`: a column
    after it with how many there are."""

    def write(v: Sequence[int], _r: Any, limit: int | None) -> list[str]:
        return [format_ranges(v, limit if cut else None), *([str(len(v))] if count else [])]

    def read(name: str, c: _Cells) -> tuple[int, ...]:
        return parse_ranges(c[name], limit=min(int(c[total]), cap))

    return Cell(write=write, read=read, plain=list, extra=(count,) if count else ())


def format_ranges(indices: Iterable[int], limit: int | None = None) -> str:
    """Sorted indices as compressed ranges, "0-7, 12, 50-99"; with `limit`, only the first `limit` ranges
    and "... (+N more ranges)". `parse_ranges` reads the uncut form back."""
    ordered = torch.tensor(sorted(set(indices)), dtype=torch.int64)
    # run boundaries in one pass of tensor ops (an embedding can have 800k partly-updated rows)
    breaks = ((ordered[1:] - ordered[:-1]) != 1).nonzero().flatten() + 1 if ordered.numel() else ordered
    starts = torch.cat([ordered.new_zeros(1), breaks]) if ordered.numel() else ordered
    ends = torch.cat([breaks - 1, ordered.new_tensor([ordered.numel() - 1])]) if ordered.numel() else ordered
    runs = list(zip(ordered[starts].tolist(), ordered[ends].tolist()))
    shown = runs if limit is None else runs[:limit]
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in shown)
    if len(shown) < len(runs):
        n = len(runs) - len(shown)
        text += f", ... (+{n} more range{'s' * (n != 1)})"
    return text


def parse_ranges(text: str, limit: int | None = None) -> tuple[int, ...]:
    """The inverse of `format_ranges` (uncut): "0-7, 12" -> (0, 1, ..., 7, 12). Raises ValueError on anything else,
    and on more than `limit` indices (a table read from disk is untrusted: "0-99999999999" must not fill memory)."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        a = int(lo)
        b = int(hi) if sep else a
        if b < a:
            raise ValueError(f"bad index range {part[:40]!r}")
        if a < 0 or b >= 2**63:  # the int64 indices every slice table is built from; int() takes "-0" and "+5"
            raise ValueError(f"index range {part[:40]!r} is outside 0..2**63-1")
        if limit is not None and len(out) + (b - a + 1) > limit:
            raise ValueError(f"index range {part[:40]!r} holds more than {limit} indices")
        out.extend(range(a, b + 1))
    return tuple(out)


R = TypeVar("R", bound="Record")


@dataclass(frozen=True)
class Case:
    """What a kind's detector reads at close (`Record.detect`): the tracked tensors (`rows`, in model order),
    their evidence over the whole run (`evidence`: a resumed run's earlier segments folded in), the run's
    optimizer steps and measured steps, and the records the diagnosis has found so far (`found`, by `KIND`:
    never updated, partly updated, stalled, stopped slices), so that a detector need not repeat them."""

    rows: Sequence[Tracked]
    evidence: Mapping[int, Evidence]
    steps: int
    measured_steps: int
    found: Mapping[str, Sequence[Record]] = field(default_factory=dict)

    def named(self, kind: str) -> set[str]:
        """The tensors the `kind` records found so far name."""
        return {str(getattr(r, "name", "")) for r in self.found.get(kind, ())}


class Record:
    """A finding of one kind: a frozen dataclass whose fields carry their cells (`cell(...)`)."""

    #: the `Report` field holding these records, and the table's name after `gradlog/`
    KIND: ClassVar[str]
    #: the table's title as a person reads it
    TITLE: ClassVar[str]
    #: what a heading counts ("2 tensors", "3 records"), and what it says the table holds after the count
    NOUN: ClassVar[str] = "record"
    ABOUT: ClassVar[str] = ""
    #: the column that names a row that cannot be read back
    KEY: ClassVar[str] = "name"
    #: the table is written once there is something to say (most runs: never), then always; False: always
    SPARSE: ClassVar[bool] = True

    #: index ranges the markdown's ungrouped table shows (None: all)
    UNGROUPED_LIMIT: ClassVar[int | None] = None
    #: the kinds of its findings under a `Policy` (`policy_kind()`'s values) -> (default severity, why):
    #: `gradlog.verdict.policy.DEFAULTS` takes them when the kind is registered (`FINDINGS.register`)
    SEVERITY: ClassVar[Mapping[str, tuple[str, str]]] = {}
    #: what the verdict line says after the count of its findings' tensors ("2 tensors <SAID>"), where the
    #: kind says no more than that (`verdict_parts`); "" says its title
    SAID: ClassVar[str] = ""

    @classmethod
    def detect(cls: type[R], case: Case) -> list[R] | None:
        """This kind's records in a run's evidence, at close (`gradlog.run.diagnosing` calls it for every
        registered kind, after the four it builds itself); None: a kind the diagnosis builds in its own steps
        (never updated, partly updated, stalled, stopped slices, experts)."""
        return None

    @classmethod
    def judged_kinds(cls, report: Any) -> list[str | None]:
        """The kind under a `Policy` of each of `report`'s records of this kind, in order (None: no severity of
        its own); the judge weighs them with it. A kind that weighs a record by the others overrides it."""
        return [r.policy_kind() for r in report.records(cls)]

    def weighed(self, report: Any) -> bool:
        """Whether the verdict weighs this record of `report` (False: listed, no evidence either way)."""
        return True

    @classmethod
    def verdict_parts(cls, found: Sequence[Any], report: Any, words: Any) -> list[tuple[str, Sequence[Any]]] | None:
        """What the verdict line says of this kind: (text, the findings whose worst severity it carries; none:
        said whatever they are) per part, from `found` (the judge's `Finding`s of this kind's records, ignored
        ones included), `report` and `words` (`gradlog.verdict.judge.Words`). None: the judge's own phrase,
        the count of the tensors and `SAID`."""
        return None

    @classmethod
    def columns(cls, written: bool = False) -> list[str]:
        """The columns of the table a person reads; `written`: of the table a run writes (with the cells
        marked `shown=False`)."""
        return [c for name, f in _cells(cls) if written or f.shown for c in f.columns(name)]

    def row(self, limit: int | None = None, written: bool = False) -> list[str]:
        """The record's cells, in `columns(written)`' order; `limit` cuts index ranges (the console's)."""
        cells = [f.write(getattr(self, name), self, limit) for name, f in _cells(type(self)) if written or f.shown]
        return [text for texts in cells for text in texts]

    @classmethod
    def from_cells(cls: type[R], cells: _Cells) -> R:
        """The record a row of its table holds (`cells`: column -> text, "" where missing)."""
        return cls(**{name: f.read(name, cells) for name, f in _cells(cls)})

    @property
    def intentional(self) -> bool | None:
        """Whether the user meant it (frozen by design, a padding row); None: not a question this kind asks."""
        return None

    def policy_kind(self) -> str | None:
        """The finding's kind under a `Policy` (`gradlog.verdict.policy.KINDS`); None: no severity of its own."""
        return None

    def policy_names(self) -> str | tuple[str, ...]:
        """What a policy's name pattern is matched against: the tensor's name (and its aliases)."""
        return str(getattr(self, "name", ""))

    def to_dict(self, policy: Policy | None = None, kind: str | None = None) -> dict[str, Any]:
        """Plain JSON types, the fields in order, with the record's severity under `policy` (the defaults when
        None); `kind`: the judge's where it weighs the record otherwise (`judge.slice_kinds`: dead units of a
        small share are `partly.few_dead`)."""
        out = {name: _plain(f, getattr(self, name)) for name, f in _json_order(type(self))}
        if self.intentional is not None:
            out["intentional"] = self.intentional
        own = self.policy_kind()
        if own is not None:
            out["severity"] = (policy or Policy()).severity(kind or own, self.policy_names())
        return out


def _plain(f: dataclasses.Field[Any], value: Any) -> Any:
    format_: Cell | None = f.metadata.get(CELL)
    return value if format_ is None else format_.plain(value)


_JSON_ORDER: dict[type[Record], tuple[tuple[str, dataclasses.Field[Any]], ...]] = {}
_CELLS: dict[type[Record], tuple[tuple[str, Cell], ...]] = {}


def _json_order(cls: type[Record]) -> tuple[tuple[str, dataclasses.Field[Any]], ...]:
    """The fields in order, each folded one right after the field whose cell holds it (aliases after the name)."""
    if cls in _JSON_ORDER:
        return _JSON_ORDER[cls]
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    folded = {f.name: _into(f) for f in fields}
    out: list[tuple[str, dataclasses.Field[Any]]] = []
    for f in fields:
        if folded[f.name] is None:
            out.append((f.name, f))
            out += [(g.name, g) for g in fields if folded[g.name] == f.name]
    _JSON_ORDER[cls] = tuple(out)
    return _JSON_ORDER[cls]


def _into(f: dataclasses.Field[Any]) -> str | None:
    format_: Cell | None = f.metadata.get(CELL)
    return None if format_ is None else format_.into


def _cells(cls: type[Record]) -> tuple[tuple[str, Cell], ...]:
    """(field name, cell) of every field of `cls` with a cell, in field order (worked out once per kind)."""
    if cls not in _CELLS:
        fields = dataclasses.fields(cls)  # type: ignore[arg-type]
        _CELLS[cls] = tuple((f.name, f.metadata[CELL]) for f in fields if CELL in f.metadata)
    return _CELLS[cls]


class Kinds:
    """The registry of the kinds of finding a `Report` holds, in the order their tables are written and read, the
    console shows them and the verdict line says them. Registering a kind declares its severities
    (`Record.SEVERITY`) to the policy; from then on the diagnosis runs its detector (`Record.detect`), and the
    tables, the console, the judge, `to_dict()`, `gradlog report`, a resumed run and the tab take its records."""

    def __init__(self) -> None:
        self._kinds: list[type[Record]] = []
        #: names a kind may not take: the `Report`'s other fields and `to_dict()`'s other keys
        self.reserved: set[str] = set()

    def register(self, *kinds: type[Record]) -> None:
        """Add `kinds` after those registered; a `KIND` taken, or one that is not a table name
        (`gradlog.runformat.names.finding_table`: one word), is refused (ValueError naming it)."""
        for kind in kinds:
            if kind.KIND in {k.KIND for k in self._kinds} or not names.is_table(names.finding_table(kind.KIND)):
                raise ValueError(f"cannot register the finding kind {kind.KIND!r}: taken, or not one word")
            if kind.KIND in self.reserved or kind.KIND in (t.removeprefix(names.RUN) for t in names.TABLES):
                raise ValueError(f"cannot register the finding kind {kind.KIND!r}: a name of the report's own")
            policies.declare(kind.SEVERITY)
            self._kinds.append(kind)

    def unregister(self, kind: type[Record]) -> None:
        """Take a kind back (and its severities): a kind made up in a test."""
        self._kinds.remove(kind)
        policies.withdraw(kind.SEVERITY)

    def __iter__(self) -> Iterator[type[Record]]:
        return iter(tuple(self._kinds))

    def __len__(self) -> int:
        return len(self._kinds)

    def __contains__(self, kind: object) -> bool:
        return kind in self._kinds


#: Every kind of finding, in order (`gradlog.verdict.report` registers the built-in ones)
FINDINGS = Kinds()


__all__ = [
    "CELL",
    "FINDINGS",
    "Case",
    "Cell",
    "Kinds",
    "Record",
    "cell",
    "format_ranges",
    "parse_ranges",
    "ranges",
    "simple",
]
