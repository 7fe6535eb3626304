"""What ``ddlscope datapipe`` is asked to measure, checked before any work.

Kept free of torch so that a bad option is refused at once (the CLI imports this before the
measurement's modules).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ddlscope.errors import UserError

DEFAULT_BATCH_SIZE = 32
MAX_WORKERS = 64


def parse_workers(text: str) -> tuple[int, ...]:
    """``"0,1,2"`` -> ``(0, 1, 2)``: loader worker counts, each in 0..64, sorted, without repeats.

    Raises:
        UserError: empty, not integers, or out of range (the message names ``--loader-workers``).
    """
    message = f"--loader-workers {text!r}: allowed: comma-separated loader worker counts, each 0..{MAX_WORKERS}, e.g. 0,1,2"
    try:
        counts = [int(p) for p in text.split(",")]
    except ValueError:
        raise UserError(message) from None
    if any(not 0 <= c <= MAX_WORKERS for c in counts):
        raise UserError(message)
    return tuple(sorted(set(counts)))


@dataclasses.dataclass
class DatapipeOptions:
    """What ``ddlscope datapipe`` measures. Checked by :meth:`check` before any work.

    Attributes:
        dataset: a dataset name or folder (as for ``open_dataset``); data_root: for names.
        workers: loader worker counts; batch_size: samples per batch (None: the run's, else 32).
        samples: samples timed per option after the warm-up batch.
        max_samples: use only this many training samples (evenly spaced; None = all).
        step_time_s: compute seconds per training step, if the user measured it.
        run_id, db: take the step time from this stored run instead (db: default ``default_db_path()``).
        model, compute_steps: otherwise measure this model for this many steps on synthetic input.
        augment: online augmentation in the strategies that have it.
        seed: shuffling and synthetic-input seed.
    """

    dataset: str
    workers: tuple[int, ...] = (0, 1, 2)
    batch_size: int | None = None
    samples: int = 1024
    max_samples: int | None = None
    step_time_s: float | None = None
    run_id: str | None = None
    db: Path | None = None
    model: str = "resnet18"
    compute_steps: int = 5
    augment: bool = True
    data_root: Path | None = None
    seed: int = 0

    def check(self) -> None:
        """Raise :class:`UserError` naming the first option out of range and what is allowed."""
        if not self.workers or any(not 0 <= w <= MAX_WORKERS for w in self.workers):
            raise UserError(f"--loader-workers {self.workers}: allowed: one or more loader worker counts, each 0..{MAX_WORKERS}")
        checks = [
            (self.batch_size is not None and self.batch_size < 1, f"--batch-size {self.batch_size}: allowed: >= 1"),
            (self.samples < 1, f"--samples {self.samples}: allowed: >= 1 samples timed per option"),
            (self.max_samples is not None and self.max_samples < 1, f"--max-samples {self.max_samples}: allowed: >= 1"),
            (self.step_time_s is not None and not self.step_time_s > 0,
             f"--step-time-s {self.step_time_s}: allowed: > 0 seconds (compute time of one training step)"),
            (self.step_time_s is not None and self.run_id is not None,
             "--step-time-s and --run-id both give the step time; allowed: one of them"),
            (self.compute_steps < 1, f"--compute-steps {self.compute_steps}: allowed: >= 1"),
        ]
        for bad, message in checks:
            if bad:
                raise UserError(message)
