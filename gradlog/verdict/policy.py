"""How much each kind of finding matters: a severity per kind, tunable by kind and tensor-name pattern.

Every finding gradlog makes has a *kind* (``never.zero_grad``, ``partly.not_in_batch``,
``alert.update_ratio_high``, ``run.nonfinite``, ...) and a default *severity*:

- ``problem``: the training code is broken, the user must act (the verdict says PROBLEM);
- ``warning``: suspicious, look when convenient (counted in the verdict line, never a PROBLEM);
- ``note``: true and usually intended or harmless (frozen by design, the padding row, ids that no batch
  contained): counted, and listed under the tables, never hidden;
- ``ignore``: silenced by the user: kept in the tables (they are the data), left out of the verdict.

A `Policy` changes severities the way linters do (ruff's ``per-file-ignores``, pytest's ``-W error::``):
rules ``KIND[:PATTERN] -> SEVERITY``, where KIND is a full kind, a bare reason or alert name that matches it
in every table (``not_in_batch``), ``TABLE.*`` or ``*``, and PATTERN an fnmatch glob on the tensor name
(or one of its tied aliases). The last matching rule wins, so rules given later (the command line's, after
the ones the run recorded) override earlier ones. docs/verdict.md lists every kind and why its default is
what it is.

Only the standard library and the run format's vocabulary (the policy table's columns and cells) here:
`import gradlog` stays light, and the readers can rebuild a policy from a table.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Union

from gradlog.runformat.cells import table_cells
from gradlog.runformat.names import POLICY_COLUMNS

PROBLEM = "problem"
WARNING = "warning"
NOTE = "note"
IGNORE = "ignore"
#: most severe first
SEVERITIES = (PROBLEM, WARNING, NOTE, IGNORE)

#: dead units (`zero_grad`, `dead_units`, `not_routed` slices of the partly-updated and stopped tables) weigh by
#: their share of their tensor's slices along that dim, never-active and stopped together: up to this share the
#: finding is `partly.few_dead` / `stopped.few_dead` (notes by default). 5%: a few truly dead ReLU units are normal
#: (1 of 64 units of a classification head, 2 of 256 of an MLP encoder, 1 of 32 filters: 1.6%, 0.8%, 3.1%), while
#: one expert of eight (12.5%) or a unit killed in a layer of 16 (6.3%) is capacity a user would miss
SMALL_SHARE = 0.05
#: ...unless this many slices of one tensor stopped at one measured step: an event (a bad update), not attrition
EVENT_SLICES = 8
#: the reasons that say "units, filters, experts no longer fire", which the share weighs
DEAD_REASONS = frozenset({"zero_grad", "dead_units", "not_routed"})
#: kind -> (default severity, why) of the findings that are not a record's: the alerts, the run's and `gradlog
#: diff`'s. Each kind of record declares its own (`Record.SEVERITY`, `gradlog.verdict.report`: `never.*`, ...),
#: and `declare` adds them here when the kind is registered.
OWN: dict[str, tuple[str, str]] = {
    # alerts during training
    "alert.update_ratio_high": (WARNING, "update ratio far above the run's other tensors of its kind: lr too high?"),
    "alert.update_ratio_low": (WARNING, "update ratio far below the run's other tensors of its kind: barely learning"),
    "alert.grad_norm_spike": (WARNING, "a gradient norm jumped far above its own recent median (a loss spike)"),
    "alert.no_grad": (NOTE, "no gradient for several measured steps in a row, yet it learned (a rarely used path)"),
    # the run as a whole
    "run.nonfinite": (PROBLEM, "a gradient went NaN/Inf on a step the optimizer did not skip"),
    "run.skipped_steps": (NOTE, "a GradScaler skipped steps on overflow: routine in fp16 training"),
    "run.diagnosis_error": (PROBLEM, "the diagnosis itself failed: which tensors learned is unknown"),
    # gradlog diff (checkpoints)
    "diff.nonfinite": (PROBLEM, "NaN/Inf appeared in a checkpoint's weights"),
    "diff.missing": (PROBLEM, "a tensor is missing from some checkpoints"),
    "diff.shape_or_dtype_changed": (PROBLEM, "a tensor changed shape or dtype between checkpoints"),
}
_DECLARED: dict[str, tuple[str, str]] = {}


def declare(defaults: Mapping[str, tuple[str, str]]) -> None:
    """Add a kind of record's findings and their default severities (`Record.SEVERITY`); a kind declared
    twice, or a severity that is none of `SEVERITIES`, is a mistake in gradlog (or in a kind added to it)."""
    for kind, (severity, why) in defaults.items():
        if kind in DEFAULTS or "." not in kind or severity not in SEVERITIES or not why:
            raise ValueError(f"cannot declare the finding kind {kind!r} ({severity!r}): taken, unnamed or no severity")
    _DECLARED.update(defaults)


def withdraw(kinds: Iterable[str]) -> None:
    """Take back declared kinds (a kind of record unregistered)."""
    for kind in kinds:
        _DECLARED.pop(kind, None)


class _Defaults(Mapping[str, tuple[str, str]]):
    """The declared kinds (the records', in the order their kinds were registered), then `OWN`: read live, so
    a kind registered after this module was imported is known."""

    def __getitem__(self, kind: str) -> tuple[str, str]:
        return _DECLARED[kind] if kind in _DECLARED else OWN[kind]

    def __iter__(self) -> Iterator[str]:
        yield from _DECLARED
        yield from OWN

    def __len__(self) -> int:
        return len(_DECLARED) + len(OWN)


#: kind -> (default severity, why). Every kind a Report, an alert, the run or `gradlog diff` can produce.
DEFAULTS: Mapping[str, tuple[str, str]] = _Defaults()
KINDS = DEFAULTS.keys()


def _tables() -> tuple[str, ...]:
    return tuple(dict.fromkeys(k.split(".", 1)[0] for k in KINDS))


def _valid_kinds() -> str:
    return ", ".join(["*", *(f"{t}.*" for t in _tables()), *KINDS])


def _check_kind(kind: str) -> str:
    kind = kind.strip()
    if kind == "*" or kind in DEFAULTS or kind in {k.split(".", 1)[1] for k in KINDS}:
        return kind
    if kind.endswith(".*") and kind[:-2] in _tables():
        return kind
    raise ValueError(f"unknown finding kind {kind!r}; valid kinds: {_valid_kinds()} (or a bare name like not_in_batch)")


def _check_pattern(pattern: str) -> str:
    """A glob on tensor names; an empty one, one with spaces, or an unclosed `[` is a typo, not a pattern."""
    depth_ok = True
    i = 0
    while i < len(pattern):
        if pattern[i] == "[":
            close = pattern.find("]", i + 2 if pattern[i + 1 : i + 2] in ("!", "]") else i + 1)
            if close < 0:
                depth_ok = False
                break
            i = close
        i += 1
    if not pattern or pattern != pattern.strip() or any(c.isspace() for c in pattern) or not depth_ok:
        raise ValueError(
            f"malformed tensor-name pattern {pattern!r}: expected a non-empty fnmatch glob without spaces "
            "(e.g. '*.wpe.weight', 'encoder.layer.[0-3].*')"
        )
    return pattern


def check_severity(severity: str) -> str:
    s = str(severity).strip().lower()
    if s not in SEVERITIES:
        raise ValueError(f"unknown severity {severity!r}; valid severities: {', '.join(SEVERITIES)}")
    return s


@dataclass(frozen=True)
class Rule:
    """``kind[:pattern] -> severity``; `pattern` None matches every tensor and the run-level findings."""

    kind: str
    pattern: str | None
    severity: str

    @classmethod
    def parse(cls, spec: str, severity: str) -> Rule:
        """From ``KIND[:PATTERN]`` (the command line's and the mapping's spelling)."""
        kind, sep, pattern = str(spec).partition(":")
        return cls(_check_kind(kind), _check_pattern(pattern) if sep else None, check_severity(severity))

    @property
    def spec(self) -> str:
        return self.kind if self.pattern is None else f"{self.kind}:{self.pattern}"

    def matches(self, kind: str, names: tuple[str, ...]) -> bool:
        k = self.kind
        if not (k == "*" or k == kind or kind.split(".", 1)[1] == k or (k.endswith(".*") and kind.startswith(k[:-1]))):
            return False
        if self.pattern is None:
            return True
        return any(fnmatch.fnmatchcase(n, self.pattern) for n in names)


class Policy:
    """Severities by kind and tensor-name pattern, on top of `DEFAULTS`; the last matching rule wins.

    Policy({"not_in_batch:*.wpe.weight": "ignore", "not_in_batch:items.weight": "problem"})
    Policy(ignore=["update_ratio_low"], problem=["not_in_batch:items.weight"])  # ignore, note, warning, problem

    Raises ValueError naming an unknown kind or severity, or a malformed pattern.
    """

    def __init__(
        self,
        rules: Mapping[str, str] | Iterable[tuple[str, str]] | Iterable[Rule] = (),
        *,
        ignore: Iterable[str] = (),
        note: Iterable[str] = (),
        warning: Iterable[str] = (),
        problem: Iterable[str] = (),
    ) -> None:
        if isinstance(rules, str) or not isinstance(rules, (Mapping, Iterable)):
            raise ValueError(
                f"a policy is a mapping {{'KIND[:PATTERN]': severity}} or (spec, severity) pairs, got {rules!r}"
            )
        items = rules.items() if isinstance(rules, Mapping) else rules
        out: list[Rule] = []
        for item in items:
            if isinstance(item, Rule):
                out.append(Rule.parse(item.spec, item.severity))
                continue
            try:
                spec, severity = item
            except (TypeError, ValueError):
                raise ValueError(f"a policy rule is ('KIND[:PATTERN]', severity), got {item!r}") from None
            out.append(Rule.parse(spec, severity))
        for severity, specs in ((IGNORE, ignore), (NOTE, note), (WARNING, warning), (PROBLEM, problem)):
            if isinstance(specs, str):
                specs = [specs]
            elif not isinstance(specs, Iterable):
                raise ValueError(
                    f"Policy({severity}=...) takes 'KIND[:PATTERN]' specs (a string or a list), got {specs!r}"
                )
            out += [Rule.parse(s, severity) for s in specs]
        self.rules: tuple[Rule, ...] = tuple(out)

    @classmethod
    def coerce(cls, policy: Policy | Mapping[str, str] | Iterable[tuple[str, str]] | None) -> Policy:
        """What `GradLogger(policy=...)`, `check` and `diff` accept: a Policy, its rules, or None (the defaults)."""
        if policy is None:
            return cls()
        if isinstance(policy, Policy):
            return policy
        return cls(policy)

    def then(self, other: Policy | None) -> Policy:
        """This policy with `other`'s rules after it (so they win): the recorded run's, then the command line's."""
        if other is None or not other.rules:
            return self
        return Policy([*self.rules, *other.rules])

    def severity(self, kind: str, names: str | Iterable[str] | None = None) -> str:
        """The severity of a finding of `kind` about the tensor `names` (its name and aliases; None: run-level)."""
        if kind not in DEFAULTS:
            raise ValueError(f"unknown finding kind {kind!r}; valid kinds: {', '.join(KINDS)}")
        found = DEFAULTS[kind][0]
        named = () if names is None else (names,) if isinstance(names, str) else tuple(names)
        for rule in self.rules:
            if rule.matches(kind, named) and (rule.pattern is None or named):
                found = rule.severity
        return found

    def rows(self) -> list[list[str]]:
        """The `gradlog/policy` table (`POLICY_COLUMNS`): the rules only; the defaults are gradlog's."""
        return [[r.kind, r.pattern or "", r.severity] for r in self.rules]

    @classmethod
    def from_rows(cls, columns: list[str], rows: list[list[str]]) -> Policy:
        """Back from the table a run wrote (raises ValueError on a rule this gradlog does not know)."""
        out = []
        for c in table_cells((columns, rows), POLICY_COLUMNS):
            kind, pattern, severity = c["kind"], c["pattern"], c["severity"]
            out.append(Rule.parse(f"{kind}:{pattern}" if pattern else kind, severity))
        return cls(out)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Policy) and self.rules == other.rules

    def __hash__(self) -> int:
        return hash(self.rules)

    def __repr__(self) -> str:
        return f"Policy({[(r.spec, r.severity) for r in self.rules]!r})"


def table_markdown() -> str:
    """The severity table of docs/verdict.md, from `DEFAULTS` (a test keeps the two the same)."""
    lines = ["| kind | default | why |", "|---|---|---|"]
    lines += [f"| `{k}` | {sev} | {why} |" for k, (sev, why) in DEFAULTS.items()]
    return "\n".join(lines)


#: what `GradLogger(policy=...)`, `gradlog.check(policy=...)` and `diff(policy=...)` accept
PolicyLike = Union[Policy, Mapping[str, str], Iterable[tuple[str, str]], None]
