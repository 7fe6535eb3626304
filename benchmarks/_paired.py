"""Reading paired repeats against a target: the benchmarks that compare ddlscope with the plain tool.

On a shared machine one repeat of either side can move by more than the gap the target allows
(the development machine's repeats of one plain loop spread by 10-30 %). The benchmarks therefore
run the two sides next to each other, in turns which goes first, read each pair as one figure (a
ratio, or an overhead fraction), and give the median pair with a distribution-free confidence
interval. A target is met or missed only when the whole interval is on one side of it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

CONFIDENCE = 0.95


def median_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float] | None:
    """A distribution-free confidence interval of the median of ``values``.

    The order statistics ``(x_(k), x_(n+1-k))`` of the sorted values, with the largest ``k`` whose
    coverage ``1 - 2 P(B < k)``, ``B ~ Binomial(n, 1/2)``, is at least ``confidence`` (the sign-test
    interval: Conover 1999, *Practical Nonparametric Statistics*, sec. 3.2). It assumes only that
    the values are independent draws of one distribution.

    Returns:
        ``(low, high)`` in the values' unit, or None when ``n`` is too small for the confidence
        (at 95 %: fewer than 6 values).

    Raises:
        ValueError: ``confidence`` not in (0, 1).

    >>> median_interval([5, 1, 4, 2, 3, 6, 9, 8, 7])
    (2, 8)
    >>> median_interval([1, 2, 3, 4, 5]) is None
    True
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence {confidence}; allowed: 0 < confidence < 1")
    xs, n = sorted(values), len(values)
    k, below = 0, 0.0  # below: P(B < k + 1), summed as k grows
    while k < n // 2:
        below += math.comb(n, k) / 2 ** n
        if 1 - 2 * below < confidence:
            break
        k += 1
    return (xs[k - 1], xs[n - k]) if k else None


def verdict(interval: tuple[float, float] | None, target: float, at_least: bool = False) -> str:
    """``met``, ``missed`` or ``unsettled``: where the interval lies against ``target``.

    Args:
        interval: from :func:`median_interval`, or None (too few pairs: unsettled).
        target: the bound, in the interval's unit.
        at_least: the figure should be at least ``target`` (a throughput ratio); else under it (an
            overhead).

    >>> verdict((-0.01, 0.015), 0.02), verdict((0.97, 1.02), 0.97, at_least=True)
    ('met', 'met')
    """
    if interval is None:
        return "unsettled"
    low, high = interval
    if at_least:
        return "met" if low >= target else "missed" if high < target else "unsettled"
    return "met" if high < target else "missed" if low >= target else "unsettled"


def interval_text(interval: Sequence[float] | None, spec: str) -> str:
    """``"low .. high"`` formatted with ``spec`` (e.g. ``"+.1%"``), or ``"too few pairs"``."""
    return f"{format(interval[0], spec)} .. {format(interval[1], spec)}" if interval else "too few pairs"
