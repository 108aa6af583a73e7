"""Stage 2, beside the writers: evidence over the run, the diagnosis at close, and the `Report`.

`ledger` (per-tensor counters and fingerprints), `diagnosis` (one reason per tensor), `alerts`
(findings during training), `report` (the records and the `Report`), `tables` (the `Report` written as
the run's tables and rebuilt from them). Imports `gradlog.measure` and the run format's vocabulary
(`gradlog.runformat`), nothing above them.
"""
