"""Stage 2, beside the writers: evidence over the run, the diagnosis at close, and the `Report`.

`ledger` (per-tensor counters and fingerprints), `diagnosis` (one reason per tensor), `alerts`
(findings during training), `report` (the `Report` and its tables). Imports `gradlog.measure` and `gradlog.runformat`.
"""
