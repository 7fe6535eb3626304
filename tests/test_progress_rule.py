"""hivemind's epoch-ending rule as a model (ddlscope.modeling.progress): hand-computed decisions, replays, overshoot."""

import math

import pytest

from ddlscope.modeling.progress import (EpochDraws, ProgressModel, TracedStep, TrackerSettings, replay_transitions,
                                        simulate_overshoot)


def test_settings_and_peers_are_checked():
    with pytest.raises(ValueError, match="target_batch_size"):
        TrackerSettings(0)
    with pytest.raises(ValueError, match="ema_alpha"):
        TrackerSettings(64, ema_alpha=0.0)
    with pytest.raises(ValueError, match="latency_s"):
        TrackerSettings(64, latency_s=-1.0)
    with pytest.raises(ValueError, match="peers"):
        ProgressModel(TrackerSettings(64), 0)
    with pytest.raises(ValueError, match="peer 2"):
        ProgressModel(TrackerSettings(64), 2).step_end(2, 1.0, 32)


def test_the_first_epoch_overshoots_until_the_first_fetch():
    # two peers, 1.0 s and 1.2 s steps of 32 samples, target 128. Their trackers fetch at the start (no
    # records yet: the next fetch after hivemind's default 3 s), so neither knows of the other's steps
    # before t = 3 s and both finish their share (2 steps) waiting
    m = ProgressModel(TrackerSettings(128), 2, start_s=0.0)
    seen = [m.step_end(0, 1.0, 32), m.step_end(1, 1.2, 32), m.step_end(0, 2.0, 32), m.step_end(1, 2.4, 32)]
    assert [(d.ready, d.reason, d.known_samples) for d in seen] == [(False, "wait", 32), (False, "wait", 32),
                                                                  (False, "wait", 64), (False, "wait", 64)]
    assert all(math.isinf(d.eta_s) or d.eta_s > 1e6 for d in seen)
    # peer 0's fetch at 3.0 s reads 64 + 64 samples: its third step (96 of its own) ends the epoch
    third = m.step_end(0, 3.0, 32)
    assert (third.ready, third.reason, third.known_samples) == (True, "samples", 160)
    # peer 1 fetched at 3.0 s too (before its report at 3.6 s) and read peer 0's 96 + its own 64
    last = m.step_end(1, 3.6, 32)
    assert (last.ready, last.reason, last.known_samples) == (True, "samples", 192)


def test_an_eta_from_the_records_ends_the_epoch_without_a_fetch_of_the_last_steps():
    # after a round both peers' throughput averages are known: a fetch between their steps extrapolates
    # each record to the target, so a peer whose step ends at that ETA moves on on time
    m = ProgressModel(TrackerSettings(128), 2, start_s=0.0)
    for t in (1.0, 2.0, 3.0):
        m.step_end(0, t, 32)
        m.step_end(1, t, 32)
    m.round_end(0, 4.0)
    m.round_end(1, 4.0)
    # the round-end fetch (due since 3 s) reads two records of 0 samples at 1 sample / (1/32 s) each: ETA 6.0
    a, b = m.step_end(0, 5.0, 32), m.step_end(1, 5.0, 32)
    assert not a.ready and not b.ready and a.eta_s == pytest.approx(6.0)
    c = m.step_end(0, 6.0, 32)
    assert c.ready and c.reason in ("eta", "samples")


def _trace_of(rows):
    return {p: [TracedStep(r, e, 32, ended) for r, e, ended in steps] for p, steps in rows.items()}


def test_a_replay_follows_the_run_and_gives_the_rules_answer_at_each_step():
    # the scenario of the first test as a stored run: both took the round after their third step (5.0 s)
    trace = _trace_of({0: [(1.0, 1.0, False), (2.0, 2.0, False), (3.0, 5.0, True), (6.0, 6.0, False)],
                       1: [(1.2, 1.2, False), (2.4, 2.4, False), (3.6, 5.0, True), (6.1, 6.1, False)]})
    out = replay_transitions(trace, TrackerSettings(128), start_s=0.0)
    assert [(d.peer, d.ready) for d, _ in out][:6] == [(0, False), (1, False), (0, False), (1, False), (0, True),
                                                     (1, True)]
    assert [took for _, took in out][:6] == [False, False, False, False, True, True]
    # after the round (5.0 s) both are in epoch 1 with the step of 6 s counted from there
    assert all(d.known_samples == 32 for d, _ in out[6:])
    with pytest.raises(ValueError, match="numbered"):
        replay_transitions({1: []}, TrackerSettings(128), start_s=0.0)
    with pytest.raises(ValueError, match="after the trackers' start"):
        replay_transitions(trace, TrackerSettings(128), start_s=1.0)


