"""hivemind's rounds as a peer sees them: background parameter (state) rounds timed per epoch, skipped
ones counted, and when gradient rounds were pre-scheduled; shown in the swarm analysis. A real
swarm's rounds are checked in tests/test_integration.py."""

from __future__ import annotations

import time
from types import SimpleNamespace

from ddlscope.analyze.swarm import analyze_swarm, gradient_prescheduling, state_rounds, swarm_markdown
from ddlscope.store.db import ResultsStore
from ddlscope.strategies.collaborative import parse_prescheduling
from tests.conftest import bare_peer, stored_swarm_run


class FakeStateAverager:
    """What :meth:`CollaborativeStrategy._time_state_rounds` wraps of hivemind's ``TrainingStateAverager``:
    ``_do`` (a round takes ``round_s``) and ``step`` (records its keyword arguments)."""

    def __init__(self, round_s: float) -> None:
        self.local_epoch, self.averaging_in_progress, self.round_s, self.steps = 0, False, round_s, []

    def _do(self, wait_for_trigger, optimizer_step, zero_grad, averaging_round, *args, **kwargs):
        if averaging_round:
            time.sleep(self.round_s)
        return "done"

    def step(self, **kwargs):
        self.steps.append(kwargs)
        if kwargs.get("increment_epoch"):
            self.local_epoch += 1


def _peer(every: int = 1, round_s: float = 0.02):
    events: list = []
    peer = bare_peer(0, 0, events)
    peer._state_rounds = []
    averager = FakeStateAverager(round_s)
    peer.hm_opt = SimpleNamespace(state_averager=averager, local_epoch=0)
    peer.cfg = SimpleNamespace(collaborative=SimpleNamespace(average_state_every=every))
    peer._time_state_rounds()
    return peer, averager, events


def test_each_parameter_round_is_timed_from_its_transition_to_its_end():
    peer, averager, events = _peer(round_s=0.05)
    averager.local_epoch = 3
    assert averager._do(None, True, True, False) == "done"  # an optimizer step only: no round
    assert averager._do(None, True, True, True, None, None, False, timeout=5.0) == "done"
    peer._store_state_rounds()
    assert [(e[1], e[2], e[3]["epoch"]) for e in events] == [(0, "state_round", 3)]
    d = events[0][3]
    assert 0.05 <= d["seconds"] < 1.0 and abs(d["ended_at"] - d["began_at"] - d["seconds"]) < 1e-9
    peer._store_state_rounds()
    assert len(events) == 1  # stored once


def test_an_epoch_whose_round_is_skipped_while_the_last_still_runs_is_counted():
    peer, averager, events = _peer(every=2)
    averager.averaging_in_progress = True
    averager.step(increment_epoch=True, averaging_round=False)  # epoch 1: not a state epoch (every 2)
    averager.step(increment_epoch=True, averaging_round=False)  # epoch 2: skipped, the last round still runs
    averager.averaging_in_progress = False
    averager.step(increment_epoch=True, averaging_round=False)  # epoch 3: not a state epoch
    averager.step(increment_epoch=True, averaging_round=True)  # epoch 4: averages
    averager.step(wait_for_delayed_updates=True)  # not an epoch's transition
    peer._store_state_rounds()
    assert [(e[2], e[3]["epoch"]) for e in events] == [("state_round_skipped", 2)]
    assert averager.local_epoch == 4 and len(averager.steps) == 5  # hivemind's own step ran every time


