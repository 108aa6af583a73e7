"""The run format: the one owner of what a gradlog run writes and how it reads back.

`names` (every tag, table name, column list, sentinel and W&B key), `tags` (the per-tensor tag layout),
`cells` (the name cell, shapes, slice dims, summary values), `markdown` (the tables TensorBoard shows, and
their inverse), `tfevents` (TFRecord framing, written and read), `files` (safe reads of an untrusted run
folder), `points` and `rundata` (a run read back) and `tb_run` (a TensorBoard run's event files read back)
import nothing of gradlog above this package: every stage, the training loop's included, takes its names
from here. `tables` holds the codecs between a `Report` and its tables (the summary rows, each findings
table, written and read back); it sits above `gradlog.verdict`, whose records it builds. A resumed run
(gradlog/run/resume.py) reads its earlier segment through `tb_run` and `tables`, never through the readers.

This `__init__` imports nothing: importing `gradlog.runformat.names` must not pull in the codecs.
"""
