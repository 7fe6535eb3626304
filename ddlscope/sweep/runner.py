"""Run a sweep's cells with the experiment runner, each a stored run in the sweep's group.

Resuming, failures, Ctrl-C and the progress bar are the experiment runner's
(:mod:`ddlscope.experiments.runner`): a rerun skips cells with a completed run, and runs cells
whose last run failed again unless ``retry_failed`` is off (``--skip-failed``).
"""

from __future__ import annotations

from pathlib import Path

from ddlscope.experiments.runner import CellOutcome, RunFn, run_cells
from ddlscope.sweep.grid import Sweep


def run_sweep(sweep: Sweep, db_path: Path, progress: bool = True, retry_failed: bool = True,
              run_fn: RunFn | None = None) -> list[CellOutcome]:
    """Run the sweep's unfinished cells in order; return one outcome per cell of the sweep.

    Args:
        sweep: from :func:`ddlscope.sweep.grid.expand_grid` (cells already validated).
        db_path: results store.
        progress: show the sweep's progress bar.
        retry_failed: run cells whose last run failed again (default) or skip them.
        run_fn: see :data:`ddlscope.experiments.runner.RunFn`; the local launcher by default.

    Raises:
        KeyboardInterrupt: after the running cell was stored as interrupted.
    """
    return run_cells(sweep.cells, db_path, sweep.name, progress=progress, retry_failed=retry_failed, run_fn=run_fn,
                     what="sweep")
