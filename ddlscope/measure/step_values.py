"""A step's loss and top-1 hits, read from the device in groups of steps.

Reading the loss and hits of every step costs the training loop host time on a GPU, where the
step is often bound by how fast the host issues kernels: counting the hits, converting and
stacking the values and copying them to the host were about ten more launches per step, and
on an NVIDIA H200 they made ResNet-18/CIFAR-10 b256 about 1 ms per step slower (7 % of a
14 ms step; issue 16, docs/validation.md). So a step only keeps its loss (a 0-dim tensor) and
its predicted classes (``argmax``, one launch) on the device (:class:`DeviceValues`), and a
:class:`ValuesInFlight` counts the hits of a whole group of steps at once and copies their
values into pinned host memory without waiting for the device; they are read once the copy is
done. Every step still gets its own loss and accuracy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ddlscope.workloads.step import hit_counts


@dataclass
class DeviceValues:
    """One step's loss and predictions, left on the device until a group of steps reads them.

    Attributes:
        loss: the step's mean loss, a 0-dim tensor (detached).
        predicted: top-1 classes, ``[batch]`` (class logits) or ``[batch, T]`` (per-position logits).
        target: the labels, the same shape as ``predicted``; positions equal to
            :data:`~ddlscope.workloads.step.IGNORE_INDEX` are not scored.
    """

    loss: torch.Tensor
    predicted: torch.Tensor
    target: torch.Tensor

    @classmethod
    def of(cls, loss: torch.Tensor, logits: torch.Tensor, target: torch.Tensor) -> "DeviceValues":
        """From a step's loss, its logits ``[batch, classes]`` or ``[batch, T, classes]`` and its targets
        (one ``argmax`` launched; nothing waits for the device)."""
        return cls(loss.detach(), logits.detach().argmax(-1), target.detach())


class ValuesInFlight:
    """The loss, hits and scored predictions of a group of steps, computed on the device and being
    copied to the host (pinned memory, non-blocking; a CUDA event marks the copy's end).

    Args:
        values: the steps' :class:`DeviceValues`, all on one device. Steps whose predictions
            differ in shape are counted in separate launches (normally there is one shape).

    :meth:`reached` says whether reading them would wait; :meth:`read` returns
    ``[(loss, correct, scored)]`` in the steps' order (floats; counts exact below 2^24 positions).
    """

    def __init__(self, values: Sequence[DeviceValues]):
        self.count = len(values)
        self._event: Any = None
        self._parts: list[tuple[list[int], torch.Tensor]] = []
        by_shape: dict[tuple, list[int]] = {}
        for i, v in enumerate(values):
            by_shape.setdefault(tuple(v.predicted.shape), []).append(i)
        for indices in by_shape.values():
            part = [values[i] for i in indices]
            losses = torch.stack([v.loss.float() for v in part])
            hits, scored = hit_counts(torch.stack([v.predicted for v in part]).flatten(1),
                                      torch.stack([v.target for v in part]).flatten(1), dim=1)
            self._parts.append((indices, torch.stack((losses, hits.float(), scored.float()), 1)))
        device = values[0].loss.device if values else torch.device("cpu")
        if device.type == "cuda":
            copied = []
            for indices, on_device in self._parts:
                host = torch.empty(on_device.shape, dtype=on_device.dtype, pin_memory=True)
                host.copy_(on_device, non_blocking=True)
                copied.append((indices, host))
            self._parts = copied
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(device))

    def reached(self) -> bool:
        """True when :meth:`read` would not wait for the device."""
        return self._event is None or self._event.query()

    def read(self) -> list[tuple[float, float, float]]:
        """``[(loss, correct, scored)]`` per step, in the order given; waits for the copy on a GPU."""
        if self._event is not None:
            self._event.synchronize()
        out: list[Any] = [None] * self.count
        for indices, host in self._parts:
            for i, row in zip(indices, host.tolist()):
                out[i] = tuple(row)
        return out

