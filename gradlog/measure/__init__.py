"""Stage 1, inside the optimizer step: which tensors, their names, and their statistics on the device.

`params` (the parameter table and clean names), `optimizers` (which optimizer's hooks fire),
`meter` (one measured step: device statistics in, one host copy out), `stats` (fused `_foreach_*`
statistics), `histogram`, `fingerprint` (per-slice never-changed without a copy), `slice_grads`
(per-slice gradient evidence and dead_frac), `amp` (GradScaler), `distributed` (reductions over shards and
ranks). Imports nothing else of gradlog but the run format's names (`gradlog.runformat`: the tags series are
written under).
"""
