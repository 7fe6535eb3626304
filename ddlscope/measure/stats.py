"""Timing repeats and reducing them to one figure: the statistics every measurement shares.

The profiler (:mod:`ddlscope.profiling.profile`), the calibration (:mod:`ddlscope.profiling.calibrate`),
its hivemind swarm (:mod:`ddlscope.profiling.swarm`) and the data-pipeline benchmark
(:mod:`ddlscope.datapipe.measure`) time a callable a number of times and keep one figure:

* :func:`trimmed_mean` where the figure is summed later (a prediction adds many collectives or
  epochs, so it needs the mean; the trimming drops single wild repeats such as a preemption);
* the median (:func:`statistics.median`) of :func:`time_repeats` for a step's typical time;
* the minimum of :func:`time_repeats` for a kernel's best time (microbenchmarks, layers).

No torch here: a device is synchronised by the ``sync`` callable the caller passes.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

TRIM = 0.1
"""Default fraction of repeats :func:`trimmed_mean` cuts from each end."""


def trimmed_mean(values: Sequence[float], trim: float = TRIM) -> float:
    """The mean of ``values`` after cutting ``int(trim * n)`` of them from each end of the sorted list.

    What ``scipy.stats.trim_mean(values, trim)`` computes; written out so that measuring
    processes need not import scipy. With ``trim = 0.1`` one wild value in ten is cut.

    Raises:
        ValueError: ``values`` is empty, or ``trim`` is not in ``[0, 0.5)``.
    """
    if not 0 <= trim < 0.5:
        raise ValueError(f"trim {trim!r}; allowed: 0 <= trim < 0.5")
    if not values:
        raise ValueError("trimmed_mean of no values")
    ordered = sorted(values)
    cut = int(trim * len(ordered))
    return statistics.fmean(ordered[cut:len(ordered) - cut])


def time_call(fn: Callable[[], Any], sync: Callable[[], None] | None = None) -> float:
    """Wall-clock seconds of one call of ``fn`` (:func:`time.perf_counter`).

    ``sync`` (e.g. a CUDA synchronise) is called before the clock starts and before it stops, so
    that asynchronous device work launched by ``fn`` is inside the figure and earlier work is not.
    """
    if sync is not None:
        sync()
    start = time.perf_counter()
    fn()
    if sync is not None:
        sync()
    return time.perf_counter() - start


def time_repeats(fn: Callable[[], Any], repeats: int, warmup: int = 0,
                 sync: Callable[[], None] | None = None) -> list[float]:
    """Seconds of ``repeats`` calls of ``fn`` (:func:`time_call`) after ``warmup`` untimed calls.

    Raises:
        ValueError: ``repeats < 1`` or ``warmup < 0``.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats {repeats}, warmup {warmup}; allowed: repeats >= 1, warmup >= 0")
    for _ in range(warmup):
        fn()
    return [time_call(fn, sync) for _ in range(repeats)]
