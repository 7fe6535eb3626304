"""The step timer: wall-clock laps that are honest on GPUs too.

On CUDA, kernels run asynchronously; a lap taken without synchronizing would charge the
forward pass's work to whatever comes next. :class:`Stopwatch` synchronizes the device before
reading the clock when it times a CUDA device, and costs one ``perf_counter`` call otherwise.
"""

from __future__ import annotations

import time

import torch


class Stopwatch:
    """Laps in seconds since the previous lap (or since :meth:`start`).

    Args:
        device: the training device; CUDA devices are synchronized before each reading.
    """

    def __init__(self, device: torch.device | str = "cpu"):
        self.sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else None
        self._last = time.perf_counter()

    def start(self) -> None:
        if self.sync:
            self.sync()
        self._last = time.perf_counter()

    def lap(self) -> float:
        """Seconds since the last lap (float, >= 0)."""
        if self.sync:
            self.sync()
        now = time.perf_counter()
        elapsed, self._last = now - self._last, now
        return elapsed
