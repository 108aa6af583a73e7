"""Every name a gradlog run writes: tags, tables, their columns, sentinels, W&B keys, the run-file mark.

Writers, readers, the TensorBoard tab and the health view all take their names from here, so a name
changed here changes everywhere at once and a reader never lacks a row a writer writes. The tag layout
(why `weights/` and `gradlog/`) is explained in `gradlog.runformat.tags`.
"""

from __future__ import annotations

# --- groups ------------------------------------------------------------------------------------------
#: The group every per-tensor series is written under (`weights/<metric>/<tensor name>`).
TENSORS = "weights/"
#: The run-level group: series, tables and records of the whole run (spelled out below, so a grep finds them).
RUN = "gradlog/"

# --- run-level series (one value per measured step) -------------------------------------------------
GRAD_NORM_TOTAL = "gradlog/grad_norm_total"
NONFINITE_TENSORS = "gradlog/nonfinite_tensors"
NO_GRAD_TENSORS = "gradlog/no_grad_tensors"
NO_UPDATE_TENSORS = "gradlog/no_update_tensors"
ZERO_GRAD_TENSORS = "gradlog/zero_grad_tensors"
UPDATE_RATIO_MIN = "gradlog/update_ratio_min"
UPDATE_RATIO_MEDIAN = "gradlog/update_ratio_median"
UPDATE_RATIO_MAX = "gradlog/update_ratio_max"
CLIP_COEF = "gradlog/clip_coef"
SKIPPED_STEPS = "gradlog/skipped_steps"
#: Alerts fired so far (a series), and the `ALERTS` table at close: the same name.
ALERT_COUNT = "gradlog/alerts"
#: The overview image (TensorBoard's Images tab, a `wandb.Image`).
OVERVIEW = "gradlog/overview"

# --- tables (written at close, and provisionally during training) ------------------------------------
SUMMARY = "gradlog/summary"
ALERTS = ALERT_COUNT
POLICY = "gradlog/policy"
#: A resumed run's per-tensor record (gradlog/run/resume.py).
SEGMENT = "gradlog/segment"
#: The tables of the run as a whole, beside the findings' (`finding_table`).
TABLES = (SUMMARY, ALERTS, POLICY, SEGMENT)


def finding_table(kind: str) -> str:
    """The table of a kind of finding: `gradlog/<kind>` (the record's `KIND`, `gradlog.verdict.records`), so a
    kind added later names its table by declaring its kind, and every reader takes it (`is_table`)."""
    return RUN + kind


def is_table(name: str) -> bool:
    """Whether a table of that name is gradlog's: one of `TABLES`, or a finding's (`gradlog/<kind>`, one word)."""
    kind = name.removeprefix(RUN)
    return name in TABLES or (kind != name and kind.isidentifier())


#: The findings tables every run has written, by their kinds; the counts of the first three are written at close.
NEVER_UPDATED = finding_table("never_updated")
PARTLY_UPDATED = finding_table("partly_updated")
STALLED = finding_table("stalled")
#: The scalars written once at close (how many rows each table has), and `<table>/<reason>` per reason.
COUNTED_TABLES = (NEVER_UPDATED, PARTLY_UPDATED, STALLED)

#: The answer so far, written on histogram steps: `gradlog/provisional/<name>` for each `gradlog/<name>`.
PROVISIONAL_PREFIX = "gradlog/provisional/"


def provisional(table: str) -> str:
    """The provisional name of a final table: `gradlog/stalled` -> `gradlog/provisional/stalled`."""
    return PROVISIONAL_PREFIX + table.removeprefix(RUN)


def final(provisional_table: str) -> str:
    """The final name of a provisional table: `gradlog/provisional/stalled` -> `gradlog/stalled`."""
    return RUN + provisional_table.removeprefix(PROVISIONAL_PREFIX)


