"""The step timer: laps that are honest on GPUs without stalling them.

On CUDA, kernels run asynchronously; a lap read from the host clock without synchronizing would
charge the forward pass's work to whatever comes next, and synchronizing at every lap stalls the
GPU while the host prepares the next phase (measured on an H100: +11..+44 % per step, issue 16).
So on CUDA a :class:`Stopwatch` records a ``torch.cuda.Event(enable_timing=True)`` at each phase
boundary, on the current stream, and never synchronizes while marking; a :class:`Lap` is turned
into seconds later (:meth:`Lap.seconds`), which waits for the lap's *end* event only, and costs
nothing once the GPU has passed it (the training loop reads a group of steps' laps once the GPU
is past them). The
seconds are the GPU's time between the two events (``torch.cuda.Event.elapsed_time``, ms / 1000):
the time the stream took to get from one boundary to the next, including time it sat idle
waiting for the host. On other devices laps are ``time.perf_counter`` differences.

The clock is pluggable (:class:`HostClock`, :class:`CudaEventClock`, or any object with their
four methods), so the CUDA logic can be tested on a CPU with a fake clock.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import torch


class Clock(Protocol):
    """Where a :class:`Stopwatch` reads time. A *mark* is an opaque point in time."""

    def mark(self) -> Any:
        """A point in time now (on a GPU: in the stream's order); must not wait for the device."""

    def wait(self, mark: Any) -> None:
        """Block until ``mark`` has been reached (the GPU has run everything queued before it)."""

    def reached(self, mark: Any) -> bool:
        """True when ``mark`` has been reached; never blocks."""

    def seconds_between(self, start: Any, end: Any) -> float:
        """Seconds from ``start`` to ``end``; both must have been reached."""


class HostClock:
    """``time.perf_counter`` marks: reached as soon as they are taken."""

    def mark(self) -> float:
        return time.perf_counter()

    def wait(self, mark: float) -> None:
        pass

    def reached(self, mark: float) -> bool:
        return True

    def seconds_between(self, start: float, end: float) -> float:
        return end - start


class CudaEventClock:
    """CUDA events recorded on the device's current stream (``enable_timing=True``).

    Args:
        device: the CUDA device whose current stream is marked.
    """

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)

    def mark(self) -> "torch.cuda.Event":
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def wait(self, mark: "torch.cuda.Event") -> None:
        mark.synchronize()

    def reached(self, mark: "torch.cuda.Event") -> bool:
        return mark.query()

    def seconds_between(self, start: "torch.cuda.Event", end: "torch.cuda.Event") -> float:
        return start.elapsed_time(end) / 1000.0  # elapsed_time is in milliseconds


def clock_for(device: torch.device | str) -> Clock:
    """:class:`CudaEventClock` for a CUDA device, :class:`HostClock` otherwise."""
    device = torch.device(device)
    return CudaEventClock(device) if device.type == "cuda" else HostClock()


class Lap:
    """One phase: the interval between two marks of a clock, turned into seconds on demand."""

    __slots__ = ("clock", "start", "end", "_seconds")

    def __init__(self, clock: Clock, start: Any, end: Any):
        self.clock, self.start, self.end, self._seconds = clock, start, end, None

    def reached(self) -> bool:
        """True when :meth:`seconds` would not block."""
        return self._seconds is not None or self.clock.reached(self.end)

    def seconds(self) -> float:
        """The lap in seconds (>= 0 up to the clock's resolution); on a GPU waits for its end mark."""
        if self._seconds is None:
            self.clock.wait(self.end)
            self._seconds = self.clock.seconds_between(self.start, self.end)
        return self._seconds


class Stopwatch:
    """Consecutive laps of the device's time: each from the previous lap's end (or :meth:`start`).

    Args:
        device: the training device; picks the clock (:func:`clock_for`) unless ``clock`` is given.
        clock: a :class:`Clock` to use instead (tests inject a fake one).

    :meth:`mark` ends a lap without waiting for the device (read it later with
    :meth:`Lap.seconds`); :meth:`lap` ends one and returns its seconds at once, which on a GPU waits
    for the work queued so far (for profilers, where that wait is wanted).
    """

    def __init__(self, device: torch.device | str = "cpu", clock: Clock | None = None):
        self.clock = clock if clock is not None else clock_for(device)
        self._last = self.clock.mark()

    def start(self) -> None:
        """Begin the next lap now."""
        self._last = self.clock.mark()

    def mark(self) -> Lap:
        """End the current lap and begin the next one; never waits for the device."""
        now = self.clock.mark()
        lap, self._last = Lap(self.clock, self._last, now), now
        return lap

    def lap(self) -> float:
        """End the current lap and return its seconds (float, >= 0); on a GPU waits for its end."""
        return self.mark().seconds()
