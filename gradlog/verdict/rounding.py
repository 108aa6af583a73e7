"""Why a value with a non-zero gradient and lr > 0 never moved: the same fact means two things by dtype.

In bf16/fp16 (and 8-bit floats) an ordinary update is below the value's resolution (bf16 keeps 8 bits:
1e-3 of the value rounds away): the weights are stale, a problem with a fix (fp32 master weights).
In fp32/fp64 an update rounds away only below ~6e-8 of the value, which no ordinary gradient gives: the
gradient was numerically zero (rounding noise, ~1e-11 on an attention key bias, which softmax ignores)
or the lr was far too small. The reason says which dtype it was, so a policy can weigh the two apart.
"""

from __future__ import annotations

from gradlog.verdict.report import Reason

#: dtypes (as `Evidence.dtype` spells them) whose resolution no ordinary update falls below: half their
#: epsilon, the smallest relative change that survives rounding
_FINE = {"float32": "6e-8", "complex64": "6e-8", "float64": "1e-16", "complex128": "1e-16"}


def unmoved(dtype: str) -> tuple[Reason, str]:
    """The reason for "non-zero gradient, lr > 0, value never changed" in `dtype`, and the words that
    explain it (they follow "yet the <dtype> value(s) never changed: ")."""
    if dtype in _FINE:
        return Reason.TINY_UPDATE, (
            f"every update was below the value's resolution (~{_FINE[dtype]} of it): the gradient is numerically "
            "zero (the loss hardly depends on it, as on an attention key bias) or the lr far too small"
        )
    return Reason.BELOW_PRECISION, "the update is below the dtype's precision (keep fp32 master weights, or raise lr)"
