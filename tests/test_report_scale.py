"""Reports of hundreds of runs stay readable: bounded PNG sizes, capped bars and legend entries.

The runs are synthetic (benchmarks/report_scale.py: made-up rows shaped like a run's, for layout
and timing only). How long a report takes is benchmarks/report_scale.py's business, not a test's.
"""

from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

import matplotlib.image
import pytest

from ddlscope.analyze.plots import DPI, MAX_BARS, MAX_WIDTH_IN, top_with_others
from ddlscope.store.db import ResultsStore

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import report_scale  # noqa: E402

RUNS = 200


@pytest.fixture(scope="module")
def store_of_many_runs(tmp_path_factory) -> tuple[Path, list[str]]:
    db = tmp_path_factory.mktemp("many") / "ddlscope.db"
    return db, report_scale.build_synthetic_store(db, RUNS, workers=2, steps=4, evals=2)


def _pixel_sizes(folder: Path) -> dict[str, tuple[int, int]]:
    return {p.name: matplotlib.image.imread(p).shape[1::-1] for p in sorted(folder.glob("*.png"))}


def test_report_of_200_runs_draws_pngs_of_bounded_size(store_of_many_runs, tmp_path):
    from ddlscope.analyze.report import report_runs

    db, ids = store_of_many_runs
    with contextlib.redirect_stdout(io.StringIO()):
        report_runs(db, ids, tmp_path / "report")
    sizes = _pixel_sizes(tmp_path / "report")
    assert set(sizes) >= {"step_breakdown.png", "accuracy.png", "loss.png", "network.png"}
    max_px = round(MAX_WIDTH_IN * DPI)
    assert all(w <= max_px and h <= 1000 for w, h in sizes.values()), sizes
    md = (tmp_path / "report" / "report.md").read_text()
    assert all(f"| synthetic-{i} |" in md for i in range(RUNS))  # the tables keep every run


def test_sweep_report_of_200_runs_draws_pngs_of_bounded_size(store_of_many_runs, tmp_path):
    from ddlscope.analyze.sweep_report import write_sweep_report

    db, _ = store_of_many_runs
    with ResultsStore(db) as store:
        write_sweep_report(store, report_scale.GROUP, tmp_path / "sweep")
    sizes = _pixel_sizes(tmp_path / "sweep")
    assert "network.png" in sizes and all(w <= round(MAX_WIDTH_IN * DPI) for w, _ in sizes.values()), sizes


def test_step_breakdown_shows_the_baseline_the_slowest_and_one_bar_for_the_others(store_of_many_runs):
    from ddlscope.analyze.compare import summarize_run
    from ddlscope.analyze.report import _step_bars

    db, ids = store_of_many_runs
    with ResultsStore(db) as store:
        summaries = [summarize_run(store, r) for r in ids[:40]]
    bars, note = _step_bars(summaries)
    assert len(bars) == MAX_BARS and bars[0][0] == f"{summaries[0].name}\n{summaries[0].run_id}"
    assert bars[-1][0].startswith("others\n(17 runs)")
    slowest = sorted(summaries[1:], key=lambda s: -sum(w.mean_phase_s[p] for w in s.workers for p in w.mean_phase_s))
    assert {b[0] for b in bars[1:-1]} == {f"{s.name}\n{s.run_id}" for s in slowest[:MAX_BARS - 2]}
    assert "every run is in the tables" in note
    few, note = _step_bars(summaries[:3])  # few runs: one bar per worker, as before
    assert len(few) == 1 + 2 + 2 and note == ""


def test_top_with_others_keeps_the_first_and_the_order():
    items = [5, 1, 9, 3, 7]
    assert top_with_others(items, float, 3, first=1) == ([1, 9, 7], [5, 3])
    assert top_with_others(items, float, 5) == (items, [])
