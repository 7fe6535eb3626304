"""The experiment runner (cells -> resume -> store), the measurement of a stored run, and speedup."""

from __future__ import annotations

import pytest

from ddlscope.errors import UserError
from ddlscope.experiments.results import baseline_times, measure_run, speedup
from ddlscope.experiments.runner import Cell, run_cells, stored_cells
from ddlscope.store.db import ResultsStore
from tests.conftest import tiny_run


def fake_run_fn(fail: set[str] = frozenset(), step_s: float = 0.5):
    """A stand-in for run_local: stores a completed run with two measured steps per worker (a failed
    run for configs named in ``fail``) without starting processes; records the names it ran."""
    calls: list[str] = []

    def run(cfg, db_path, group_name=None, progress=True):
        calls.append(cfg.run_label)
        with ResultsStore(db_path) as store:
            rid = store.create_run(cfg.run_label, cfg.strategy, cfg.model_dump(mode="json"), group_name)
            if cfg.run_label in fail:
                store.finish_run(rid, "failed", "worker 0 exited with code 1: boom")
                return rid
            for w in range(cfg.peers):
                for i in range(3):
                    store.add_step(rid, w, dict(step=i, wall_time=float(i), samples=cfg.batch_size, step_s=step_s,
                                                forward_s=step_s / 4, warmup=int(i == 0), optimizer_stepped=1))
            store.finish_run(rid, "completed")
        return rid

    return run, calls


def _cells(*names, **extra):
    return [Cell(key=f"k-{n}", label=n, values=dict(tiny_run(), name=n, **extra)) for n in names]


def test_runner_tags_cells_skips_completed_and_stores_invalid_cells_as_failed(tmp_path):
    db = tmp_path / "r.db"
    cells = _cells("a", "b") + [Cell(key="k-bad", label="bad", values=dict(tiny_run(), name="bad", batch_size=0))]
    run, calls = fake_run_fn(fail={"b"})
    outcomes = run_cells(cells, db, "g", progress=False, run_fn=run)
    assert calls == ["a", "b"]  # the invalid cell never reached the launcher
    assert [o.status for o in outcomes] == ["completed", "failed", "failed"]
    assert "batch_size" in outcomes[2].reason
    with ResultsStore(db) as store:
        stored = stored_cells(store, "g")
        assert {k: v["status"] for k, v in stored.items()} == {"k-a": "completed", "k-b": "failed", "k-bad": "failed"}
        assert store.run(outcomes[2].run_id)["cell_key"] == "k-bad"
    # rerun: the completed cell is skipped, failed ones run again (the invalid one fails again)
    run2, calls2 = fake_run_fn()
    again = run_cells(cells, db, "g", progress=False, run_fn=run2)
    assert calls2 == ["b"] and [o.status for o in again] == ["skipped", "completed", "failed"]
    assert again[0].run_id == outcomes[0].run_id
    # --skip-failed semantics: nothing left to run; --rerun: everything valid runs again
    run3, calls3 = fake_run_fn()
    assert [o.status for o in run_cells(cells, db, "g", progress=False, retry_failed=False, run_fn=run3)] == [
        "skipped", "skipped", "skipped"]
    run_cells(cells, db, "g", progress=False, rerun=True, run_fn=run3)
    assert calls3 == ["a", "b"]


def test_untagged_runs_count_under_their_name_and_duplicate_keys_are_refused(tmp_path):
    db = tmp_path / "r.db"
    with ResultsStore(db) as store:  # a run stored before cells were tagged
        rid = store.create_run("old", "single", tiny_run(), "g")
        store.finish_run(rid, "completed")
    run, calls = fake_run_fn()
    outcomes = run_cells([Cell(key="old", label="old", values=tiny_run())], db, "g", progress=False, run_fn=run)
    assert calls == [] and outcomes[0].status == "skipped" and outcomes[0].run_id == rid
    with pytest.raises(ValueError, match="share keys"):
        run_cells(_cells("a", "a"), db, "g", progress=False, run_fn=run)


def test_cell_config_is_validated_once_and_names_the_field():
    cell = _cells("a")[0]
    assert cell.config is cell.config and cell.config.name == "a"
    with pytest.raises(UserError, match="batch_size"):
        Cell(key="x", label="x", values=dict(tiny_run(), batch_size=-1)).config  # noqa: B018


