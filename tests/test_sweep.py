"""Sweep grids (expansion, presets, bad input) and the sweep runner (skip on rerun, failed cells)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import ddlscope.config
from ddlscope.errors import UserError
from ddlscope.store.db import ResultsStore
from ddlscope.experiments.estimate import RUN_START_S, estimate_cell_s, sample_s
from ddlscope.sweep.grid import expand_grid, load_grid
from ddlscope.sweep.presets import preset_grid
from ddlscope.sweep.runner import run_sweep
from tests.conftest import tiny_run

TWO_CORES = [0, 1]


@pytest.fixture
def sixteen_cores(monkeypatch):
    """Pretend this process may use 16 cores (validate_config checks peers x vCPUs against them)."""
    monkeypatch.setattr(ddlscope.config, "available_cores", lambda: list(range(16)))
    return list(range(16))


def _grid(axes, **base):
    return {"base": dict(tiny_run(), **base), "axes": axes}


def test_cross_product_with_coupled_peers_axis():
    sweep = expand_grid(_grid({"batch_size": [16, 32], "peers": [1, 2], "total_vcpus": 2,
                               "collaborative.target_batch_size": [64, 128]}), "g", cores=TWO_CORES)
    # 2 batch sizes x (1 single cell + 2 collaborative cells): single cells ignore the TBS axis
    assert len(sweep.cells) == 6
    by_label = {c.label: c for c in sweep.cells}
    single = by_label["single-bs16-p1-v2"]
    assert single.config.strategy == "single" and single.config.peers == 1 and single.config.vcpus_per_peer == 2
    assert json.loads(single.key) == {"batch_size": 16, "peers": 1, "strategy": "single", "vcpus_per_peer": 2}
    collab = by_label["collaborative-bs32-p2-tbs128-v1"]
    assert collab.config.vcpus_per_peer == 1 and collab.config.collaborative.target_batch_size == 128
    assert collab.config.name == "g/collaborative-bs32-p2-tbs128-v1"
    assert collab.key == ('{"batch_size":32,"collaborative.target_batch_size":128,"peers":2,'
                          '"strategy":"collaborative","vcpus_per_peer":1}')


def test_peers_axis_uses_the_base_model_or_the_table_the_grid_sets():
    ddp = expand_grid(_grid({"peers": [1, 2], "total_vcpus": 2}, strategy="ddp"), "g", cores=TWO_CORES)
    assert [c.config.strategy for c in ddp.cells] == ["single", "ddp"]
    with pytest.raises(UserError, match="peers = 2 but strategy 'single' runs on one worker"):
        expand_grid(_grid({"peers": [1, 2], "total_vcpus": 2}), "g", cores=TWO_CORES)
    # a ddp cell ignores the axes of the collaborative table, so they do not multiply its cells
    mixed = expand_grid(_grid({"strategy": ["ddp", "collaborative"], "peers": [2], "total_vcpus": 2,
                               "collaborative.target_batch_size": [64, 128]}), "g", cores=TWO_CORES)
    assert sorted(c.label for c in mixed.cells) == ["collaborative-p2-tbs128-v1", "collaborative-p2-tbs64-v1",
                                                    "ddp-p2-v1"]


def test_estimates_scale_by_the_models_factor():
    from ddlscope import distribution

    base = expand_grid(_grid({"strategy": ["ddp", "collaborative"]}, peers=2, vcpus_per_peer=1), "g", cores=TWO_CORES)
    ddp, collab = (estimate_cell_s(c.config, TWO_CORES) for c in base.cells)
    compute_s = 10 * 16 * sample_s(1)  # 320 samples / (2 peers x 16) = 10 steps per peer on 1 core
    assert ddp == pytest.approx(RUN_START_S + compute_s)
    assert collab == pytest.approx(RUN_START_S + compute_s * distribution.get("collaborative").estimate_factor)


def test_repeats_set_seed_and_union_of_axes_tables_drops_duplicates():
    sweep = expand_grid({"base": dict(tiny_run(), seed=10),
                         "axes": [{"learning_rate": [0.01, 0.1], "repeats": 3}, {"learning_rate": [0.1], "repeats": [2]}]},
                        "g", cores=TWO_CORES)
    assert len(sweep.cells) == 6  # the second table's only cell equals lr0.1-r2 of the first
    assert [(c.config.learning_rate, c.config.seed) for c in sweep.cells] == [
        (0.01, 10), (0.01, 11), (0.01, 12), (0.1, 10), (0.1, 11), (0.1, 12)]
    assert json.loads(sweep.cells[1].key) == {"learning_rate": 0.01, "repeat": 1}


def test_thesis_presets_reproduce_the_tables(sixteen_cores):
    baseline = expand_grid(preset_grid("thesis-baseline", 16), "b", cores=sixteen_cores)
    assert len(baseline.cells) == 3 * 3 * 2 * 4  # Table 5.1 x GAS x 4 repeats
    assert {c.config.sample_budget for c in baseline.cells} == {320_000}
    assert {c.config.vcpus_per_peer for c in baseline.cells} == {16}
    collab = expand_grid(preset_grid("thesis-collaborative", 16), "c", cores=sixteen_cores)
    assert len(collab.cells) == 144  # thesis 000: "In total, we have executed 144 experiments"
    shapes = {(c.config.peers, c.config.vcpus_per_peer) for c in collab.cells}
    assert shapes == {(2, 8), (4, 4), (8, 2), (16, 1)}
    assert {c.config.collaborative.target_batch_size for c in collab.cells if c.config.peers == 16} == {1250}


def test_presets_scale_to_two_cores_and_local_fits_an_hour():
    collab = expand_grid(preset_grid("thesis-collaborative", 2), "c", cores=TWO_CORES)
    assert len(collab.cells) == 90 and {c.config.peers for c in collab.cells} == {2}
    assert {c.config.sample_budget for c in collab.cells} == {40_000}  # 320,000 x 2 / 16
    local = expand_grid(preset_grid("local", 2), "l", cores=TWO_CORES)
    assert len(local.cells) == 26
    total_s = sum(estimate_cell_s(c.config, TWO_CORES) for c in local.cells)
    assert 600 < total_s < 3600


@pytest.mark.parametrize("data, message", [
    (_grid({"batch_size": []}), "zero cells"),
    (_grid({"batch_sise": [16]}), "unknown axis/axes ['batch_sise']; allowed: strategy, model"),
    (_grid({"batch_size": 16}), "is not a list"),
    (_grid({"learning_rate": [0.1] * 15, "batch_size": [16] * 15}), "225 cells"),
    (_grid({"peers": [1, 2], "total_vcpus": 64}), "total_vcpus = 64 exceeds"),
    (_grid({"peers": [3], "total_vcpus": 2}), "peers = 3 does not divide total_vcpus = 2"),
    (_grid({"peers": [2], "vcpus_per_peer": [1]}), "conflict"),
    (_grid({"seed": [1], "repeats": 2}), "conflict"),
    (_grid({"vcpus_per_peer": [1, 99]}), "1 of 2 cells are invalid; first: cell v99"),
    (_grid({"collaborative.target_batch_size": [64, 8]}, strategy="collaborative", peers=2, vcpus_per_peer=1),
     "collaborative.target_batch_size = 8 is below one optimizer step"),
    ({"base": {}, "axis": {}}, "unknown top-level key(s) ['axis']"),
])
def test_bad_grids_are_refused_before_anything_runs(data, message):
    with pytest.raises(UserError) as err:
        expand_grid(data, "bad", max_cells=200, cores=TWO_CORES)
    assert message in str(err.value)


def _fake_runner(fail_batch_size=None, launcher_fails=False):
    """A stand-in for run_local that stores a completed run (or fails) without starting processes."""
    calls = []

    def run(cfg, db_path, group_name=None, progress=True):
        calls.append(cfg.batch_size)
        if cfg.batch_size == fail_batch_size:
            if launcher_fails:
                raise RuntimeError("no such model factory")
            with ResultsStore(db_path) as store:
                rid = store.create_run(cfg.run_label, cfg.strategy, cfg.model_dump(mode="json"), group_name)
                store.finish_run(rid, "failed", "worker 0 exited with code 1: boom")
            return rid
        with ResultsStore(db_path) as store:
            rid = store.create_run(cfg.run_label, cfg.strategy, cfg.model_dump(mode="json"), group_name)
            store.finish_run(rid, "completed")
        return rid

    return run, calls


@pytest.mark.parametrize("launcher_fails", [False, True])
def test_failed_cell_is_stored_and_rerun_skips_finished_cells(tmp_path, launcher_fails):
    db = tmp_path / "r.db"
    sweep = expand_grid(_grid({"batch_size": [8, 16, 32]}), "s", cores=TWO_CORES)
    run, calls = _fake_runner(fail_batch_size=16, launcher_fails=launcher_fails)
    outcomes = run_sweep(sweep, db, progress=False, run_fn=run)
    assert calls == [8, 16, 32]  # the failed cell did not stop the sweep
    assert [o.status for o in outcomes] == ["completed", "failed", "completed"]
    assert "boom" in outcomes[1].reason or "no such model factory" in outcomes[1].reason
    with ResultsStore(db) as store:
        runs = store.runs("s")
        assert len(runs) == 3
        failed = [r for r in runs if r["status"] == "failed"]
        assert len(failed) == 1 and failed[0]["cell_key"] == '{"batch_size":16}' and failed[0]["reason"]
    outcomes = run_sweep(sweep, db, progress=False, retry_failed=False, run_fn=run)
    assert calls == [8, 16, 32] and [o.status for o in outcomes] == ["skipped"] * 3
    run_ok, calls_ok = _fake_runner()
    outcomes = run_sweep(sweep, db, progress=False, run_fn=run_ok)
    assert calls_ok == [16]  # only the failed cell runs again
    assert [o.status for o in outcomes] == ["skipped", "completed", "skipped"]
    with ResultsStore(db) as store:
        assert len(store.runs("s")) == 4


def test_cli_sweep_dry_run_and_bad_grid(tmp_path):
    grid = tmp_path / "grid.toml"
    grid.write_text('[base]\nmodel = "tiny_cnn"\ndataset = "mnist"\nsample_budget = 320\n'
                    '[axes]\nbatch_size = [16, 32]\nlearning_rate = [0.01, 0.1]\n')
    env = dict(os.environ)
    ok = subprocess.run([sys.executable, "-m", "ddlscope", "sweep", str(grid), "--dry-run", "--db", str(tmp_path / "d.db")],
                        capture_output=True, text=True, env=env, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "sweep grid: 4 cells" in ok.stdout and "bs32-lr0.1" in ok.stdout
    assert not (tmp_path / "d.db").exists()  # a dry run stores nothing
    grid.write_text(grid.read_text() + "colaborative.use_local_updates = [true]\n")
    bad = subprocess.run([sys.executable, "-m", "ddlscope", "sweep", str(grid)], capture_output=True, text=True,
                         env=env, timeout=120, cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and "Traceback" not in bad.stderr
    assert "colaborative.use_local_updates" in bad.stderr and "collaborative.use_local_updates" in bad.stderr
    assert not (tmp_path / "ddlscope-results").exists()


def test_load_grid_names_the_sweep_after_the_file(tmp_path):
    grid = tmp_path / "my-study.toml"
    grid.write_text('[base]\nmodel = "tiny_cnn"\n[axes]\nbatch_size = [16]\n')
    assert load_grid(grid).name == "my-study"
    with pytest.raises(UserError, match="grid file not found"):
        load_grid(tmp_path / "missing.toml")


@pytest.mark.slow
def test_real_sweep_runs_cells_stores_failure_and_skips_on_rerun(env_data, db_path):
    """Two real tiny runs: a tiny CNN cell completes, a cell whose model factory raises fails; the sweep goes on."""
    data = _grid({"model": ["tests.sweep_factories:exploding", "tiny_cnn"]}, eval_every_steps=10)
    sweep = expand_grid(data, "real", cores=TWO_CORES)
    outcomes = run_sweep(sweep, db_path, progress=False)
    assert [o.status for o in outcomes] == ["failed", "completed"]
    assert "factory exploded on purpose" in outcomes[0].reason
    with ResultsStore(db_path) as store:
        runs = {r["cell_key"]: r for r in store.runs("real")}
        assert set(runs) == {'{"model":"tests.sweep_factories:exploding"}', '{"model":"tiny_cnn"}'}
        assert len(store.rows("steps", runs['{"model":"tiny_cnn"}']["run_id"])) == 20  # 320 samples / 16
    again = run_sweep(sweep, db_path, progress=False, retry_failed=False)
    assert [o.status for o in again] == ["skipped", "skipped"]
    with ResultsStore(db_path) as store:
        assert len(store.runs("real")) == 2
