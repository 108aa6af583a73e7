"""How much a silence says: the bar every "stopped" claim built from measured steps must clear (issue 38).

A run is seen at its measured steps only, and much of a model is quiet by nature on many of them: a ReLU
unit that fires on 10% of steps, an expert few tokens pick, a branch taken now and then. Such a thing is
silent for 4, or 20, measured steps in a row all the time. So a slice or tensor that was active (a non-zero
gradient, a non-zero update) at c of the m measured steps up to its last active one, then silent at the n
after, is called stopped only when something active at random at a steady rate (whatever the rate: its
active steps exchangeable among the m + n) would show this with chance below `MAX_CHANCE`:

    C(m, c) / C(m + n, c)    (about (1 - p)^n for p = c / (m + n))

No rate is estimated: the chance is the same for every rate, so a unit seen active on one or two steps is
never enough evidence, and a unit active at 12 of 20 steps, then at none of 40, is (chance 9e-8). Where a
per-step signal proves the stop by itself (lr 0, requires_grad False, out of the optimizer), the claim
needs no such bar.
"""

from __future__ import annotations

import math

import torch

#: a claim is made only when a steady, randomly active thing would show its silence with a chance below this
MAX_CHANCE = 1e-3


def chance_silent(before: torch.Tensor, after: torch.Tensor, hits: torch.Tensor) -> torch.Tensor:
    """Per entry, C(before, hits) / C(before + after, hits): the chance that `hits` active steps, in a random
    order among `before + after`, all fall in the first `before` (float64, from log-gamma: no overflow)."""
    b, total, k = before.to(torch.float64), (before + after).to(torch.float64), hits.to(torch.float64)
    log = torch.lgamma(b + 1) - torch.lgamma(b - k + 1) - torch.lgamma(total + 1) + torch.lgamma(total - k + 1)
    return log.exp()


def chance(before: int, after: int, hits: int) -> float:
    """`chance_silent` of one thing (on the host: no tensor for a number)."""
    b, t, k = before, before + after, hits
    return math.exp(math.lgamma(b + 1) - math.lgamma(b - k + 1) - math.lgamma(t + 1) + math.lgamma(t - k + 1))


def steps(n: int) -> str:
    return f"{n} measured step{'s' if n != 1 else ''}"


def evidence_words(silent: int, seen: int, lo: int, hi: int, p: float, what: str, active: str = "active") -> str:
    """ "silent for 40 measured steps; active on 60% (12) of the 20 before; chance 9e-08 for a slice active at
    random at a steady rate (stopped: below 0.001)"; `lo`..`hi`: the active counts of a group."""
    pct = [f"{100 * k / max(seen, 1):.0f}%" for k in (lo, hi)]
    share = f"{pct[0]} ({lo})" if lo == hi else f"{pct[0]}-{pct[1]} ({lo}-{hi})"
    return (
        f"silent for {steps(silent)}; {active} on {share} of the {seen} before; chance {p:.1g} for {what} "
        f"{active} at random at a steady rate (stopped: below {MAX_CHANCE:g})"
    )