def test_a_short_last_step_runs_past_the_target_and_a_long_one_does_not():
    settings = TrackerSettings(128, latency_s=0.05)
    def pattern(first_s, last_s):  # a step after the round, then the rest of the share, with some spread
        return lambda q, epoch, pos, rng: max(0.05, rng.gauss(first_s if pos == 0 else last_s, 0.15))

    # a peer whose share ends with a step shorter than its average reaches the end before the ETA and
    # starts another step; one whose last step is longer moves on at the ETA
    short_last = simulate_overshoot(pattern(1.3, 1.0), 2, 32, settings, epochs=300)
    long_last = simulate_overshoot(pattern(1.0, 1.3), 2, 32, settings, epochs=300)
    assert short_last > long_last + 0.2
    assert 0.0 <= long_last < 0.5 < short_last <= 1.0
    with pytest.raises(ValueError, match="step time"):
        simulate_overshoot(lambda q, epoch, pos, rng: 0.0, 2, 32, settings, epochs=1)


def _swarm_rows(step_s, epochs=30, batch=32, target=128, round_s=0.5, seed=1, lag_s=0.0):
    """Step rows of a 2-peer run whose peers follow the rule (ProgressModel), as the store keeps them;
    the round ends ``lag_s`` later for the peer with the shorter first step after it."""
    import random

    rng = random.Random(seed)
    model = ProgressModel(TrackerSettings(target, latency_s=0.05), 2, start_s=0.0)
    rows, counters, start, done = [], [0, 0], 0.0, []
    for epoch in range(epochs):
        firsts = {q: step_s(q, epoch, 0, rng) for q in (0, 1)}
        begins = {q: start + (lag_s if epoch and q == min(firsts, key=firsts.get) else 0.0) for q in (0, 1)}
        for q, began, at in done:  # the step that ended the epoch holds the round and its wait
            rows.append(dict(worker_index=q, step=counters[q], wall_time=began, step_s=begins[q] - began,
                             data_load_s=0.0, forward_s=(at - began) * 0.4, backward_s=(at - began) * 0.6,
                             samples=batch, global_epoch=epoch, warmup=0, averaging_round=1))
            counters[q] += 1
        for q in sorted(begins, key=begins.get) if epoch else ():
            model.round_end(q, begins[q])
        ends = {q: (begins[q], begins[q] + firsts[q]) for q in (0, 1)}
        position, joined, done = [0, 0], {}, []
        while ends:
            q = min(ends, key=lambda k: ends[k][1])
            began, at = ends.pop(q)
            position[q] += 1
            if model.step_end(q, at, batch).ready:
                joined[q] = at
                done.append((q, began, at))
            else:
                rows.append(dict(worker_index=q, step=counters[q], wall_time=began, step_s=at - began,
                                 data_load_s=0.0, forward_s=(at - began) * 0.4, backward_s=(at - began) * 0.6,
                                 samples=batch, global_epoch=epoch, warmup=0, averaging_round=0))
                counters[q] += 1
                ends[q] = (at, at + step_s(q, epoch, position[q], rng))
        start = max(joined.values()) + round_s
    return rows


