"""The one training step: model, loss and the config's optimizer, shared by the training loop,
the profiler, the calibration, the hivemind swarm and the data-pipeline benchmark.

Whatever measures a step for a prediction trains it the way a run does: the same loss, the same
optimizer with the same hyperparameters (so an ``optimizer = "adam"`` run is profiled with Adam,
whose state is twice SGD-with-momentum's).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from ddlscope.config import RunConfig

OPTIMIZERS: tuple[str, ...] = ("sgd", "adam", "adamw")
"""Optimizers a run config may name (``RunConfig.optimizer``)."""

OptimizerName = Literal["sgd", "adam", "adamw"]


def build_optimizer(params, name: str = "sgd", learning_rate: float = 0.01, momentum: float = 0.9,
                    weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """The optimizer a run trains with.

    Args:
        params: the parameters (or parameter groups) to optimize.
        name: ``sgd`` (heavy-ball momentum ``momentum``; 0 gives plain SGD), ``adam`` or ``adamw``
            (betas 0.9, 0.999; ``momentum`` unused).

    Raises:
        ValueError: unknown name (config validation catches it earlier for users).
    """
    if name == "sgd":
        return torch.optim.SGD(params, lr=learning_rate, momentum=momentum, weight_decay=weight_decay)
    if name == "adam":
        return torch.optim.Adam(params, lr=learning_rate, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=learning_rate, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}; allowed: {', '.join(OPTIMIZERS)}")


def optimizer_for(cfg: "RunConfig", params) -> torch.optim.Optimizer:
    """:func:`build_optimizer` with a run config's optimizer and hyperparameters."""
    return build_optimizer(params, cfg.optimizer, cfg.learning_rate, cfg.momentum, cfg.weight_decay)


IGNORE_INDEX = -100
"""A target equal to this is not predicted: the loss and the accuracy leave its position out
(``torch.nn.CrossEntropyLoss``'s default ``ignore_index``; text datasets mark unmasked bytes with it)."""


def flatten_sequence(logits: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position logits ``[batch, T, classes]`` with targets ``[batch, T]`` as
    ``([batch * T, classes], [batch * T])``; class logits ``[batch, classes]`` with ``[batch]``
    unchanged. Views, no copies (reshape of contiguous tensors)."""
    if logits.dim() == 3 and y.dim() == 2:
        return logits.reshape(-1, logits.shape[-1]), y.reshape(-1)
    return logits, y


def prediction_counts(logits: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(correct, scored)``: 0-dim int64 tensors counting the top-1 hits and the predictions
    scored (positions whose target is not :data:`IGNORE_INDEX`), over class or per-position
    logits (see :func:`flatten_sequence`). Tensors, so reading them is the caller's sync."""
    logits, y = flatten_sequence(logits, y)
    return hit_counts(logits.argmax(-1), y)


def hit_counts(predicted: torch.Tensor, target: torch.Tensor, dim: int | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(correct, scored)``: top-1 hits of ``predicted`` classes against ``target`` (same shape) and
    the positions scored (target not :data:`IGNORE_INDEX`), summed over everything (int64 0-dim
    tensors) or along ``dim`` (e.g. ``[steps, n]`` -> ``[steps]`` each)."""
    scored = target != IGNORE_INDEX
    hits = (predicted == target) & scored
    return (hits.sum(), scored.sum()) if dim is None else (hits.sum(dim), scored.sum(dim))


def correct_samples(logits: torch.Tensor, y: torch.Tensor) -> float:
    """Correct predictions in samples' worth, so that ``correct_samples / batch`` is the accuracy.

    Class logits ``[batch, classes]``: the number of correctly classified samples (an integer).
    Per-position logits ``[batch, T, classes]`` with targets ``[batch, T]``: ``batch`` times the
    share of scored positions (targets not :data:`IGNORE_INDEX`) predicted right; 0 when none
    is scored.
    """
    correct, scored = torch.stack(prediction_counts(logits, y)).tolist()  # one device sync
    return correct_in_samples(correct, scored, logits.dim() > 2, y.shape[0])


def correct_in_samples(correct: int, scored: int, per_position: bool, batch: int) -> float:
    """:func:`prediction_counts` read (``correct`` hits of ``scored`` predictions) in samples' worth
    for a batch of ``batch`` (:func:`correct_samples`): the hits themselves for class logits,
    ``batch x correct / scored`` for per-position logits (0 when none is scored)."""
    if not per_position:
        return correct
    return correct * batch / scored if scored else 0.0


class CrossEntropyLoss(torch.nn.CrossEntropyLoss):
    """``torch.nn.CrossEntropyLoss`` that also takes per-position logits ``[batch, T, classes]``
    with targets ``[batch, T]`` (flattened by :func:`flatten_sequence`, so ``"mean"`` averages over
    scored positions); targets equal to :data:`IGNORE_INDEX` are left out."""

    def __init__(self, reduction: Literal["mean", "sum"] = "mean"):
        super().__init__(reduction=reduction, ignore_index=IGNORE_INDEX)

    def forward(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return super().forward(*flatten_sequence(logits, y))


def loss_function(reduction: Literal["mean", "sum"] = "mean") -> torch.nn.Module:
    """The loss every workload trains with: cross-entropy over class logits ``[batch, classes]``
    and labels ``[batch]``, or over per-position logits ``[batch, T, classes]`` and targets
    ``[batch, T]`` (:class:`CrossEntropyLoss`); ``reduction="sum"`` for code that adds
    micro-batches' losses itself."""
    return CrossEntropyLoss(reduction)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
               loss_fn: torch.nn.Module | None = None) -> torch.Tensor:
    """One plain training step: forward, loss, backward, optimizer step, ``zero_grad(set_to_none=True)``.

    Args:
        x: inputs ``[batch, ...]`` (images ``[batch, C, H, W]``); y: class labels ``[batch]``
            (or per-position targets ``[batch, T]``, see :func:`loss_function`).
        loss_fn: the loss (default :func:`loss_function`).

    Returns:
        the loss, detached (a 0-dim tensor on the model's device): reading it (``float(loss)``)
        waits for the device, so the step itself does not, and it also runs on fake tensors.
    """
    loss_fn = loss_fn or loss_function()  # held until backward: hooks on it (MemTracker's) stay valid
    loss = loss_fn(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()
