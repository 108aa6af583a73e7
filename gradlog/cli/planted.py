"""The demo's planted bugs in words, without importing torch (`gradlog --help` stays fast)."""

from __future__ import annotations

#: the bugs `build` plants, in the words README and `gradlog demo --help` use (one place, so they agree)
PLANTED = (
    "a layer frozen by mistake a third of the way in",
    "an unused head",
    "a layer left out of the optimizer",
    "an embedding half of whose ids never occur in a batch",
    "a layer whose lr a scheduler cuts to 0 halfway",
)
NUMBERS = ("no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


def planted_summary() -> str:
    """ "five planted bugs": the count in words, from `PLANTED`."""
    n = len(PLANTED)
    return f"{NUMBERS[n] if n < len(NUMBERS) else n} planted bug{'s' if n != 1 else ''}"
