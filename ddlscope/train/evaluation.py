"""Held-out evaluation: accuracy and mean cross-entropy loss of a model on a loader."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

from ddlscope.workloads.step import loss_function, prediction_counts


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: DataLoader, device: torch.device, max_samples: int | None = None
             ) -> tuple[float, float, int]:
    """Accuracy (0..1), mean training loss (:func:`~ddlscope.workloads.step.loss_function`) and number of samples of ``model`` on ``loader``.

    Accuracy and loss are over the scored predictions: one per sample for class logits; for
    per-position logits ``[batch, T, classes]`` every position whose target is not
    :data:`~ddlscope.workloads.step.IGNORE_INDEX` (e.g. the masked bytes of a text window).

    Args:
        loader: yields ``(images [batch, C, H, W], labels [batch])`` or ``(inputs [batch, T],
            targets [batch, T])``.
        max_samples: stop after the batch that reaches this many samples (None: the whole loader).

    Returns:
        ``(accuracy, mean loss, samples)``; ``(0.0, 0.0, samples)`` when nothing was scored.
    """
    was_training = model.training
    model.eval()
    correct, scored, loss_sum, seen = 0, 0, 0.0, 0
    summed_loss = loss_function("sum")
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        logits = model(x)
        loss_sum += summed_loss(logits, y).item()
        hits, counted = torch.stack(prediction_counts(logits, y)).tolist()
        correct, scored = correct + hits, scored + counted
        seen += len(y)
        if max_samples is not None and seen >= max_samples:
            break
    model.train(was_training)
    return correct / max(scored, 1), loss_sum / max(scored, 1), seen
