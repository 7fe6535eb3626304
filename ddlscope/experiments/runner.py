"""The one experiment runner: cells -> resume -> progress -> store, for sweeps, suites and validations.

A :class:`Cell` is one run to make: a key that identifies it across reruns, a short label, the
run config's values and an estimated duration. :func:`run_cells` runs a list of cells one after
another as ordinary runs (``ddlscope.launch.local.run_local``) in one group of the results store,
and tags each run with its cell's key (the store's ``runs.cell_key``).

Resume rule: before starting, the runner looks up the group's stored runs by cell key
(:func:`stored_cells`): a cell with a ``completed`` run is skipped (so rerunning an interrupted
experiment continues where it stopped), unless ``rerun``; a cell whose last run failed is run
again unless ``retry_failed`` is off. Runs stored before cells were tagged count under their run
name.

Failures: a cell whose config is invalid, whose workers crash, or whose launcher raises before
any worker starts is stored as a ``failed`` run with the reason, and the runner goes on with the
next cell. Ctrl-C stops the running cell (the launcher stores it as ``interrupted``, tagged with
its key) and ends the experiment.

One rich progress bar shows the experiment: its total is the cells' estimated seconds
(:mod:`ddlscope.experiments.estimate`), so its ETA is an estimate until cells finish, then follows
the measured pace; within a cell it advances with the steps the workers have stored.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from ddlscope.config import RunConfig, validate_config
from ddlscope.errors import UserError
from ddlscope.store.db import ResultsStore

RunFn = Callable[..., str]
"""``run_fn(cfg, db_path, group_name=..., progress=False) -> run_id``: how a cell's run is made."""


@dataclass(frozen=True)
class Cell:
    """One run of an experiment (a sweep, a suite, a validation).

    Attributes:
        key: what identifies the cell across reruns (stored as the run's ``cell_key``).
        label: short human name (the progress bar, reports), e.g. ``ddp-resnet18-mnist-2w``.
        values: the run config's values, nested tables as dicts (``{"strategy": "gpipe",
            "distributed": {"microbatches": 4}, ...}``).
        est_s: estimated wall-clock seconds of its run; None: estimated from its config
            (:func:`ddlscope.experiments.estimate.estimate_cell_s`).
    """

    key: str
    label: str
    values: dict[str, Any] = field(hash=False, compare=False)
    est_s: float | None = None

    @cached_property
    def config(self) -> RunConfig:
        """The validated run config.

        Raises:
            UserError: the values are not a valid run config (the message names the field).
        """
        return validate_config(self.values)

    @property
    def strategy(self) -> str:
        """The cell's distribution model (the run config's default when its values set none)."""
        return self.values.get("strategy", RunConfig.model_fields["strategy"].default)

    def estimate_s(self) -> float:
        """``est_s``, or the estimate of its config; an invalid config is estimated as a run's start cost."""
        from ddlscope.experiments.estimate import RUN_START_S, estimate_cell_s

        if self.est_s is not None:
            return self.est_s
        try:
            return estimate_cell_s(self.config)
        except UserError:
            return RUN_START_S


@dataclass
class CellOutcome:
    """What happened to one cell: ``status`` is a run status, or ``skipped`` (already stored).

    ``run_id`` is the cell's run (a skipped cell's stored run; None when a cell was interrupted
    before the launcher stored anything).
    """

    cell: Cell
    run_id: str | None
    status: str
    reason: str | None = None


def stored_cells(store: ResultsStore, group_name: str) -> dict[str, dict]:
    """The latest run of every cell key stored in a group: key -> ``{run_id, status, reason}``.

    A completed run wins over later failed ones (a finished cell stays finished). A run without a
    cell key (stored before cells were tagged) counts under its run name.
    """
    out: dict[str, dict] = {}
    for r in store.runs(group_name):  # oldest first
        key = r["cell_key"] or r["name"]
        if key in out and out[key]["status"] == "completed":
            continue
        out[key] = {"run_id": r["run_id"], "status": r["status"], "reason": r["reason"]}
    return out


def pending_cells(cells: Sequence[Cell], group_name: str, db_path: Path, rerun: bool = False,
                  retry_failed: bool = True) -> tuple[list[Cell], dict[str, dict]]:
    """Cells still to run under the resume rule (module docstring), and what the store holds per key."""
    done: dict[str, dict] = {}
    if Path(db_path).exists():
        with ResultsStore(db_path) as store:
            done = stored_cells(store, group_name)
    if rerun:
        return list(cells), done
    todo = [c for c in cells
            if done.get(c.key, {}).get("status") != "completed"
            and (retry_failed or done.get(c.key, {}).get("status") != "failed")]
    return todo, done


