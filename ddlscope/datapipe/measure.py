"""Measurements for ``ddlscope datapipe``: loader throughput, and the training step's compute time.

* :func:`loader_samples_per_s` times a torch DataLoader alone (no training next to it);
* :func:`compute_step_from_run` takes the compute time of a training step from a stored run;
* :func:`measure_compute_step` measures forward + backward + optimizer of a zoo model on
  synthetic input, for when no run is at hand.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

from ddlscope.errors import UserError
from ddlscope.measure.stats import time_repeats
from ddlscope.train.loop import batches_forever
from ddlscope.workloads.datasets import DatasetSpec
from ddlscope.workloads.models import build_model
from ddlscope.workloads.step import build_optimizer, train_step


@dataclasses.dataclass(frozen=True)
class LoaderTiming:
    """Throughput of one DataLoader configuration.

    Attributes:
        samples_per_s: ``timed_samples / timed_s``.
        timed_samples: samples delivered after the warm-up batch (whole batches, >= the bound asked for).
        timed_s: seconds to deliver them (wall clock).
        warmup_s: seconds until the first batch arrived (worker start-up included); not in the rate.
    """

    samples_per_s: float
    timed_samples: int
    timed_s: float
    warmup_s: float


def loader_samples_per_s(dataset: Dataset, batch_size: int, workers: int, samples: int, seed: int = 0,
                         on_batch: Callable[[int], None] | None = None) -> LoaderTiming:
    """Time a DataLoader as the training loop builds it (shuffled, drop_last, persistent workers).

    The first batch is a warm-up (it includes starting the worker processes) and is not timed;
    then batches are drawn, epoch after epoch if needed, until at least ``samples`` samples came.
    The worker processes are ended before returning, also on errors and Ctrl-C.

    Args:
        dataset: items ``(tensor, label)``; batch_size: samples per batch (<= len(dataset));
        workers: DataLoader worker processes (0 = load in this process); samples: timed samples (>= 1);
        seed: shuffling seed; on_batch: progress callback, called with each batch's sample count.

    Raises:
        ValueError: batch_size, samples or workers out of range.
    """
    if not 1 <= batch_size <= len(dataset) or samples < 1 or workers < 0:
        raise ValueError(f"need 1 <= batch_size <= {len(dataset)}, samples >= 1, workers >= 0; "
                         f"got {batch_size}, {samples}, {workers}")
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=True, num_workers=workers,
                        persistent_workers=workers > 0, generator=torch.Generator().manual_seed(seed))
    batches = batches_forever(loader)
    try:
        start = time.perf_counter()
        first, _ = next(batches)
        warmup_s = time.perf_counter() - start
        if on_batch:
            on_batch(len(first))
        timed = 0
        start = time.perf_counter()
        while timed < samples:
            images, _ = next(batches)
            timed += len(images)
            if on_batch:
                on_batch(len(images))
        timed_s = time.perf_counter() - start
    finally:
        batches.close()
        del batches, loader  # the last references to the persistent workers: ends them now
    return LoaderTiming(timed / timed_s, timed, timed_s, warmup_s)


@dataclasses.dataclass(frozen=True)
class ComputeStep:
    """The compute part of one training step (forward + backward + optimizer, no data loading).

    Attributes:
        compute_step_s: seconds per step (median); batch_size: samples per step;
        source: where the figure comes from (``"given"``, ``"run <id>"`` or ``"measured <model>"``);
        model: the model, when known; steps: how many steps the median is over (0 when given).
    """

    compute_step_s: float
    batch_size: int
    source: str
    model: str | None = None
    steps: int = 0


def compute_step_from_run(db: Path, run_id: str) -> tuple[ComputeStep | None, dict]:
    """Compute time per step of a stored run: median over its non-warm-up steps of ``step_s - data_load_s``.

    Steps of all the run's workers count (a collaborative step's averaging time is part of
    ``step_s`` and so of the compute figure). The batch size is the run config's ``batch_size``.

    Returns:
        ``(step, config)``: the :class:`ComputeStep` (None when the run stored no non-warm-up step)
        and the run's config (a dict), so a caller can measure the run's model instead.

    Raises:
        UserError: no database at ``db`` or no run ``run_id`` in it.
    """
    from ddlscope.store.db import ResultsStore

    if not Path(db).exists():
        raise UserError(f"--run-id {run_id}: no results database at {db}; pass --db")
    with ResultsStore(db) as store:
        if store.run(run_id) is None:
            raise UserError(f"--run-id {run_id}: no such run in {db}; see 'ddlscope runs'")
        config = store.run_config(run_id)
        steps = store.rows("steps", run_id)
    compute = [s["step_s"] - s["data_load_s"] for s in steps
               if not s["warmup"] and s["step_s"] is not None and s["data_load_s"] is not None]
    if not compute:
        return None, config
    return ComputeStep(statistics.median(compute), int(config["batch_size"]), f"run {run_id}",
                       config.get("model"), len(compute)), config


def measure_compute_step(model_name: str, spec: DatasetSpec, batch_size: int, steps: int = 5,
                         warmup: int = 1, seed: int = 0, optimizer: str = "sgd") -> ComputeStep:
    """Median seconds of a training step (forward, loss, backward, optimizer step) of ``model_name``
    on random input.

    The step is :func:`ddlscope.workloads.step.train_step` with ``optimizer``
    (:func:`ddlscope.workloads.step.build_optimizer`'s default hyperparameters). The model is the
    zoo variant for ``spec.family`` (``build_model``), input ``(batch_size, C, H, W)`` of the
    spec's geometry, labels in ``[0, num_classes)``; ``warmup`` steps first, untimed. Runs on the
    CPU with the current torch thread count.

    Raises:
        UserError: an unknown model (from ``build_model``); steps < 1.
    """
    if steps < 1:
        raise UserError(f"--compute-steps {steps}: allowed: >= 1")
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = build_model(model_name, spec.family, num_classes=spec.num_classes)
    opt = build_optimizer(model.parameters(), optimizer)
    x = torch.randn((batch_size, *spec.image_shape), generator=gen)
    y = torch.randint(0, spec.num_classes, (batch_size,), generator=gen)
    model.train()
    times = time_repeats(lambda: train_step(model, opt, x, y), steps, warmup)
    return ComputeStep(statistics.median(times), batch_size, f"measured {model_name}", model_name, steps)
