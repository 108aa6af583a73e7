"""Readers for files gradlog's writers produce, used by the tests and `gradlog report`."""

from __future__ import annotations