def test_measured_run_and_speedup(tmp_path):
    db = tmp_path / "r.db"
    run, _ = fake_run_fn(step_s=0.5)
    cfg = _cells("a", dataset="mnist")[0].config
    run_id = run(cfg, db, group_name="g")
    with ResultsStore(db) as store:
        m = measure_run(store, run_id)
    # warm-up step excluded; 0.5 s per step of 16 samples, 60,000 MNIST samples per epoch
    assert m.step_s == pytest.approx(0.5) and m.epoch_s == pytest.approx(0.5 * 60_000 / cfg.batch_size)
    assert m.breakdown_s["forward_s"] == pytest.approx(0.125) and m.breakdown_s["other_s"] == pytest.approx(0.375)
    assert speedup(10.0, 4.0) == pytest.approx(2.5) and speedup(None, 4.0) is None and speedup(10.0, 0.0) is None
    items = [("w1", "ddp", 5.0), ("w1", "single", 10.0), ("w2", "ddp", 1.0)]
    base = baseline_times(items, lambda i: i[0], lambda i: i[1], lambda i: i[2])
    assert base == {"w1": 10.0}  # w2 has no baseline run: its speedup is unknown


def test_workers_that_wait_only_at_outer_rounds_are_measured_by_their_common_window(tmp_path):
    """DiLoCo's workers run their inner steps on their own: a step's time is not its slower worker's."""
    db = tmp_path / "r.db"
    with ResultsStore(db) as store:
        ids = {}
        for strategy in ("diloco", "ddp"):
            cfg = _cells(strategy, strategy=strategy, peers=2)[0].config
            rid = ids[strategy] = store.create_run(strategy, strategy, cfg.model_dump(mode="json"), "g")
            for w, times in enumerate([[0.4, 0.6, 0.4, 0.6], [0.6, 0.4, 0.6, 0.4]]):  # 2.0 s each, out of phase
                wall = 0.0
                for i, t in enumerate(times):
                    store.add_step(rid, w, dict(step=i, wall_time=wall, samples=cfg.batch_size, step_s=t,
                                                warmup=0, optimizer_stepped=1))
                    wall += t
            store.finish_run(rid, "completed")
        assert measure_run(store, ids["diloco"]).step_s == pytest.approx(0.5)  # 2 s for 4 steps of both workers
        assert measure_run(store, ids["ddp"]).step_s == pytest.approx(0.6)  # in lockstep: each step's slower worker
        assert measure_run(store, ids["ddp"]).averaging_rounds_failed == 0


def test_a_swarms_failed_averaging_rounds_are_counted_once_per_round(tmp_path):
    db = tmp_path / "r.db"
    with ResultsStore(db) as store:
        cfg = _cells("c", strategy="collaborative", peers=2)[0].config
        rid = store.create_run("c", "collaborative", cfg.model_dump(mode="json"), "g")
        # rounds at steps 1 and 3; the one at step 3 failed on both peers, and peer 1 also saw step 1's fail
        outcome = {0: [None, 1, None, 0], 1: [None, 0, None, 0]}
        for w, rounds in outcome.items():
            for i, ok in enumerate(rounds):
                store.add_step(rid, w, dict(step=i, wall_time=float(i), samples=cfg.batch_size, step_s=1.0, warmup=0,
                                            optimizer_stepped=1, averaging_round=int(ok is not None),
                                            averaging_succeeded=ok))
        store.finish_run(rid, "completed")
        assert measure_run(store, rid).averaging_rounds_failed == 2
        # hivemind's partial rounds and join timeouts: unknown until every peer counted them, then the most of a peer
        assert (measure_run(store, rid).averaging_rounds_partial, measure_run(store, rid).averaging_rounds_join_timeout) \
            == (None, None)
        for w in (0, 1):
            store.add_event(rid, w, "strategy_details", partial_rounds_counted=True, join_timeouts_counted=True)
        for w, epoch in ((0, 2), (1, 2), (1, 4)):
            store.add_event(rid, w, "join_timeout", round="gradients", timeout_s=3.0, epoch=epoch)
        m = measure_run(store, rid)
        assert (m.averaging_rounds_partial, m.averaging_rounds_join_timeout) == (0, 2)
