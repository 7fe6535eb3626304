"""Running a suite cell by cell, and reducing each cell to seconds per epoch, speedup and breakdown.

Every cell is an ordinary run (same loop, measurement and store as ``ddlscope run``), stored
with the suite's name as its group. A cell that fails — invalid settings, a network that cannot
be split into that many stages, out of memory, a crash — is stored as ``failed`` with its
reason and the suite goes on. Rerunning a suite skips the cells that already completed.

Seconds per epoch (thesis 002 ch. 3.4): the mean over measured batches of the step time of the
slowest worker, times the batches in one epoch of the *real* dataset
(``train_size / global batch size``). Collaborative peers step asynchronously, so for them it is
the slowest peer's measured time over the samples all peers processed in it. Speedup = the one-device baseline's seconds per epoch /
the cell's; scaling efficiency = speedup / workers.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ddlscope import distribution
from ddlscope.errors import UserError
from ddlscope.store.db import ResultsStore
from ddlscope.suite.spec import Cell, SuiteSpec, cell_config, expand

BREAKDOWN = ("data_load_s", "forward_s", "backward_s", "comm_wait_s", "bubble_s", "optimizer_s", "other_s")


def prepare_suite_data(spec: SuiteSpec, root: Path) -> None:
    """Write the synthetic copy of each dataset (idempotent), large enough for every cell's batch."""
    from ddlscope.workloads.datasets import write_synthetic

    cells = expand(spec)
    for ds in spec.datasets:
        largest = max(c.batch_size for c in cells if c.dataset == ds)
        write_synthetic(ds, root, train_size=max(spec.synthetic_train_size, largest), test_size=32, seed=0)


def run_suite(spec: SuiteSpec, db_path: Path, data_root: Path | None = None, progress: bool = True,
              rerun: bool = False) -> list[str]:
    """Run every cell of ``spec`` one after another; return the run ids (skipped cells included).

    Args:
        data_root: where the synthetic datasets go (default ``spec.data_root`` or ``<db folder>/suite-data``).
        rerun: run cells again even if a completed run of them is stored.

    Raises:
        KeyboardInterrupt: after the running cell was stopped and stored as interrupted.
    """
    from ddlscope.launch.local import run_local

    root = Path(data_root or spec.data_root or Path(db_path).parent / "suite-data")
    prepare_suite_data(spec, root)
    cells = expand(spec)
    with ResultsStore(db_path) as store:
        done = {r["name"]: r["run_id"] for r in store.runs(spec.name) if r["status"] == "completed"}
    bar = CellProgress(len(cells)) if progress else None
    run_ids = []
    try:
        for cell in cells:
            if bar:
                bar.start(cell.label)
            if cell.label in done and not rerun:
                run_ids.append(done[cell.label])
            else:
                run_ids.append(_run_cell(spec, cell, root, db_path, run_local))
            if bar:
                bar.advance()
    finally:
        if bar:
            bar.close()
    return run_ids


def _run_cell(spec: SuiteSpec, cell: Cell, root: Path, db_path: Path, run_local) -> str:
    try:
        cfg = cell_config(spec, cell, root)
        return run_local(cfg, db_path, group_name=spec.name, progress=False)
    except UserError as err:  # rejected before it started: store the cell with its reason
        with ResultsStore(db_path) as store:
            run_id = store.create_run(cell.label, cell.strategy, _cell_config_dict(cell), spec.name)
            store.finish_run(run_id, "failed", str(err))
        return run_id


def _cell_config_dict(cell: Cell) -> dict:
    """A stored config for a cell that never started (enough for the report to place it)."""
    values = dict(strategy=cell.strategy, model=cell.network, dataset=cell.dataset, peers=cell.workers,
                  batch_size=cell.batch_size)
    if cell.microbatches is not None:
        values["distributed"] = dict(microbatches=cell.microbatches)
    return values


