"""Plots that stay readable for hundreds of runs: capped figure sizes, bars and legend entries.

A report over many runs keeps every run in its tables; its plots show at most :data:`MAX_BARS`
bars and :data:`MAX_LINES` labelled lines: the baseline, the runs a plot ranks first, and one
"others" entry standing for the rest (their mean for bars, thin grey lines for curves). Figures
are at most :data:`MAX_WIDTH_IN` x :data:`DPI` pixels wide.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")

DPI = 110
MAX_WIDTH_IN = 14.0
"""Widest figure, inches (1,540 px at :data:`DPI`)."""
MAX_BARS = 24
"""Bars (or bar groups) per plot, an "others" bar included."""
MAX_LINES = 10
"""Labelled lines per plot; the rest are drawn thin and grey under one legend entry."""


def bar_figure_width_in(bars: int, per_bar_in: float = 0.55, min_in: float = 6.0) -> float:
    """Figure width for ``bars`` bars: ``per_bar_in`` each plus margins, between ``min_in`` and :data:`MAX_WIDTH_IN`."""
    return min(MAX_WIDTH_IN, max(min_in, per_bar_in * bars + 2.0))


def top_with_others(items: Sequence[T], score: Callable[[T], float], keep: int, first: T | None = None
                    ) -> tuple[list[T], list[T]]:
    """Split ``items`` into those a plot shows and the rest.

    Args:
        items: everything there is, in display order.
        score: higher ranks first.
        keep: how many to show, ``first`` included (>= 1).
        first: shown first whatever its score (the baseline), if it is among ``items``.

    Returns:
        ``(shown, others)``: shown in ``items``' order with ``first`` leading; others empty when
        everything fits.
    """
    if len(items) <= keep:
        return list(items), []
    pinned = [first] if first is not None and any(i is first for i in items) else []
    rest = [i for i in items if i is not first]
    ranked = sorted(rest, key=score, reverse=True)[: keep - len(pinned)]
    chosen = {id(i) for i in ranked}
    return pinned + [i for i in rest if id(i) in chosen], [i for i in rest if id(i) not in chosen]
