"""A run: the logger and its parts, wiring the measuring, the writers and the verdict into one training run.

`logger` (`GradLogger`, the API), `options` (its option objects), `measuring` (the step hooks and the
measured-step path: statistics on the device, one host copy, the ledger), `diagnosing` (the `Report` from
that evidence), `publishing` (records and tables to the writers), `resume` (a run continued by a new
process), `lifecycle` (the end of a run that never reaches `close()`: atexit, SIGTERM, forks) and `check`
(`gradlog.check`: one step before training). Data flows that way: `logger` drives the others.
"""
