"""Stage 1, inside the optimizer step: which tensors, their names, and their statistics on the device.

`params` (the parameter table and clean names), `optimizers` (which optimizer's hooks fire),
`meter` (one measured step: device statistics in, one host copy out), `stats` (fused `_foreach_*`
statistics), `histogram`, `fingerprint` (per-slice never-changed without a copy), `slice_grads`
(per-slice gradient evidence and dead_frac), `amp` (GradScaler), `tags` (the names series are written under),
`distributed` (reductions over shards and ranks). Imports nothing else of gradlog.
"""
