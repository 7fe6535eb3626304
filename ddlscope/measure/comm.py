"""Communication timing: when collectives and point-to-point transfers were in flight, and their bytes.

Strategies record one interval per collective (an all-reduce bucket, an all-gather, a
reduce-scatter) from the moment it is launched to the moment its future completes. Collectives
run on the backend's own threads (gloo) or streams (nccl), overlapping the backward pass, so
the time a step spent communicating is the *union* of those intervals, not their sum.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass


@dataclass
class CommStats:
    """What one step communicated.

    Attributes:
        comm_s: seconds during which at least one collective/transfer was in flight (union of
            intervals; overlapped with compute or not).
        comm_bytes: payload bytes handed to the collectives (per worker, input side).
        comm_calls: number of collectives/transfers.
    """

    comm_s: float = 0.0
    comm_bytes: int = 0
    comm_calls: int = 0


def union_length_s(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of ``[start, end]`` intervals (seconds); overlaps count once.

    >>> union_length_s([(0, 2), (1, 3), (5, 6)])
    4.0
    """
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


class CommTimer:
    """Collects communication intervals from any thread; :meth:`take` drains them per step.

    Use :meth:`launch` when a collective starts and the returned callback when it completes
    (e.g. from ``work.get_future().then(...)``), or :meth:`record` for a synchronous call.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._intervals: list[tuple[float, float]] = []
        self._bytes = 0
        self._calls = 0
        self.last_launch: float | None = None  # perf_counter of the latest launch
        self.last_done: float | None = None  # perf_counter of the latest completion

    def record(self, start: float, end: float, nbytes: int) -> None:
        """Add one finished transfer that ran from ``start`` to ``end`` (``time.perf_counter``)."""
        with self._lock:
            self._intervals.append((start, end))
            self._bytes += int(nbytes)
            self._calls += 1
            self.last_done = end if self.last_done is None else max(self.last_done, end)

    def launch(self, nbytes: int):
        """Mark a collective as launched now; returns ``done()`` to call when it completes."""
        start = time.perf_counter()
        self.last_launch = start

        def done(*_args):
            self.record(start, time.perf_counter(), nbytes)

        return done

    def peek(self) -> CommStats:
        """The stats since the previous :meth:`take`, without resetting them."""
        with self._lock:
            return CommStats(union_length_s(self._intervals), self._bytes, self._calls)

    def take(self) -> CommStats:
        """The stats since the previous call, and reset."""
        with self._lock:
            stats = CommStats(union_length_s(self._intervals), self._bytes, self._calls)
            self._intervals, self._bytes, self._calls = [], 0, 0
        return stats


def exposed_comm_s(compute_end: float, last_launch: float, backward_s: float, comm_s: float) -> float:
    """Seconds of a backward pass spent only waiting for communication: from the launch of the last
    collective (when the last gradients were ready) to the end of the backward pass (``compute_end``,
    ``time.perf_counter``), at most the backward pass and the time collectives were in flight.

    >>> exposed_comm_s(10.0, 9.5, 2.0, 1.0)
    0.5
    """
    return min(max(0.0, compute_end - last_launch), backward_s, comm_s)