class CellProgress:
    """One rich progress bar over cells (of a suite, a validation grid), with the one running now and an ETA."""

    def __init__(self, total: int, what: str = "suite"):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        self.progress = Progress(TextColumn(what + " {task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn())
        self.task = self.progress.add_task("", total=total)
        self.progress.start()

    def start(self, label: str) -> None:
        self.progress.update(self.task, description=label)

    def advance(self) -> None:
        self.progress.advance(self.task)

    def close(self) -> None:
        self.progress.stop()


# ---------------------------------------------------------------------------------- results
@dataclass
class CellResult:
    """One cell's outcome. Times in seconds, bytes in bytes; None where the cell did not run.

    ``breakdown_s`` is the mean per measured step over workers of each part of the step
    (see :data:`BREAKDOWN`; ``other_s`` is the step's wall time not covered by the parts).
    """

    run_id: str
    dataset: str
    network: str
    strategy: str
    workers: int
    batch_size: int
    microbatches: int | None
    status: str
    reason: str | None
    step_s: float | None = None
    epoch_s: float | None = None
    speedup: float | None = None
    scaling_efficiency: float | None = None
    breakdown_s: dict[str, float] = field(default_factory=dict)
    comm_s: float | None = None
    comm_bytes_per_step: float | None = None
    peak_memory_bytes: int | None = None

    @property
    def label(self) -> str:
        return f"{self.strategy}-{self.network}-{self.dataset}-{self.workers}w"

    def to_dict(self) -> dict:
        return asdict(self)


def cell_result(store: ResultsStore, run: dict) -> CellResult:
    """Reduce a stored suite run to a :class:`CellResult` (speedup is filled in by :func:`suite_results`)."""
    from ddlscope.workloads.datasets import DATASETS

    cfg = store.run_config(run["run_id"])
    strategy, workers, bs = cfg["strategy"], int(cfg.get("peers", 1)), int(cfg["batch_size"])
    res = CellResult(run["run_id"], cfg["dataset"], cfg["model"], strategy, workers, bs,
                     (cfg.get("distributed") or {}).get("microbatches") if not distribution.get(strategy).data_parallel else None,
                     run["status"], run["reason"])
    steps = [s for s in store.rows("steps", run["run_id"]) if not s["warmup"]]
    if run["status"] != "completed" or not steps:
        return res
    by_step: dict[int, list[dict]] = {}
    for s in steps:
        by_step.setdefault(s["step"], []).append(s)
    global_batch = distribution.get(strategy).data_parallel_size(workers) * bs
    if strategy == "collaborative":
        # peers step asynchronously: the swarm's measured window lasts as long as its slowest peer's
        # (thesis 000: a collaborative run's runtime is the maximum over its peers), and in it the
        # peers together processed all their samples
        window_s = max(sum(s["step_s"] for s in steps if s["worker_index"] == w) for w in {s["worker_index"] for s in steps})
        res.step_s = window_s * global_batch / sum(s["samples"] for s in steps)
    else:  # synchronous: every step lasts as long as its slowest worker's
        res.step_s = statistics.fmean(max(r["step_s"] for r in rows) for rows in by_step.values())
    spec = DATASETS.get(cfg["dataset"])
    if spec is not None:
        res.epoch_s = res.step_s * spec.train_size / global_batch
    parts = {p: statistics.fmean(s[p] or 0.0 for s in steps) for p in BREAKDOWN if p != "other_s"}
    parts["other_s"] = max(0.0, statistics.fmean(s["step_s"] for s in steps) - sum(parts.values()))
    res.breakdown_s = parts
    res.comm_s = statistics.fmean(s["comm_s"] or 0.0 for s in steps)
    res.comm_bytes_per_step = statistics.fmean(s["comm_bytes"] or 0 for s in steps)
    peaks = [w["peak_memory_bytes"] for w in store.workers(run["run_id"]) if w["peak_memory_bytes"]]
    res.peak_memory_bytes = max(peaks) if peaks else None
    return res


def suite_results(store: ResultsStore, suite_name: str) -> list[CellResult]:
    """The latest run of every cell of a suite, with speedup and scaling efficiency vs. its single baseline."""
    latest: dict[str, dict] = {}
    for run in sorted(store.runs(suite_name), key=lambda r: r["created_at"]):
        latest[run["name"]] = dict(run)  # a rerun replaces the earlier attempt
    results = [cell_result(store, run) for run in latest.values()]
    baselines = {(r.dataset, r.network): r for r in results if r.strategy == "single" and r.epoch_s}
    for r in results:
        base = baselines.get((r.dataset, r.network))
        if base and r.epoch_s:
            r.speedup = base.epoch_s / r.epoch_s
            r.scaling_efficiency = r.speedup / r.workers
    return results
