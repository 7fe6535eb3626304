"""Churn validated: a collaborative run with churn measured over the window where its schedule applies,
and predicted for the churn that happened (experiments.results.churn_window, experiments.validate)."""

from __future__ import annotations

import dataclasses

import pytest

from ddlscope.experiments.results import churn_window
from ddlscope.experiments.validate import PRESETS, ValidationGrid, churn_outcome, validation_cell
from ddlscope.modeling.cluster import PeerSpec
from ddlscope.modeling.prediction import Setting, predict
from ddlscope.predict.validation_report import StrategyOutcome
from ddlscope.store.db import ResultsStore
from tests.test_costs import make_cluster, make_profile

T0 = 1_000_000.0


def _step(step: int, t: float, warmup: bool = False, round_: bool = False) -> dict:
    return dict(step=step, wall_time=T0 + t, samples=32, step_s=1.0, warmup=int(warmup), optimizer_stepped=1,
                averaging_round=int(round_))


def _churned_run(store: ResultsStore) -> str:
    """Two peers stepping once a second (32 samples, 2 warm-up steps, a round every 4th step); peer 1
    killed at 20.5 s and started again at 30 s, training from 38 s; peer 0 ends at 60 s, peer 1 at 75 s."""
    run_id = store.create_run("churn", "collaborative", {"strategy": "collaborative", "peers": 2, "batch_size": 32,
                                                        "dataset": "mnist"})
    for t in range(60):
        store.add_step(run_id, 0, _step(t, t, warmup=t < 2, round_=t % 4 == 3))
    for t in range(21):
        store.add_step(run_id, 1, _step(t, t, warmup=t < 2, round_=t % 4 == 3))
    for k, t in enumerate(range(38, 75)):
        store.add_step(run_id, 1, _step(21 + k, t, round_=t % 4 == 3))
    store._insert_event(run_id, 1, T0 + 20.5, "peer_kill", {})
    store._insert_event(run_id, 1, T0 + 30.0, "peer_rejoin", {})
    return run_id


def test_the_churn_window_runs_from_the_last_initial_peers_first_measured_step_to_the_first_peer_done(tmp_path):
    with ResultsStore(tmp_path / "r.db") as store:
        w = churn_window(store, _churned_run(store))
    assert w.start_wall == T0 + 2 and w.run_s == pytest.approx(58.0)  # to peer 0's last step's end, 60 s
    # peer 0: steps at 2..59 s; peer 1: 2..20 s (the step the kill cut counts), then 38..59 s
    assert w.samples == pytest.approx((58 + 19 + 22) * 32)
    assert w.samples_lost == 32  # peer 1's step at 20 s came after its round at 19 s
    assert w.samples_trained == pytest.approx((58 + 19 + 22 - 1) * 32)
    assert w.schedule == [{"peer": 1, "kill_at_s": 18.5, "rejoin_at_s": 28.0}]


def test_samples_hivemind_discarded_on_loading_the_swarms_state_are_not_counted_as_trained(tmp_path):
    with ResultsStore(tmp_path / "r.db") as store:
        run_id = _churned_run(store)
        # the rejoined peer 1's first step (at 38 s) loaded the swarm's state: hivemind dropped its gradients
        store.conn.execute("UPDATE steps SET samples_discarded = 32 WHERE run_id = ? AND worker_index = 1 AND step = 21",
                           (run_id,))
        w = churn_window(store, run_id)
    assert w.samples == pytest.approx((58 + 19 + 22 - 1) * 32)


def test_a_run_without_churn_or_with_a_change_before_every_peer_trained_has_no_window(tmp_path):
    with ResultsStore(tmp_path / "r.db") as store:
        plain = store.create_run("plain", "collaborative", {"strategy": "collaborative", "peers": 2})
        for t in range(10):
            store.add_step(plain, 0, _step(t, t))
            store.add_step(plain, 1, _step(t, t))
        assert churn_window(store, plain) is None
        early = _churned_run(store)
        store._insert_event(early, 0, T0 + 1.0, "peer_leave", {})  # before peer 0's first measured step
        assert churn_window(store, early) is None


