"""Peak memory of a worker process."""

from __future__ import annotations

import resource

import torch


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory this worker used so far, in bytes.

    On a CUDA device: the peak of memory allocated to tensors (``torch.cuda.max_memory_allocated``).
    On CPU: the peak resident set size of the process (``getrusage(RUSAGE_SELF).ru_maxrss``, KiB on
    Linux), which also counts the Python interpreter and the torch libraries (a few hundred MiB).
    """
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