#: Tables for gradlog's readers only, hidden from TensorBoard's Text tab (a card of every tensor name).
HIDDEN_TABLES = (SEGMENT, provisional(SEGMENT))
#: TensorBoard keeps one kind of data per tag: a table whose name a scalar already holds is tagged
#: `<name>/table` (gradlog's writer); torch's `SummaryWriter.add_text` appends `/text_summary`.
TABLE_SUFFIX = "/table"
TEXT_SUFFIXES = (TABLE_SUFFIX, "/text_summary")

# --- columns ---------------------------------------------------------------------------------------
SUMMARY_COLUMNS = ["key", "value"]
#: The findings tables' columns are their records' (`gradlog.verdict.records`: one codec for every kind).
#: The user's policy rules, in order.
POLICY_COLUMNS = ["kind", "pattern", "severity"]
#: The per-tensor counters a segment passes on to the next (`gradlog.verdict.ledger.Evidence`'s, summed over
#: every segment so far), so that a resumed run's records count the whole run.
SEGMENT_COUNTS = (
    "measured",
    "grad_none",
    "grad_zero",
    "grad_nonfinite",
    "grad_ok",
    "lr_zero",
    "skipped",
    "stalled",
    "updated",
    "frozen_steps",
    "frozen_sum",
    "frozen_max",
)
SEGMENT_COLUMNS = ["name", "shape", "last_update_step", *SEGMENT_COUNTS]

# --- the summary table's keys, in the order the report writes them -----------------------------------
VERDICT = "verdict"
#: Every key the summary may hold (`tables.summary_rows`, the resume rows): W&B keeps each as
#: `gradlog/<key>` in run.summary, and its reader takes exactly these back.
SUMMARY_KEYS = (
    VERDICT,
    "status",
    "healthy",
    "optimizer_steps",
    "measured_steps",
    "skipped_steps",
    "tracked_tensors",
    "warnings",
    "notes",
    "hint",
    "first_nonfinite_step",
    "first_nonfinite_tensor",
    "first_nonfinite_count",
    "error",
    "final",
    "as_of_step",
    "scope",
    "run_id",
    "segment",
    "segment_first_step",
)

# --- TensorBoard ------------------------------------------------------------------------------------
#: Tensor names in model order, one per line (gradlog's own plugin; the gradlog tab reads it).
ORDER_TAG = "gradlog/tensor_order"
#: Per-step packed rows for the gradlog tab: `gradlog/heatmap/<block>`, PACK_BLOCK steps per tag, a
#: float32 tensor [len(PACKED), tensors]; PACK_MISSING where a tensor has no value (real ones are >= 0).
PACK_TAG = "gradlog/heatmap/"
PACKED = ("update_ratio", "grad_norm", "grad_zero_frac", "grad_nonfinite")
PACK_BLOCK = 10
PACK_MISSING = -1.0
#: Event file names end in `.<RUN_MARK><run id>`: the files of one writer (one run) share it.
RUN_MARK = "gradlog-run-"
#: The plugin name of gradlog's own TensorBoard records (tensor order, packed rows, hidden tables).
PLUGIN_NAME = "gradlog"

# --- W&B --------------------------------------------------------------------------------------------
#: gradlog's x-axis in W&B (W&B's own step is shared with the user's `wandb.log`).
STEP_KEY = "gradlog/step"
#: Tables logged under another key (`gradlog/never_updated_table`, ...), because the plain name already holds
#: a value in the W&B run summary: the count (never_updated, ...) or a summary row (`segment`). A table
#: logged under such a key would be hidden in W&B's run table by the value written after it.
WANDB_TABLE_KEYS = {name: name + "_table" for name in (NEVER_UPDATED, PARTLY_UPDATED, STALLED, ALERTS, SEGMENT)}
#: run-summary key of the records dropped because the writer fell behind (absent when none were).
DROPPED_KEY = "gradlog/dropped_records"
#: run.config key of the tensor names in model order (a history row's keys come in arbitrary order).
ORDER_KEY = ORDER_TAG


def summary_key(key: str) -> str:
    """The run-summary key of a summary-table row: `verdict` -> `gradlog/verdict`."""
    return RUN + key