def test_collaborative_cells_of_a_grid_with_churn_run_the_schedule_under_a_key_of_their_own(tmp_path):
    grid = ValidationGrid(**{**PRESETS["churn"], "bandwidths_mbit_per_s": [], "loopback": True})
    swarm = Setting("collaborative", 2, 32, epoch_samples=60000, target_batch_size=128)
    cell = validation_cell(grid, swarm, "mobilenet_v2", "mnist", tmp_path)
    assert cell.key.endswith("-churn")
    assert cell.values["collaborative"]["churn"] == [{"peer": 1, "join_at_s": 0.0, "kill_at_s": 20.0,
                                                      "rejoin_at_s": 30.0}]
    assert cell.config.collaborative.churn_events(2)[0].kill_at_s == 20.0
    plain = grid.model_copy(update={"churn": []})
    assert "churn" not in validation_cell(plain, swarm, "mobilenet_v2", "mnist", tmp_path).values["collaborative"]


@pytest.mark.parametrize("fields, words", [
    (dict(strategies=["ddp"]), "churn applies to the cells of swarm models"),
    (dict(churn=[dict(peer=2, kill_at_s=5.0)]), "peers [2] are outside 0..1"),
    (dict(churn=[dict(peer=1, kill_at_s=5.0), dict(peer=1, leave_at_s=9.0)]), "have two schedules"),
])
def test_a_churn_grid_that_cannot_run_is_refused(fields, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        ValidationGrid(**{**PRESETS["churn"], **fields})


def test_the_churned_cell_is_predicted_for_the_churn_that_happened_and_measured_over_its_window(tmp_path):
    db = tmp_path / "r.db"
    with ResultsStore(db) as store:
        run_id = _churned_run(store)
    prof = make_profile()
    cl = make_cluster(bw=1.0, peers=[PeerSpec(compute_share=1.0, bandwidth_gb_per_s=1.0) for _ in range(2)])
    swarm = Setting("collaborative", 2, 32, epoch_samples=3200, target_batch_size=128, matchmaking_time_s=0.01)
    before = StrategyOutcome(strategy="collaborative", predicted_epoch_s=1.0, predicted_memory_bytes=None, fits=True,
                             measured_epoch_s=2.0, status="completed")
    out = churn_outcome(before, db, run_id, prof, cl, swarm, "g", "collaborative-churn-key")
    expected = predict(prof, cl, dataclasses.replace(swarm, options={
        "churn": [{"peer": 1, "kill_at_s": 18.5, "rejoin_at_s": 28.0}], "run_s": 58.0}))
    assert out.predicted_epoch_s == pytest.approx(expected.epoch_s)
    assert out.measured_epoch_s == pytest.approx(58.0 * 3200 / ((58 + 19 + 22 - 1) * 32))
    with ResultsStore(db) as store:
        row = store.predictions("g")[0]
    assert row["run_id"] == run_id and row["cell_key"] == "collaborative-churn-key"
    assert row["predicted_epoch_s"] == pytest.approx(expected.epoch_s)


def test_a_churned_cell_whose_window_cannot_be_measured_fails_with_the_reason(tmp_path):
    db = tmp_path / "r.db"
    with ResultsStore(db) as store:
        run_id = store.create_run("plain", "collaborative", {"strategy": "collaborative", "peers": 2})
        store.add_step(run_id, 0, _step(0, 0))
    before = StrategyOutcome(strategy="collaborative", predicted_epoch_s=1.0, predicted_memory_bytes=None, fits=True,
                             measured_epoch_s=2.0, status="completed")
    out = churn_outcome(before, db, run_id, make_profile(), make_cluster(), Setting("collaborative", 2, 32, 3200),
                        "g", "k")
    assert out.status == "failed" and out.measured_epoch_s is None and "churn could not be measured" in out.reason