def test_the_swarm_analysis_shows_each_peers_parameter_rounds(tmp_path):
    with ResultsStore(tmp_path / "r.db") as store:
        run_id = stored_swarm_run(store)
        for epoch, seconds in ((1, 2.0), (2, 3.0), (4, 2.5)):  # peer 1: none (a run from before they were timed)
            store.add_event(run_id, 0, "state_round", epoch=epoch, began_at=1e6 + epoch, ended_at=1e6 + epoch + seconds,
                            seconds=seconds)
        store.add_event(run_id, 0, "state_round_skipped", epoch=3, at=1e6 + 3)
        store.add_event(run_id, 2, "state_round_skipped", epoch=3, at=1e6 + 3)
        events = store.rows("events", run_id)
        analysis = analyze_swarm(store, run_id)
    assert state_rounds(events, 0) == {"state_round_s": [2.0, 3.0, 2.5], "state_rounds_skipped": 1}
    assert state_rounds(events, 1) == {"state_round_s": None, "state_rounds_skipped": 0}
    assert state_rounds(events, 2) == {"state_round_s": [], "state_rounds_skipped": 1}
    text = swarm_markdown(analysis)
    assert "peer 0 3 rounds, median 2.50 s (2.00-3.00 s), 1 epochs skipped theirs; peer 2 0 rounds, 1 epochs " \
           "skipped theirs." in text.replace("\n", " ")
    assert "peer 1 " not in text.split("Parameter rounds")[1]


def test_prescheduled_rounds_are_read_from_hiveminds_status_messages_and_stored():
    messages = ["Pre-scheduling gradient averaging round in 1.00 sec", "Averaged gradients with 2 peers",
                "Pre-scheduling state averaging round in 0.25 sec", "Transitioning to epoch 5"]
    assert parse_prescheduling(messages) == [("gradients", 1.0), ("parameters", 0.25)]
    assert parse_prescheduling(["Beginning optimizer step #4"]) == []
    events: list = []
    peer = bare_peer(1, 4, events)
    peer._store_prescheduling(messages, 4, True)
    assert [(e[2], e[3]) for e in events] == [
        ("round_prescheduled", dict(round="gradients", eta_s=1.0, epoch=4, in_last_step=True)),
        ("round_prescheduled", dict(round="parameters", eta_s=0.25, epoch=4, in_last_step=True))]


def test_gradient_rounds_are_split_by_whether_their_matchmaking_began_before_the_last_step(tmp_path):
    with ResultsStore(tmp_path / "r.db") as store:
        # epochs 0-3 of two steps each; the round step (odd) moves to the next epoch; peer 0 warms up in epoch 0
        run_id = stored_swarm_run(store, peers=2, steps=8, step=lambda t, peer: dict(
            global_epoch=(t + 1) // 2, warmup=int(t < 2 and peer == 0),
            averaging_s=[0, 0.2, 0, 0.5, 0, 0.9, 0, 0.4][t] if peer == 0 else 0.5 * (t % 2)))
        store.add_event(run_id, 0, "round_prescheduled", round="gradients", eta_s=1.0, epoch=1, in_last_step=False)
        store.add_event(run_id, 0, "round_prescheduled", round="gradients", eta_s=1.0, epoch=2, in_last_step=True)
        store.add_event(run_id, 0, "round_prescheduled", round="parameters", eta_s=0.3, epoch=3, in_last_step=False)
        store.add_event(run_id, 0, "round_prescheduled", round="gradients", eta_s=1.0, epoch=3, in_last_step=True)
        store.add_event(run_id, 0, "round_prescheduled", round="gradients", eta_s=1.0, epoch=3, in_last_step=False)
        events, steps = store.rows("events", run_id), store.rows("steps", run_id)
        analysis = analyze_swarm(store, run_id)
    # epoch 0's round is a warm-up step; 1 and 3 early (3 twice: the early one counts), 2 late (a parameter
    # round pre-scheduled early does not make a gradient round early)
    assert gradient_prescheduling(events, [s for s in steps if s["worker_index"] == 0], 0) == {
        "early": [0.5, 0.4], "late": [0.9]}
    assert gradient_prescheduling(events, [s for s in steps if s["worker_index"] == 1], 1) is None
    text = swarm_markdown(analysis).replace("\n", " ")
    assert "Gradient rounds pre-scheduled before the epoch's last step / not: peer 0 2 (wait 0.45 s median) / " \
           "1 (wait 0.90 s median)." in text
