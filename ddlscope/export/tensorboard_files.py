"""TensorBoard event files: one log folder per run and worker, ``OUT/<run_id>/worker<k>/``.

Each folder holds the worker's scalars (:mod:`ddlscope.export.scalars`; ``global_step`` = step
index, ``walltime`` = the step's start) and the run config as text (tag ``ddlscope/config``).
``tensorboard --logdir OUT`` shows every exported run and worker side by side. Exporting a run
again replaces its earlier event files in ``OUT``. Needs the ``tensorboard`` package (torch's
``SummaryWriter`` writes the files).
"""

from __future__ import annotations

import json
from pathlib import Path

from ddlscope.export.rows import RunRows
from ddlscope.export.scalars import worker_scalars


def write(runs: list[RunRows], out_dir: Path) -> list[Path]:
    """Write the event files of ``runs`` under ``out_dir``; returns the log folders written (one per worker)."""
    from torch.utils.tensorboard import SummaryWriter

    written = []
    for rows in runs:
        config_text = "```json\n" + json.dumps(rows.config, indent=2, default=str) + "\n```"
        for wi, points in worker_scalars(rows).items():
            log_dir = out_dir / rows.run_id / f"worker{wi}"
            for old in log_dir.glob("events.out.tfevents.*"):
                old.unlink()
            with SummaryWriter(log_dir=str(log_dir)) as writer:
                writer.add_text("ddlscope/config", config_text, 0)
                for point in points:
                    for tag, value in point.values.items():
                        writer.add_scalar(tag, value, point.step, walltime=point.wall_time)
            written.append(log_dir)
    return written
