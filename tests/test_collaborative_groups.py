"""Moshpit-style averaging groups, client-mode peers and many peers on few cores (collaborative)."""

from __future__ import annotations

import pytest

from ddlscope.analyze.matchmaking import analyze_matchmaking, param_spread
from ddlscope.config import RunConfig, validate_config
from ddlscope.errors import UserError
from ddlscope.launch.local import run_local
from ddlscope.store.db import ResultsStore
from tests.conftest import tiny_run


def test_peers_share_cores_round_robin_only_when_asked():
    cfg = RunConfig(strategy="collaborative", model="tiny_cnn", peers=4, share_cores=True)
    assert cfg.core_sets(cores=[0, 1]) == [[0], [1], [0], [1]]
    wide = RunConfig(strategy="collaborative", model="tiny_cnn", peers=3, vcpus_per_peer=2, share_cores=True)
    assert wide.core_sets(cores=[0, 1, 2, 3]) == [[0, 1], [2, 3], [0, 1]]
    with pytest.raises(UserError, match="or share_cores = true"):
        RunConfig(strategy="collaborative", model="tiny_cnn", peers=4).core_sets(cores=[0, 1])
    with pytest.raises(UserError, match="vcpus_per_peer <= 2"):
        RunConfig(strategy="collaborative", model="tiny_cnn", peers=4, vcpus_per_peer=3,
                  share_cores=True).core_sets(cores=[0, 1])


@pytest.mark.parametrize("table, words", [
    (dict(target_group_size=1), "greater than or equal to 2"),
    (dict(initial_group_bits="012"), "should match pattern"),
    (dict(client_mode_peers=[4]), r"\[4\] are not peers; allowed: 0..3"),
    (dict(client_mode_peers=[0]), "peer 0 bootstraps the swarm"),
    (dict(client_mode_peers=[1, 2, 3, 0], initial_peers=["/ip4/10.0.0.1/tcp/1/p2p/QmX"]), "every peer in client mode"),
])
def test_bad_group_and_client_settings_are_refused(table, words):
    with pytest.raises(UserError, match=words):
        validate_config(tiny_run(strategy="collaborative", peers=4, share_cores=True, collaborative=table))


def test_param_checksum_sums_every_element_in_float64():
    import torch

    from ddlscope.strategies.collaborative import param_checksum

    # 100,000 ones in float16 sum to inf in float16 (its largest value is 65,504); 1/3 is not exact in float32
    groups = [{"params": [torch.ones(100_000, dtype=torch.float16)]},
              {"params": [torch.full((3, 3), 1 / 3), torch.nn.Parameter(torch.tensor([-2.5]))]}]
    expected = 100_000 + 9 * float(torch.tensor(1 / 3, dtype=torch.float32)) - 2.5
    assert param_checksum(groups) == pytest.approx(expected, rel=1e-12)
    assert param_checksum([{"params": []}]) == 0.0


def test_param_spread_is_relative_and_needs_two_peers():
    assert param_spread([2.0, 2.0, 2.0]) == 0.0
    assert param_spread([1.0, 3.0]) == pytest.approx(1.0)
    assert param_spread([1.0, None]) is None and param_spread([]) is None


@pytest.mark.slow
def test_four_peers_on_two_cores_average_in_groups_of_two_with_a_client_mode_peer(env_data, db_path):
    # 20 s of training (a time limit), not a step budget: 120 steps per peer lasted long enough on slower
    # days, and on a fast one (stop 60's CI) every peer finished before hivemind's progress trackers had
    # seen each other, so every round went alone ({1: 9}), as stop 35's pairs did
    cfg = validate_config(tiny_run(
        strategy="collaborative", peers=4, share_cores=True, sample_budget=10_000_000, time_limit_s=20.0,
        collaborative=dict(target_batch_size=640, matchmaking_time_s=2.0, averaging_timeout_s=20.0,
                           join_timeout_s=60.0, target_group_size=2, client_mode_peers=[3])))
    run_id = run_local(cfg, db_path, progress=False)
    with ResultsStore(db_path) as store:
        run = store.run(run_id)
        assert run["status"] == "completed", run["reason"]
        assert sorted({tuple(map(int, w["cores"].split(","))) for w in store.workers(run_id)}) == [(0,), (1,)]
        analysis = analyze_matchmaking(store, [run_id])
    sizes = analysis.group_size_counts
    # hivemind reports no size for a round it did not finish (e.g. the last, at shutdown): those are None
    assert sizes.get(2, 0) > 0 and max(k for k in sizes if k is not None) == 2, sizes  # never all 4 together
    # after each round the peers recorded their parameter checksums; groups of 2 leave them apart
    spreads = [r.param_spread for r in analysis.rounds if len(r.peers) == 4]
    assert spreads and all(s is not None for s in spreads)
    assert max(spreads) > 0


def test_cancelling_a_round_whose_cancel_future_finished_first_does_not_raise():
    """hivemind 1.1.12's StepControl.cancel raised InvalidStateError when the averager had finished the
    round's cancel future first, and the peer's step failed the run; ddlscope makes it idempotent."""
    from concurrent.futures import Future, InvalidStateError

    from hivemind.averaging.control import StepControl

    from ddlscope.strategies.collaborative import idempotent_cancel, tolerate_finished_cancel

    class Control(Future):  # a control whose cancel future the averager finished first
        def cancel_round(self) -> bool:
            finished = Future()
            finished.set_result(None)
            finished.set_result(None)  # raises InvalidStateError, as hivemind's cancel did
            return True

    c = Control()
    with pytest.raises(InvalidStateError):
        c.cancel_round()
    assert idempotent_cancel(Control.cancel_round, Future.cancel)(c) and c.cancelled()
    original = StepControl.cancel
    try:
        tolerate_finished_cancel()
        tolerate_finished_cancel()  # once per process: not wrapped twice
        assert StepControl.cancel.ddlscope_idempotent  # wrapped here, or by a strategy set up earlier in this process
        assert StepControl.cancel is original or StepControl.cancel.__wrapped__ is original
    finally:
        StepControl.cancel = original
