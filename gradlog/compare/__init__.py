"""Answers without an instrumented run: comparing checkpoints you already have (`gradlog diff`)."""