def test_a_run_that_follows_the_rule_replays_exactly_and_its_overshoot_is_simulated():
    from ddlscope.analyze.epoch_rule import check_epoch_rule
    from ddlscope.analyze.swarm import global_epochs

    def step_s(q, epoch, pos, rng):  # the first step after a round slower than the last, with spread
        return max(0.05, rng.gauss(1.3 if pos == 0 else 1.0, 0.15))

    rows = _swarm_rows(step_s, epochs=60)
    check = check_epoch_rule(rows, 128, 32)
    assert check.decisions > 200 and check.agreed == check.decisions
    assert check.step_s_by_position[0] == pytest.approx(1.3, abs=0.1)
    assert check.step_s_by_position[1] == pytest.approx(1.0, abs=0.1)
    measured = global_epochs(rows, 128, 32).overshoot_steps
    assert measured > 0.3 and check.simulated_overshoot_steps == pytest.approx(measured, abs=0.08)
    # nothing to check without a second trainer or without the steps' times
    assert check_epoch_rule([r for r in rows if r["worker_index"] == 0], 128, 32) is None
    assert check_epoch_rule([dict(r, forward_s=None) for r in rows], 128, 32) is None


def test_epochs_drawn_whole_keep_which_peer_took_the_rounds_work_and_the_lag_of_the_other():
    """hivemind's work after a round lands on one peer's first step (issue 14's swarms): drawn whole,
    the run's epochs give its overshoot; each peer's steps drawn on their own do not. A round that ends
    later for the peer with the clean first step lowers the overshoot, and the check measures that lag."""
    from ddlscope.analyze.epoch_rule import check_epoch_rule
    from ddlscope.analyze.swarm import global_epochs

    heavy: dict[int, int] = {}

    def step_s(q, epoch, pos, rng):
        if pos == 0:
            heavy.setdefault(epoch, rng.randrange(2))
            return max(0.05, rng.gauss(1.0 if q == heavy[epoch] else 0.7, 0.05))
        return max(0.05, rng.gauss(1.1, 0.05))

    def each_peer_alone(q, epoch, pos, rng):  # the same steps, without the epoch's pairing
        return max(0.05, rng.gauss(rng.choice((0.7, 1.0)) if pos == 0 else 1.1, 0.05))

    measured = {}
    for lag in (0.0, 0.15):
        heavy.clear()
        rows = _swarm_rows(step_s, epochs=80, lag_s=lag)
        check = check_epoch_rule(rows, 128, 32)
        measured[lag] = global_epochs(rows, 128, 32).overshoot_steps
        assert check.agreed == check.decisions
        assert check.round_end_lag_s == pytest.approx(lag, abs=0.01)
        assert check.simulated_overshoot_steps == pytest.approx(measured[lag], abs=0.08)
    alone = simulate_overshoot(each_peer_alone, 2, 32, TrackerSettings(128, latency_s=0.05), round_s=0.5, epochs=1000)
    assert alone < measured[0.0] - 0.1
    assert measured[0.15] < measured[0.0] - 0.15


def test_epoch_draws_take_each_peers_steps_of_one_epoch_and_pools_beyond_them():
    import random

    epochs = [[[1.0, 2.0], [3.0]], [[5.0, 6.0, 7.0], [8.0, 9.0]]]
    draw = EpochDraws(epochs, base_s=[10.0, 10.0, 10.0])
    rng = random.Random(0)
    for epoch in range(20):
        firsts = [draw(q, epoch, 0, rng) for q in range(3)]
        picked = epochs[0] if firsts[0] == 11.0 else epochs[1]
        assert firsts == [10 + picked[0][0], 10 + picked[1][0], 10 + picked[0][0]]  # peer 2 takes peer 0's steps
        assert draw(1, epoch, 1, rng) == 19.0  # its own second step, or (epoch 0: none) its second steps' pool: [9]
        assert draw(0, epoch, 3, rng) == 17.0  # beyond any epoch's steps: every peer's steps at 2 and later
    assert EpochDraws(epochs, base_s=[1.0, 1.0], floor_share=0.5)(0, 0, 5, rng) >= 0.5
    for bad in ([], [[[1.0]], [[1.0], [2.0]]], [[[1.0], []]]):
        with pytest.raises(ValueError, match="epoch"):
            EpochDraws(bad)
    # each epoch's own lag goes with it
    lagged = EpochDraws(epochs, lags_s=[0.1, 0.2])
    for epoch in range(10):
        first = lagged(0, epoch, 0, rng)
        assert lagged.round_end_lag_s(epoch) == (0.1 if first == 1.0 else 0.2)
    assert EpochDraws(epochs).round_end_lag_s(0) == 0.0
    with pytest.raises(ValueError, match="one lag per epoch"):
        EpochDraws(epochs, lags_s=[0.1])
