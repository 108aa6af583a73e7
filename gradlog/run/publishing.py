"""Publishing: a measured step's records, and the report's tables (final, or provisional), to the writers.

The logger decides *what* the answer is (`Report`); this module decides how it is written: the per-step
scalars and histograms, the overview image, the three tables with their summary, and the provisional
copies (`gradlog/provisional/<name>`) that a run killed with ``kill -9`` leaves behind.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

from gradlog.measure.distributed import DistributedMismatchError
from gradlog.measure.meter import Measurement
from gradlog.measure.once import WarnOnce
from gradlog.run.lifecycle import describe, warn
from gradlog.runformat import names, tags
from gradlog.verdict.report import Report
from gradlog.verdict.series import run_level
from gradlog.verdict.tables import final_counts, report_tables, sparse_tables, summary_rows
from gradlog.writers import Writer
from gradlog.writers.guard import GuardedWriters
from gradlog.writers.overview import TAG as OVERVIEW_TAG
from gradlog.writers.overview import Overview

__all__ = ["Failures", "Publisher"]


class Failures:
    """Warn once per distinct failure: a failing step must not flood the log, nor go unsaid."""

    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self.once = WarnOnce()

    def handle(self, exc: Exception, message: Callable[[str], str]) -> None:
        """Re-raise in strict mode; otherwise warn `message(key)` the first time this failure is seen."""
        if self.strict:
            raise exc
        key = describe(exc)
        if key not in self.once.seen:  # the message is built only for a failure not seen before
            self.once(key, message(key), stacklevel=3)


class Publisher:
    """Writes what the logger measured and concluded; never raises for a writer (see `GuardedWriters`)."""

    def __init__(
        self,
        writers: GuardedWriters,
        overview: Overview,
        provisional_every: float | None,
        failures: Failures,
        segment: Callable[[], tuple[list[list[str]], list[list[str]]]] | None,
    ) -> None:
        self.writers = writers
        self.overview = overview
        self.provisional_every = provisional_every
        self.failures = failures
        self._provisional_at: float | None = None  # monotonic time of the last provisional table
        #: (summary rows, `gradlog/segment` rows) written with every report: what a resumed run reads back
        self.segment = segment
        self._sparse_tables: set[tuple[str, bool]] = set()  # (name, final) of the tables written only when non-empty

    # --- every published step ---------------------------------------------------------------
    def step(
        self,
        m: Measurement,
        step: int,
        extra: dict[str, float],
        histogram_step: bool,
        provisional: Callable[[], Report | None],
    ) -> None:
        """The step's scalars (with the run-level series and `extra`), histograms and overview; on
        `histogram_step`s, at most every `provisional_every` seconds, the provisional tables as of now."""
        if not self.writers.writers:
            return
        scalars = m.scalars()
        scalars.update(run_level(m))
        scalars.update(extra)
        self.writers.log_scalars(scalars, step)
        for kind, hists in m.histograms.items():
            self.writers.log_histograms([tags.tag(kind, m.rows[pos].name) for pos in hists.positions], hists, step)
        if self.overview.every != 0:
            self._overview(m, step, histogram_step)
        due = histogram_step and self._provisional_due()
        if due:
            report = provisional()
            if report is not None:
                self.report(report, provisional_step=step)
        self.writers.flush()
        if due:  # the provisional answer is what a kill -9 leaves: handed over before training goes on
            self.writers.sync()

    def attempt(self, diagnose: Callable[[], Report]) -> Report | None:
        """A provisional answer (`diagnose()`), or None when it failed: a provisional answer is a bonus
        and never costs the step (a distributed mismatch still raises)."""
        try:
            return diagnose()
        except DistributedMismatchError:
            raise
        except Exception as exc:
            self.failures.handle(
                exc,
                lambda key: f"gradlog: the provisional never-updated table failed ({key}); training continues",
            )
            return None

    def _overview(self, m: Measurement, step: int, histogram_step: bool) -> None:
        """Record the step for the overview image; hand over images the drawing thread finished; start the
        next drawing when due. Any failure here costs the image, never the step."""
        try:
            self.overview.observe(m, step)
            for at, png in self.overview.take():
                self.writers.log_image(OVERVIEW_TAG, png, at)
            if self.overview.due(histogram_step):
                self.overview.start(self.overview.live_marks())
        except Exception as exc:
            self.failures.handle(exc, lambda key: f"gradlog: the overview image failed ({key}); training continues")

    def _provisional_due(self) -> bool:
        """At most every `provisional_every` seconds: the only cost on the training path outside the
        wall-time gate is one clock read."""
        if self.provisional_every is None:
            return False
        now = time.monotonic()
        if self._provisional_at is not None and now - self._provisional_at < self.provisional_every:
            return False
        self._provisional_at = now
        return True

    # --- the report ---------------------------------------------------------------------------
    def report(
        self,
        report: Report,
        provisional_step: int | None = None,
        step: int = 0,
        rank_local: bool = False,
    ) -> None:
        """The three tables (never updated, partly updated, stalled), their counts, and the summary whose
        verdict is the judge's (`gradlog.verdict.judge`), the same line close() prints: final (at x =
        `step`), or provisional (`gradlog/provisional/<name>`, with `final`=False and `as_of_step` in its
        summary) as of `provisional_step`. Every table goes through `out`, so a table added here is
        written in both forms."""
        out: Writer = self.writers if provisional_step is None else _Provisional(self.writers)
        if provisional_step is None:
            self.writers.log_scalars(final_counts(report), step)
        summary = summary_rows(report, provisional_step, rank_local)
        segment = self._segment()
        if segment is not None:  # what a resumed run reads back (gradlog/run/resume.py)
            summary += segment[0]
        out.log_table(names.SUMMARY, names.SUMMARY_COLUMNS, summary)
        sparse = sparse_tables()
        for name, (columns, rows) in report_tables(report).items():
            if name in sparse:  # written once non-empty, then always (`verdict.tables.sparse_tables`)
                key = (name, provisional_step is None)
                if not rows and key not in self._sparse_tables:
                    continue
                self._sparse_tables.add(key)
            out.log_table(name, columns, rows)
        if segment is not None:
            out.log_table(names.SEGMENT, names.SEGMENT_COLUMNS, segment[1])
        if provisional_step is None and self.overview.every != 0 and self.overview.steps:
            self._final_overview(report)

    def _segment(self) -> tuple[list[list[str]], list[list[str]]] | None:
        """The segment rows, or None; failing to make them costs them, never the tables."""
        if self.segment is None:
            return None
        try:
            return self.segment()
        except Exception as exc:
            self.failures.handle(exc, lambda key: f"gradlog: the gradlog/segment table failed ({key})")
            return None

    def _final_overview(self, report: Report) -> None:
        """The last image, with the diagnosis's findings marked (drawn here: training is over)."""
        try:
            self.overview.wait()
            self.overview.take()  # an image still being drawn is superseded by this one (all steps, final marks)
            marks = self.overview.live_marks()
            if report.first_nonfinite is not None:
                marks[report.first_nonfinite.name] = "nonfinite"
            for kind, records in (
                ("partly_updated", report.partly_updated),
                ("stalled", report.stalled),
                ("never_updated", report.never_updated),
            ):
                for rec in records:
                    marks[rec.name] = kind
            self.writers.log_image(OVERVIEW_TAG, self.overview.draw(marks), self.overview.steps[-1])
        except Exception as exc:
            if self.failures.strict:
                raise
            warn(f"gradlog: the final overview image failed ({describe(exc)})")

    def print_final(self, report: Report) -> None:
        """Where the files went, then the report: the verdict stays the last line of the output."""
        where = self.where()
        if where:
            print(where, file=sys.stdout, flush=True)
        print(report.table(), file=sys.stdout, flush=True)

    def where(self) -> str | None:
        """Where this run's files went, and the commands that read them (None for memory-only writers)."""
        lines = []
        for w in self.writers.writers:
            try:  # a writer of one's own with a bug here must not cost the run its report
                line = w.where()
            except Exception as exc:
                if self.failures.strict:
                    raise
                warn(f"gradlog: {type(w).__name__}.where() failed ({describe(exc)}); where its files are is not shown")
                continue
            if line:
                lines.append(str(line))
        return "\n".join(lines) or None


class _Provisional(Writer):
    """Routes the report's tables to `gradlog/provisional/<name>`; scalars are final-only."""

    inline = True

    def __init__(self, inner: Writer) -> None:
        self.inner = inner

    def log_scalars(self, scalars: Any, step: int) -> None:
        pass

    def log_histogram(self, tag: str, hist: Any, step: int) -> None:
        pass

    def log_histograms(self, tags: Any, hists: Any, step: int) -> None:
        pass

    def log_table(self, name: str, columns: Any, rows: Any) -> None:
        self.inner.log_table(names.provisional(name), columns, rows)
