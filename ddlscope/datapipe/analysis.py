"""``ddlscope datapipe``: measure every (strategy, loader workers) option of a dataset and recommend one.

Steps: check the options (before anything is built or written), open the training split, build
or reuse the caches, time a DataLoader per option, get the training step's compute time (given,
from a stored run, or measured on synthetic input), judge each option and pick one
(:mod:`ddlscope.datapipe.verdict`).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import psutil
from torch.utils.data import Dataset

from ddlscope.datapipe.caches import STRATEGIES, prepare_strategies, subset_indices
from ddlscope.datapipe.measure import ComputeStep, compute_step_from_run, loader_samples_per_s, measure_compute_step
from ddlscope.datapipe.options import DEFAULT_BATCH_SIZE, DatapipeOptions
from ddlscope.datapipe.verdict import OptionResult, Recommendation, recommend, training_samples_per_s
from ddlscope.errors import UserError
from ddlscope.store.db import default_db_path
from ddlscope.workloads.datasets import DatasetSpec, default_data_root, open_dataset

@dataclasses.dataclass
class DatapipeResult:
    """Everything ``ddlscope datapipe`` found. Rates in samples/s, sizes in bytes, times in seconds.

    Attributes:
        dataset: as given; spec: its :class:`DatasetSpec`; samples: training samples used (of
        dataset_samples); batch_size; timed_samples: per option, asked for; cores: CPU cores this
        process may use; compute: the training step's compute time; training_samples_per_s:
        ``batch_size / compute.compute_step_s``; options: one per (strategy, workers), strategies in
        ``STRATEGIES`` order; recommendation; notes: caveats to print with the result.
    """

    dataset: str
    spec: DatasetSpec
    samples: int
    dataset_samples: int
    batch_size: int
    timed_samples: int
    cores: int
    augment: bool
    compute: ComputeStep
    training_samples_per_s: float
    options: list[OptionResult]
    recommendation: Recommendation
    notes: list[str]

    def to_dict(self) -> dict:
        """JSON-ready dict (the spec as a dict)."""
        return dataclasses.asdict(self)


class _Progress:
    """Optional rich progress: one bar per task, or nothing when ``progress`` is None."""

    def __init__(self, progress):
        self.progress = progress

    def task(self, description: str, total: int):
        if self.progress is None:
            return None
        task_id = self.progress.add_task(description, total=total)
        return lambda n: self.progress.advance(task_id, n)


def _step_time(opts: DatapipeOptions, spec: DatasetSpec) -> ComputeStep:
    """The compute step: given, from the run's steps, or measured (the run's model, else ``opts.model``)."""
    if opts.step_time_s is not None:
        return ComputeStep(opts.step_time_s, opts.batch_size or DEFAULT_BATCH_SIZE, "given")
    model, batch_size, optimizer = opts.model, opts.batch_size or DEFAULT_BATCH_SIZE, "sgd"
    if opts.run_id is not None:
        step, config = compute_step_from_run(opts.db or default_db_path(), opts.run_id)
        if opts.batch_size is not None and opts.batch_size != int(config["batch_size"]):
            raise UserError(f"--batch-size {opts.batch_size} differs from run {opts.run_id}'s batch_size "
                            f"{config['batch_size']}; allowed: leave --batch-size out, or pass {config['batch_size']}")
        if step is not None:
            return step
        model, batch_size = config.get("model", model), int(config["batch_size"])
        optimizer = config.get("optimizer", optimizer)
    return measure_compute_step(model, spec, batch_size, opts.compute_steps, seed=opts.seed, optimizer=optimizer)


def _check_fits_in_ram(spec: DatasetSpec, samples: int) -> None:
    needed_bytes = samples * spec.channels * spec.height * spec.width
    available_bytes = psutil.virtual_memory().available
    if needed_bytes > available_bytes // 2:
        raise UserError(f"the decoded cache of {samples} samples needs {needed_bytes / 1e9:.1f} GB of RAM, "
                        f"{available_bytes / 1e9:.1f} GB are available; allowed: --max-samples "
                        f"<= {available_bytes // 2 // (needed_bytes // samples)}")


def run_datapipe(opts: DatapipeOptions, cache_dir: Path, progress=None) -> DatapipeResult:
    """Measure every (strategy, workers) option of ``opts.dataset`` and recommend one.

    Args:
        opts: the options (checked here first).
        cache_dir: folder for the caches (built if missing or stale, else reused).
        progress: a started ``rich.progress.Progress`` to show bars on, or None.

    Raises:
        UserError / DatasetError: bad options, unknown dataset or run, unreadable files, a batch
            larger than the samples used, a decoded cache that does not fit in RAM.
    """
    opts.check()
    source, spec = open_dataset(opts.dataset, opts.data_root or default_data_root(), "train")
    indices = subset_indices(len(source), opts.max_samples)
    batch_size = opts.batch_size or DEFAULT_BATCH_SIZE
    if batch_size > len(indices):
        raise UserError(f"--batch-size {batch_size} is larger than the {len(indices)} training samples used; "
                        f"allowed: <= {len(indices)}")
    _check_fits_in_ram(spec, len(indices))
    bars = _Progress(progress)
    step_done = bars.task("training step time (given, stored or measured)", 1)
    compute = _step_time(opts, spec)
    if step_done:
        step_done(1)
    batch_size = compute.batch_size
    if batch_size > len(indices):
        raise UserError(f"run {opts.run_id}'s batch_size {batch_size} is larger than the {len(indices)} "
                        f"training samples used; allowed: --max-samples >= {batch_size}")
    training = training_samples_per_s(batch_size, compute.compute_step_s)
    prepared = prepare_strategies(source, spec, indices, cache_dir, STRATEGIES, opts.augment,
                                  bars.task("build caches (decode, then preprocess)", 2 * len(indices)))
    options = []
    for data in prepared:
        for workers in opts.workers:
            timing = loader_samples_per_s(
                data.dataset, batch_size, workers, opts.samples, opts.seed,
                bars.task(f"{data.strategy}, {workers} worker(s)", batch_size * (1 + -(-opts.samples // batch_size))))
            options.append(OptionResult(data.strategy, workers, timing.samples_per_s, data.storage_bytes,
                                        data.storage_location, data.build_s, data.online_augmentation))
    recommendation = recommend(options, training)
    return DatapipeResult(opts.dataset, spec, len(indices), len(source), batch_size, opts.samples,
                          len(os.sched_getaffinity(0)), opts.augment, compute, training, options, recommendation,
                          _notes(opts, spec, source, compute))


def _notes(opts: DatapipeOptions, spec: DatasetSpec, source: Dataset, compute: ComputeStep) -> list[str]:
    cores = len(os.sched_getaffinity(0))
    notes = [
        "Loader throughput is measured alone; during training, loader workers share this machine's "
        f"{cores} core(s) with the training computation, so the figures are upper bounds.",
        "cached-decoded-memory pays its build time at every training start (RAM does not persist); "
        "the disk caches pay it once.",
    ]
    if opts.augment:
        notes.append("preprocessed stores normalized float32 images (4x the decoded bytes) and has no online "
                     "augmentation: every epoch sees the same pixels.")
    if not hasattr(source, "samples"):
        notes.append(f"{spec.format} data is decoded into RAM when opened, so decode-every-step reads "
                     "decoded images too (only the augmentation runs per step).")
    if compute.source.startswith("measured"):
        notes.append(f"Step time measured on synthetic input: {compute.model}, batch {compute.batch_size}, "
                     f"median of {compute.steps} steps after 1 warm-up step.")
    return notes