def run_cells(cells: Sequence[Cell], db_path: Path, group_name: str, *, progress: bool = True,
              rerun: bool = False, retry_failed: bool = True, run_fn: RunFn | None = None,
              what: str = "experiment") -> list[CellOutcome]:
    """Run the cells not yet done, in order; return one outcome per cell, in the cells' order.

    Args:
        cells: unique keys; from a sweep grid, a suite or a validation grid.
        db_path: results store (created if missing).
        group_name: the runs' group (the experiment's name).
        progress: show the progress bar.
        rerun: run every cell again, even those with a completed run.
        retry_failed: run cells whose last run failed again (default) or skip them.
        run_fn: see :data:`RunFn`; the local launcher by default (tests pass a stand-in).
        what: the progress bar's prefix, e.g. ``sweep``.

    Raises:
        ValueError: two cells share a key.
        KeyboardInterrupt: after the running cell was stored as interrupted.
    """
    if run_fn is None:
        from ddlscope.launch.local import run_local as run_fn
    keys = [c.key for c in cells]
    if len(set(keys)) != len(keys):
        raise ValueError(f"cells of {group_name!r} share keys: {sorted({k for k in keys if keys.count(k) > 1})}")
    db_path = Path(db_path)
    todo, done = pending_cells(cells, group_name, db_path, rerun, retry_failed)
    todo_keys = {c.key for c in todo}
    outcomes = {c.key: CellOutcome(c, done[c.key]["run_id"], "skipped", done[c.key]["reason"])
                for c in cells if c.key not in todo_keys}
    estimates = {c.key: c.estimate_s() for c in todo}
    bar = _ProgressBar(f"{what} {group_name}", group_name, db_path, sum(estimates.values()), len(todo)) \
        if progress and todo else None
    try:
        for cell in todo:
            if bar:
                bar.start_cell(cell, estimates[cell.key])
            outcomes[cell.key] = _run_cell(group_name, cell, db_path, run_fn)
            if bar:
                bar.end_cell(outcomes[cell.key].status)
    finally:
        if bar:
            bar.close()
    return [outcomes[c.key] for c in cells]


def _run_cell(group_name: str, cell: Cell, db_path: Path, run_fn: RunFn) -> CellOutcome:
    with ResultsStore(db_path) as store:
        before = {r["run_id"] for r in store.runs(group_name)}
    try:
        run_id = run_fn(cell.config, db_path, group_name=group_name, progress=False)
    except KeyboardInterrupt:
        _tag_new_run(db_path, group_name, before, cell, None)
        raise
    except Exception as e:  # the launcher stored the run as failed if it got that far; else store it here
        reason = str(e) if isinstance(e, UserError) else f"{type(e).__name__}: {e}"
        run_id = _tag_new_run(db_path, group_name, before, cell, reason)
        return CellOutcome(cell, run_id, "failed", reason)
    with ResultsStore(db_path) as store:
        store.set_cell_key(run_id, cell.key)
        row = store.run(run_id)
    return CellOutcome(cell, run_id, row["status"], row["reason"])


def _tag_new_run(db_path: Path, group_name: str, before: set[str], cell: Cell, failure: str | None) -> str | None:
    """Tag the run the launcher created for ``cell``; with ``failure`` and no such run, store a failed one
    (its config: the cell's validated config, or its values when they are invalid: enough for
    reports to place it)."""
    with ResultsStore(db_path) as store:
        new = [r["run_id"] for r in store.runs(group_name) if r["run_id"] not in before]
        if new:
            store.set_cell_key(new[-1], cell.key)
            return new[-1]
        if failure is None:
            return None
        try:
            name, config = cell.config.run_label, cell.config.model_dump(mode="json")
        except UserError:
            name, config = cell.values.get("name", cell.label), cell.values
        run_id = store.create_run(name, cell.strategy, config, group_name)
        store.finish_run(run_id, "failed", failure)
        store.set_cell_key(run_id, cell.key)
        return run_id


class _ProgressBar:
    """The experiment's rich progress bar, in estimated seconds, fed from the store within a cell."""

    def __init__(self, title: str, group_name: str, db_path: Path, total_est_s: float, cells: int):
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        self.db_path, self.group_name, self.title, self.cells = db_path, group_name, title, cells
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[cells]}"),
                                 TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn())
        self.task = self.progress.add_task(title, total=max(total_est_s, 1e-6), cells=f"0/{cells} cells")
        self.done_est_s, self.cell_est_s, self.cell_steps, self.finished, self.failed = 0.0, 0.0, 0, 0, 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.progress.start()
        self._poller = threading.Thread(target=self._poll, name="ddlscope-experiment-progress", daemon=True)
        self._poller.start()

    def start_cell(self, cell: Cell, est_s: float) -> None:
        try:
            steps = (cell.config.max_steps_per_peer() or 0) * cell.config.peers
        except UserError:
            steps = 0
        with self._lock:
            self.cell_est_s, self.cell_steps = est_s, steps
        self.progress.update(self.task, description=f"{self.title}: {cell.label}")

    def end_cell(self, status: str) -> None:
        with self._lock:
            self.done_est_s += self.cell_est_s
            self.cell_est_s = 0.0
            self.finished += 1
            self.failed += status != "completed"
        failed = f", {self.failed} failed" if self.failed else ""
        self.progress.update(self.task, completed=self.done_est_s, cells=f"{self.finished}/{self.cells} cells{failed}")

    def _poll(self) -> None:
        store = None
        while not self._stop.wait(1.0):
            try:
                store = store or ResultsStore(self.db_path)
                row = store.conn.execute("SELECT run_id FROM runs WHERE group_name = ? AND status = 'running' "
                                         "ORDER BY created_at DESC LIMIT 1", (self.group_name,)).fetchone()
                if row is None:
                    continue
                steps = sum(store.step_counts(row["run_id"]).values())
                with self._lock:
                    fraction = min(1.0, steps / self.cell_steps) if self.cell_steps else 0.0
                    completed = self.done_est_s + fraction * self.cell_est_s
                self.progress.update(self.task, completed=completed)
            except Exception:  # progress display must never break the experiment
                continue
        if store is not None:
            store.close()

    def close(self) -> None:
        self._stop.set()
        self._poller.join(timeout=5)
        self.progress.stop()
