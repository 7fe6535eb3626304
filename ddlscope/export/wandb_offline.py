"""Weights & Biases offline runs: one W&B run per ddlscope run and worker, grouped by the run id.

W&B's convention for distributed training is one run per process, grouped; so each worker
becomes the offline run ``<run_id>-w<k>`` (name ``<run name> <run_id>-w<k>``, ``group`` = the
ddlscope run id, ``job_type`` = ``worker``) with the run config as its W&B config (plus a
``ddlscope`` section: run id, strategy, status, worker index) and the worker's scalars
(:mod:`ddlscope.export.scalars`) logged with ``step`` = step index.

Nothing goes over the network: runs are made with ``mode="offline"`` into
``OUT/wandb/offline-run-<time>-<run_id>-w<k>/``, system metrics, metadata, git and code capture
off, error reporting off; W&B's own cache and logs go to ``OUT/wandb/.cache``. ``wandb sync
OUT/wandb/offline-run-*`` uploads them later if you want. W&B starts a service process
(``wandb-core``); the export ends it (``wandb.teardown()``) before it returns, so it refuses to
run while a W&B run of your own is active in the same process. Exporting a run again replaces
its earlier offline runs in ``OUT``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from ddlscope.errors import UserError
from ddlscope.export.offline import environment
from ddlscope.export.rows import RunRows
from ddlscope.export.scalars import worker_scalars

PROJECT = "ddlscope"


def write(runs: list[RunRows], out_dir: Path) -> list[Path]:
    """Write one offline W&B run per worker of ``runs`` under ``out_dir/wandb``; returns their folders.

    Raises:
        UserError: a W&B run is already active in this process (:func:`check_no_active_run`).
    """
    check_no_active_run()
    folder = out_dir / "wandb"
    written = []
    cache = str(folder / ".cache")
    with environment({"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_ERROR_REPORTING": "false",
                      "WANDB_CACHE_DIR": cache, "WANDB_DATA_DIR": cache}):
        import wandb

        try:
            for rows in runs:
                for wi, points in worker_scalars(rows).items():
                    wandb_id = f"{rows.run_id}-w{wi}"
                    for old in folder.glob(f"offline-run-*-{wandb_id}"):
                        shutil.rmtree(old)
                    _write_worker(wandb, rows, wi, wandb_id, points, out_dir)
                    written.extend(sorted(folder.glob(f"offline-run-*-{wandb_id}")))
        finally:
            wandb.teardown()
    return written


def check_no_active_run() -> None:
    """Raise :class:`UserError` if a W&B run is active in this process: ending W&B's service would end it."""
    import wandb

    if wandb.run is not None:
        raise UserError("a W&B run is active in this process; finish it (wandb.finish()) before exporting to wandb")


def _write_worker(wandb, rows: RunRows, wi: int, wandb_id: str, points, out_dir: Path) -> None:
    """One offline W&B run: config, then the scalars step by step (W&B's steps must not decrease)."""
    config = {**rows.config, "ddlscope": {"run_id": rows.run_id, "strategy": rows.run["strategy"],
                                          "status": rows.run["status"], "worker_index": wi}}
    settings = wandb.Settings(mode="offline", silent=True, console="off", disable_git=True, save_code=False,
                              disable_code=True, x_disable_stats=True, x_disable_meta=True)
    run = wandb.init(dir=str(out_dir), project=PROJECT, id=wandb_id, name=f"{rows.run['name']} {wandb_id}",
                     group=rows.run_id, job_type="worker", config=config, settings=settings)
    try:
        for point in points:
            run.log(point.values, step=point.step)
    finally:
        run.finish(exit_code=0 if rows.run["status"] in ("completed", "running") else 1)
