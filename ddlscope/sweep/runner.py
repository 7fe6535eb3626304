"""Run a sweep's cells one after another, each a stored run in the sweep's group.

Every cell becomes a run whose ``group_name`` is the sweep's name and whose ``cell_key`` is the
cell's key. Before starting, the runner looks up the cells' keys in the store: a cell with a
``completed`` run is skipped (so rerunning an interrupted sweep continues where it stopped); a
cell whose last run failed is run again unless ``retry_failed`` is off. A cell that fails —
its workers crash, or the launcher raises before any worker starts — is stored as a ``failed``
run with the reason and the sweep goes on with the next cell. Ctrl-C stops the running cell
(the launcher stores it as ``interrupted``, tagged with its key) and ends the sweep.

One rich progress bar shows the sweep: its total is the cells' estimated seconds
(:mod:`ddlscope.sweep.estimate`), so its ETA is an estimate until cells finish, then follows the
measured pace; within a cell it advances with the steps the workers have stored.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ddlscope.launch.local import run_local
from ddlscope.store.db import ResultsStore
from ddlscope.sweep.estimate import estimate_cell_s
from ddlscope.sweep.grid import Cell, Sweep


@dataclass
class CellOutcome:
    """What happened to one cell: ``status`` is a run status, or ``skipped`` (already completed)."""

    cell: Cell
    run_id: str | None
    status: str
    reason: str | None = None


def cell_runs(store: ResultsStore, sweep_name: str) -> dict[str, dict]:
    """The latest run of every cell key stored for a sweep: key -> ``{run_id, status, reason}``.

    A completed run wins over later failed ones (a finished cell stays finished).
    """
    out: dict[str, dict] = {}
    for r in store.runs(sweep_name):  # oldest first
        key = r["cell_key"]
        if key is None or (key in out and out[key]["status"] == "completed"):
            continue
        out[key] = {"run_id": r["run_id"], "status": r["status"], "reason": r["reason"]}
    return out


def pending_cells(sweep: Sweep, db_path: Path, retry_failed: bool = True) -> tuple[list[Cell], dict[str, dict]]:
    """Cells still to run, and what the store already holds per key (see :func:`cell_runs`)."""
    with ResultsStore(db_path) as store:
        done = cell_runs(store, sweep.name)
    todo = [c for c in sweep.cells
            if done.get(c.key, {}).get("status") != "completed"
            and (retry_failed or done.get(c.key, {}).get("status") != "failed")]
    return todo, done


def run_sweep(sweep: Sweep, db_path: Path, progress: bool = True, retry_failed: bool = True,
              run_fn: Callable[..., str] = run_local) -> list[CellOutcome]:
    """Run the sweep's unfinished cells in order; return one outcome per cell of the sweep.

    Args:
        sweep: from :func:`ddlscope.sweep.grid.expand_grid` (cells already validated).
        db_path: results store.
        progress: show the sweep's progress bar.
        retry_failed: run cells whose last run failed again (default) or skip them.
        run_fn: ``run_fn(cfg, db_path, group_name=..., progress=False) -> run_id``; the local
            launcher by default (tests pass a stand-in).

    Raises:
        KeyboardInterrupt: after the running cell was stored as interrupted.
    """
    db_path = Path(db_path)
    todo, done = pending_cells(sweep, db_path, retry_failed)
    todo_keys = {c.key for c in todo}
    outcomes = {c.key: CellOutcome(c, done[c.key]["run_id"], "skipped", done[c.key]["reason"])
                for c in sweep.cells if c.key not in todo_keys}
    estimates = {c.key: estimate_cell_s(c.config) for c in todo}
    bar = _SweepBar(sweep.name, db_path, sum(estimates.values()), len(todo)) if progress and todo else None
    try:
        for i, cell in enumerate(todo):
            if bar:
                bar.start_cell(i, cell, estimates[cell.key])
            outcomes[cell.key] = _run_cell(sweep.name, cell, db_path, run_fn)
            if bar:
                bar.end_cell(outcomes[cell.key].status)
    finally:
        if bar:
            bar.close()
    return [outcomes[c.key] for c in sweep.cells]


def _run_cell(sweep_name: str, cell: Cell, db_path: Path, run_fn: Callable[..., str]) -> CellOutcome:
    with ResultsStore(db_path) as store:
        before = {r["run_id"] for r in store.runs(sweep_name)}
    try:
        run_id = run_fn(cell.config, db_path, group_name=sweep_name, progress=False)
    except KeyboardInterrupt:
        _tag_new_run(db_path, sweep_name, before, cell, None)
        raise
    except Exception as e:  # the launcher stored the run as failed if it got that far; else store it here
        reason = f"{type(e).__name__}: {e}"
        run_id = _tag_new_run(db_path, sweep_name, before, cell, reason)
        return CellOutcome(cell, run_id, "failed", reason)
    with ResultsStore(db_path) as store:
        store.set_cell_key(run_id, cell.key)
        row = store.run(run_id)
    return CellOutcome(cell, run_id, row["status"], row["reason"])


def _tag_new_run(db_path: Path, sweep_name: str, before: set[str], cell: Cell, failure: str | None) -> str | None:
    """Tag the run the launcher created for ``cell``; with ``failure`` and no such run, store a failed one."""
    with ResultsStore(db_path) as store:
        new = [r["run_id"] for r in store.runs(sweep_name) if r["run_id"] not in before]
        if new:
            store.set_cell_key(new[-1], cell.key)
            return new[-1]
        if failure is None:
            return None
        cfg = cell.config
        run_id = store.create_run(cfg.run_label, cfg.strategy, cfg.model_dump(mode="json"), sweep_name)
        store.finish_run(run_id, "failed", failure)
        store.set_cell_key(run_id, cell.key)
        return run_id


class _SweepBar:
    """The sweep's rich progress bar, in estimated seconds, fed from the store within a cell."""

    def __init__(self, name: str, db_path: Path, total_est_s: float, cells: int):
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        self.db_path, self.name, self.cells = db_path, name, cells
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[cells]}"),
                                 TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn())
        self.task = self.progress.add_task(f"sweep {name}", total=max(total_est_s, 1e-6), cells=f"0/{cells} cells")
        self.done_est_s, self.cell_est_s, self.cell_steps, self.finished, self.failed = 0.0, 0.0, 0, 0, 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.progress.start()
        self._poller = threading.Thread(target=self._poll, name="ddlscope-sweep-progress", daemon=True)
        self._poller.start()

    def start_cell(self, index: int, cell: Cell, est_s: float) -> None:
        with self._lock:
            self.cell_est_s, self.cell_steps = est_s, (cell.config.max_steps_per_peer() or 0) * cell.config.peers
        self.progress.update(self.task, description=f"sweep {self.name}: {cell.label}")

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
                                         "ORDER BY created_at DESC LIMIT 1", (self.name,)).fetchone()
                if row is None:
                    continue
                steps = sum(store.step_counts(row["run_id"]).values())
                with self._lock:
                    fraction = min(1.0, steps / self.cell_steps) if self.cell_steps else 0.0
                    completed = self.done_est_s + fraction * self.cell_est_s
                self.progress.update(self.task, completed=completed)
            except Exception:  # progress display must never break the sweep
                continue
        if store is not None:
            store.close()

    def close(self) -> None:
        self._stop.set()
        self._poller.join(timeout=5)
        self.progress.stop()
