"""Running a suite with the experiment runner, and reducing each cell to seconds per epoch, speedup and breakdown.

Every cell is an ordinary run (same loop, measurement and store as ``ddlscope run``), stored
with the suite's name as its group and tagged with its cell's key, by the experiment runner
(:mod:`ddlscope.experiments.runner`): a cell that fails — invalid settings, a network that cannot
be split into that many stages, out of memory, a crash — is stored as ``failed`` with its reason
and the suite goes on; rerunning a suite skips the cells that already completed.

Seconds per step and per epoch are :func:`ddlscope.experiments.results.measure_run`'s (thesis 002
ch. 3.4: the slowest worker's step, extrapolated to the real dataset's size); speedup
(:func:`ddlscope.experiments.results.speedup`) = the one-device baseline's seconds per epoch / the
cell's; scaling efficiency = speedup / workers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from ddlscope import distribution
from ddlscope.experiments.results import baseline_times, measure_run, speedup
from ddlscope.experiments.runner import RunFn, run_cells
from ddlscope.store.db import ResultsStore
from ddlscope.suite.spec import SuiteSpec, expand


def prepare_suite_data(spec: SuiteSpec, root: Path) -> None:
    """Write the synthetic copy of each dataset (idempotent), large enough for every cell's batch."""
    from ddlscope.workloads.datasets import write_synthetic

    cells = expand(spec)
    for ds in spec.datasets:
        largest = max(c.values["batch_size"] for c in cells if c.values["dataset"] == ds)
        write_synthetic(ds, root, train_size=max(spec.synthetic_train_size, largest), test_size=32, seed=0)


def run_suite(spec: SuiteSpec, db_path: Path, data_root: Path | None = None, progress: bool = True,
              rerun: bool = False, run_fn: RunFn | None = None) -> list[str | None]:
    """Run every cell of ``spec`` one after another; return the run ids (skipped cells included).

    Args:
        data_root: where the synthetic datasets go (default ``spec.data_root`` or ``<db folder>/suite-data``).
        rerun: run cells again even if a completed run of them is stored.
        run_fn: see :data:`ddlscope.experiments.runner.RunFn`; the local launcher by default.

    Raises:
        KeyboardInterrupt: after the running cell was stopped and stored as interrupted.
    """
    root = Path(data_root or spec.data_root or Path(db_path).parent / "suite-data")
    prepare_suite_data(spec, root)
    outcomes = run_cells(expand(spec, root), db_path, spec.name, progress=progress, rerun=rerun, run_fn=run_fn,
                         what="suite")
    return [o.run_id for o in outcomes]


# ---------------------------------------------------------------------------------- results
@dataclass
class CellResult:
    """One cell's outcome. Times in seconds, bytes in bytes; None where the cell did not run.

    ``breakdown_s`` is the mean per measured step over workers of each part of the step
    (see :data:`ddlscope.experiments.results.BREAKDOWN`; ``other_s`` is the step's wall time not covered by the parts).
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
    cfg = store.run_config(run["run_id"])
    strategy, workers = cfg["strategy"], int(cfg.get("peers", 1))
    microbatches = None if distribution.get(strategy).data_parallel else (cfg.get("distributed") or {}).get("microbatches")
    res = CellResult(run["run_id"], cfg["dataset"], cfg["model"], strategy, workers, int(cfg["batch_size"]),
                     microbatches, run["status"], run["reason"])
    m = measure_run(store, run["run_id"])
    if m is not None:
        res.step_s, res.epoch_s, res.breakdown_s = m.step_s, m.epoch_s, m.breakdown_s
        res.comm_s, res.comm_bytes_per_step, res.peak_memory_bytes = m.comm_s, m.comm_bytes_per_step, m.peak_memory_bytes
    return res


def suite_results(store: ResultsStore, suite_name: str) -> list[CellResult]:
    """The latest run of every cell of a suite, with speedup and scaling efficiency vs. its baseline."""
    latest: dict[str, dict] = {}
    for run in sorted(store.runs(suite_name), key=lambda r: r["created_at"]):
        latest[run["cell_key"] or run["name"]] = dict(run)  # a rerun replaces the earlier attempt
    results = [cell_result(store, run) for run in latest.values()]
    base = baseline_times(results, lambda r: (r.dataset, r.network), lambda r: r.strategy, lambda r: r.epoch_s)
    for r in results:
        r.speedup = speedup(base.get((r.dataset, r.network)), r.epoch_s)
        r.scaling_efficiency = r.speedup / r.workers if r.speedup is not None else None
    return results
