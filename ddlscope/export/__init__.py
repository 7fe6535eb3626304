"""Export stored runs to the tools people already use: TensorBoard, W&B, MLflow, CSV, Parquet, a trace.

``ddlscope export RUN_ID... | --group G --to TARGET [--out DIR]`` on the command line, or from Python::

    from ddlscope.export import export_runs
    paths = export_runs("ddlscope-results/ddlscope.db", ["3f2a9c01d4e5"], "trace", "exports/trace")

=============  ==========================================================  ==========================
target         what is written under the output folder                      module
=============  ==========================================================  ==========================
tensorboard    event files, ``<run_id>/worker<k>/``                          :mod:`.tensorboard_files`
wandb          W&B offline runs, ``wandb/offline-run-*-<run_id>-w<k>/``     :mod:`.wandb_offline`
mlflow         an MLflow SQLite store, ``mlflow.db``                         :mod:`.mlflow_store`
csv, parquet   one file per store table, ``<table>.csv`` / ``.parquet``      :mod:`.tables`
trace          a Chrome/Perfetto trace per run, ``<run_id>.trace.json``      :mod:`.trace`
=============  ==========================================================  ==========================

The libraries are optional (``pip install 'ddlscope[export]'``); csv and trace need none. Nothing
goes over the network and no server is started. Details: docs/export.md.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ddlscope.errors import UserError

TARGETS = ("tensorboard", "wandb", "mlflow", "csv", "parquet", "trace")
"""The export targets, as ``--to`` takes them."""

REQUIRES = {"tensorboard": ("tensorboard",), "wandb": ("wandb",), "mlflow": ("mlflow", "sqlalchemy", "alembic"),
            "parquet": ("pyarrow",)}
"""The importable packages each target needs (all in the ``export`` extra)."""

OPEN_HINTS = {
    "tensorboard": "tensorboard --logdir {out}",
    "wandb": "wandb sync {out}/wandb/offline-run-*   (uploads; W&B's UI has no offline viewer)",
    "mlflow": "mlflow ui --backend-store-uri sqlite:///{out}/mlflow.db   (the UI needs the full mlflow package)",
    "csv": "one file per table, e.g. pandas.read_csv('{out}/steps.csv') or a spreadsheet",
    "parquet": "one file per table, e.g. pyarrow.parquet.read_table('{out}/steps.parquet')",
    "trace": "open a .trace.json in Perfetto (ui.perfetto.dev) or chrome://tracing",
}
"""How to look at each target's output (``{out}``: the output folder)."""


def export_runs(db_path: Path | str, run_ids: list[str], to: str, out_dir: Path | str) -> list[Path]:
    """Export stored runs to one target.

    Args:
        db_path: an existing results database (never created here).
        run_ids: ids of the runs to export (duplicates ignored), at least one.
        to: one of :data:`TARGETS`.
        out_dir: the output folder (created if missing). An earlier export of the same run into it is
            replaced (csv/parquet: the table files are rewritten with these runs).

    Returns:
        The files or folders written: event-file folders per worker (tensorboard), offline-run folders
        per worker (wandb), ``mlflow.db`` (mlflow), one file per table (csv, parquet), one trace per
        run (trace).

    Raises:
        UserError: unknown target, a library of the target not installed (names the extra), no
            database at ``db_path``, no run ids, or unknown ones, or (wandb) a W&B run active in this
            process; nothing is written then.
    """
    from ddlscope.export.rows import read_run
    from ddlscope.store.db import ResultsStore

    if to not in TARGETS:
        raise UserError(f"--to {to!r}: unknown export target; allowed: {', '.join(TARGETS)}")
    missing = [m for m in REQUIRES.get(to, ()) if importlib.util.find_spec(m) is None]
    if missing:
        raise UserError(f"export to {to} needs {', '.join(missing)}, not installed: pip install 'ddlscope[export]'")
    db_path, out_dir = Path(db_path), Path(out_dir)
    if not db_path.is_file():
        raise UserError(f"no results database at {db_path}")
    ids = list(dict.fromkeys(run_ids))
    if not ids:
        raise UserError("no run to export: give run id(s) or a group")
    with ResultsStore(db_path) as store:
        unknown = [r for r in ids if store.run(r) is None]
        if unknown:
            raise UserError(f"unknown run id(s) {', '.join(unknown)} in {db_path}; see 'ddlscope runs'")
        if to == "wandb":
            from ddlscope.export.wandb_offline import check_no_active_run

            check_no_active_run()
        out_dir.mkdir(parents=True, exist_ok=True)
        if to in ("csv", "parquet"):
            from ddlscope.export import tables

            return (tables.write_csv if to == "csv" else tables.write_parquet)(store.conn, ids, out_dir)
        runs = [read_run(store, r) for r in ids]
    if to == "tensorboard":
        from ddlscope.export import tensorboard_files as target
    elif to == "wandb":
        from ddlscope.export import wandb_offline as target
    elif to == "mlflow":
        from ddlscope.export import mlflow_store as target
    else:
        from ddlscope.export import trace as target
    return target.write(runs, out_dir)
