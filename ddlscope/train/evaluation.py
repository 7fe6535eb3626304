"""Held-out evaluation: accuracy and mean cross-entropy loss of a model on a loader."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

from ddlscope.workloads.step import loss_function


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: DataLoader, device: torch.device, max_samples: int | None = None
             ) -> tuple[float, float, int]:
    """Accuracy (0..1), mean training loss (:func:`~ddlscope.workloads.step.loss_function`) and number of samples of ``model`` on ``loader``.

    Args:
        loader: yields ``(images [batch, C, H, W], labels [batch])``.
        max_samples: stop after the batch that reaches this many samples (None: the whole loader).
    """
    was_training = model.training
    model.eval()
    correct, loss_sum, seen = 0, 0.0, 0
    summed_loss = loss_function("sum")
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        logits = model(x)
        loss_sum += summed_loss(logits, y).item()
        correct += (logits.argmax(1) == y).sum().item()
        seen += len(y)
        if max_samples is not None and seen >= max_samples:
            break
    model.train(was_training)
    return correct / max(seen, 1), loss_sum / max(seen, 1), seen
