"""The rows an export reads from the results store, shared by every target.

Two views of the store:

- per run (:func:`read_run`): the ``runs`` row, its config, and its rows of ``workers``, ``steps``,
  ``evals``, ``host_samples``, ``events`` and ``services`` (TensorBoard, W&B, MLflow, the trace);
- per table (:func:`run_tables`, :func:`table_columns`, :func:`table_rows`): every table of the store
  that has a ``run_id`` column, with the rows of the chosen runs as stored (CSV, Parquet).

A step's parts come out disjoint (:func:`step_parts`): in the store ``optimizer_s`` includes the
step's ``averaging_s``; here ``optimizer_s`` is the optimizer step without it, as in
:func:`ddlscope.measure.parts.measured_parts`.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from typing import Any

from ddlscope.measure.parts import STEP_PARTS
from ddlscope.store.db import ResultsStore


@dataclass
class RunRows:
    """Everything stored for one run. Rows are dicts of their table's columns; times are Unix seconds."""

    run: dict[str, Any]
    config: dict[str, Any]
    workers: list[dict[str, Any]]
    steps: list[dict[str, Any]]
    evals: list[dict[str, Any]]
    host_samples: list[dict[str, Any]]
    events: list[dict[str, Any]]
    services: list[dict[str, Any]]

    @property
    def run_id(self) -> str:
        return self.run["run_id"]

    def worker_indices(self) -> list[int]:
        """Workers with a ``workers`` row or any step, host sample, evaluation or event, ascending."""
        seen = {w["worker_index"] for w in self.workers}
        for rows in (self.steps, self.host_samples, self.evals, self.events):
            seen.update(r["worker_index"] for r in rows if r["worker_index"] is not None)
        return sorted(seen)


def read_run(store: ResultsStore, run_id: str) -> RunRows:
    """All rows of run ``run_id`` (steps by worker and step, the rest by worker and time).

    Raises:
        KeyError: no such run in the store.
    """
    row = store.run(run_id)
    if row is None:
        raise KeyError(f"no run {run_id!r} in {store.path}")
    return RunRows(run=dict(row), config=json.loads(row["config_json"]), workers=store.rows("workers", run_id),
                   steps=store.rows("steps", run_id), evals=store.rows("evals", run_id),
                   host_samples=store.rows("host_samples", run_id), events=store.rows("events", run_id),
                   services=store.rows("services", run_id))


def step_parts(step: dict[str, Any]) -> dict[str, float]:
    """Seconds of each part of one stored step, disjoint, in :data:`~ddlscope.measure.parts.STEP_PARTS` order.

    NULL counts as 0; ``optimizer_s`` is returned without the ``averaging_s`` it contains in the store
    (never below 0).
    """
    parts = {p: float(step.get(p) or 0.0) for p in STEP_PARTS}
    parts["optimizer_s"] = max(0.0, parts["optimizer_s"] - parts["averaging_s"])
    return parts


def flat_config(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested run config as ``{"a.b": "value"}``: strings as they are, everything else as JSON."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flat_config(value, name + "."))
        else:
            out[name] = value if isinstance(value, str) else json.dumps(value, default=str)
    return out


# ---------------------------------------------------------------------- per table
def run_tables(conn: sqlite3.Connection) -> list[str]:
    """Every table of the store with a ``run_id`` column: ``runs`` first, then the others by name."""
    names = [name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")]
    with_run = [n for n in names if any(c == "run_id" for c, _ in table_columns(conn, n))]
    return sorted(with_run, key=lambda n: (n != "runs", n))


def table_columns(conn: sqlite3.Connection, table: str) -> list[tuple[str, str]]:
    """``(column, declared SQLite type)`` of ``table`` in table order, e.g. ``("step", "INTEGER")``."""
    return [(row[1], str(row[2]).upper()) for row in conn.execute(f"PRAGMA table_info({table})")]


def table_rows(conn: sqlite3.Connection, table: str, run_ids: list[str]) -> list[tuple[Any, ...]]:
    """The rows of ``table`` that belong to ``run_ids``, as stored (NULL as None), in insertion order."""
    marks = ", ".join("?" * len(run_ids))
    cur = conn.execute(f"SELECT * FROM {table} WHERE run_id IN ({marks}) ORDER BY rowid", run_ids)
    return [tuple(row) for row in cur.fetchall()]
