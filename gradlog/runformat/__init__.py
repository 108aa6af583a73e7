"""The run format: the one owner of what a gradlog run writes and how it reads back.

`names` (every tag, table name, column list, sentinel and W&B key) and `cells` (the name cell, the
summary values) are the vocabulary: they import nothing of gradlog, so every stage, the training loop's
included, takes its names from here. `tables` holds the codecs between a `Report` and its tables (the
summary rows, each findings table, written and read back); `events` and `files` read a run's event
files back safely, so that a resumed run (gradlog/resume.py) reads its earlier segment through this
package rather than through the readers.

This `__init__` imports nothing: importing `gradlog.runformat.names` must not pull in the codecs.
"""
