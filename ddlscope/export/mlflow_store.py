"""MLflow runs in a local SQLite store, ``OUT/mlflow.db`` (no tracking server, no network).

Experiment ``ddlscope``; per ddlscope run a parent MLflow run (name ``<run name> <run_id>``, params =
the run config flattened, ``a.b`` keys, tags ``ddlscope.run_id``, ``ddlscope.strategy``,
``ddlscope.group``, ``ddlscope.status``, its status: completed -> FINISHED, failed -> FAILED,
interrupted -> KILLED) and one child run per worker (``worker <k>``, tag ``mlflow.parentRunId``)
with the worker's scalars (:mod:`ddlscope.export.scalars`) as metrics: ``step`` = step index,
timestamp = the step's start. Artifacts (none are logged) would go to ``OUT/mlartifacts``.

A SQLite store rather than MLflow's file store: MLflow 3 keeps the file store in maintenance mode
and refuses to open one by default. Open it with ``mlflow ui --backend-store-uri
sqlite:///OUT/mlflow.db`` (the UI needs the full ``mlflow`` package) or ``MlflowClient(tracking_uri=...)``.
Exporting a run again deletes its earlier MLflow runs in the store (MLflow's soft delete) first.
MLflow's usage telemetry is turned off (``MLFLOW_DISABLE_TELEMETRY``) when the export imports
mlflow; a process that imported mlflow before keeps its own setting.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ddlscope.export.offline import environment
from ddlscope.export.rows import RunRows, flat_config
from ddlscope.export.scalars import worker_scalars

EXPERIMENT = "ddlscope"
STATUS = {"completed": "FINISHED", "failed": "FAILED", "interrupted": "KILLED"}
METRICS_PER_CALL, PARAMS_PER_CALL = 1000, 100  # MLflow's log_batch limits


def tracking_uri(out_dir: Path) -> str:
    """The store's URI, ``sqlite:///<absolute OUT>/mlflow.db``."""
    return f"sqlite:///{(out_dir / 'mlflow.db').resolve()}"


def write(runs: list[RunRows], out_dir: Path) -> list[Path]:
    """Write ``runs`` into the store in ``out_dir``; returns ``[OUT/mlflow.db]``."""
    quiet = logging.getLogger("mlflow")
    level = quiet.level
    quiet.setLevel(logging.WARNING)  # "Creating initial MLflow database tables..."
    try:
        with environment({"MLFLOW_DISABLE_TELEMETRY": "true"}):  # read when mlflow is imported
            from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=tracking_uri(out_dir))
        experiment = client.get_experiment_by_name(EXPERIMENT)
        artifacts = (out_dir / "mlartifacts").resolve().as_uri()
        experiment_id = (experiment.experiment_id if experiment else
                         client.create_experiment(EXPERIMENT, artifact_location=artifacts))
        for rows in runs:
            for old in client.search_runs([experiment_id], f"tags.`ddlscope.run_id` = '{rows.run_id}'"):
                client.delete_run(old.info.run_id)
            _write_run(client, experiment_id, rows)
    finally:
        quiet.setLevel(level)
    return [out_dir / "mlflow.db"]


def _write_run(client, experiment_id: str, rows: RunRows) -> None:
    """The parent run with the config, then a child run per worker with its metrics."""
    from mlflow.entities import Metric, Param

    run = rows.run
    tags = {"ddlscope.run_id": run["run_id"], "ddlscope.strategy": run["strategy"],
            "ddlscope.group": run["group_name"] or "", "ddlscope.status": run["status"]}
    status = STATUS.get(run["status"])
    end_ms = int(run["ended_at"] * 1000) if run["ended_at"] else None
    parent = client.create_run(experiment_id, start_time=int(run["created_at"] * 1000), tags=tags,
                               run_name=f"{run['name']} {run['run_id']}").info.run_id
    params = [Param(k, v) for k, v in flat_config(rows.config).items()]
    for i in range(0, len(params), PARAMS_PER_CALL):
        client.log_batch(parent, params=params[i:i + PARAMS_PER_CALL])
    for wi, points in worker_scalars(rows).items():
        child_tags = {**tags, "mlflow.parentRunId": parent, "ddlscope.worker_index": str(wi)}
        child = client.create_run(experiment_id, run_name=f"worker {wi}", start_time=int(points[0].wall_time * 1000),
                                  tags=child_tags).info.run_id
        metrics = [Metric(tag, value, int(p.wall_time * 1000), p.step)
                   for p in points for tag, value in p.values.items()]
        for i in range(0, len(metrics), METRICS_PER_CALL):
            client.log_batch(child, metrics=metrics[i:i + METRICS_PER_CALL])
        if status:
            client.set_terminated(child, status, end_ms)
    if status:
        client.set_terminated(parent, status, end_ms)
