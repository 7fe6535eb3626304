"""Why a swarm run overshot its target batch: hivemind's epoch-ending rule checked on the run's steps.

:mod:`ddlscope.modeling.progress` models when a hivemind peer ends its global epoch. This module
takes a stored ``collaborative`` run and

- **replays** the rule on its steps (:func:`ddlscope.modeling.progress.replay_transitions`): at
  every step end, the rule's answer given what happened before, against what the peer did;
- **simulates** the rule on the run's own step times (:func:`ddlscope.modeling.progress.simulate_overshoot`):
  its epochs drawn whole (:class:`ddlscope.modeling.progress.EpochDraws`), each with the lag it
  had (how much later the round before it ended for the peer with the shortest first step), and
  gives the overshoot that follows from them.

When both agree with the run, the overshoot is explained by its step times: where in the epoch
hivemind's own work slowed the steps. A share that ends with a step longer than the peer's
average ends at the tracker's estimate; one that ends with a shorter step is followed by another
step. On issue 14's runs (2 one-core peers, MobileNetV2/MNIST, 2 steps of 32 per peer per epoch,
2026-11-29; ``docs/validation.md``, stop 46) the replays gave 90-98 % of the decisions, and the
overshoot rose with the ratio of the first step after the round to the second (0.23-0.25 at
0.78-0.82, 0.36-0.38 at 0.89-0.97), not with the link's rate:

============  =========  ==========  =====  ==========
link          first (s)  second (s)  ratio  overshoot
============  =========  ==========  =====  ==========
50 Mbit/s     1.00       1.28        0.78   0.25
200 Mbit/s    1.07       1.30        0.82   0.23
100 Mbit/s    1.23       1.41        0.87   0.30
loopback      1.19       1.33        0.89   0.38
20 Mbit/s     1.17       1.27        0.92   0.38
200/20 Mbit/s 1.16       1.20        0.97   0.36
============  =========  ==========  =====  ==========

Those means hide how an epoch's peers pair up: hivemind's work after a round lands on one peer's
first step and leaves the other's clean, and on a link the peer with the clean step ends the
round later (2026-12-02, ``docs/validation.md``, stop 50). On 11 runs of the same pair (loopback,
200 and 50 Mbit/s, the 200/20 pair) the simulation came within a median 0.03 steps of the measured
overshoot (at most 0.12, on the uneven pair) with epochs drawn whole, each with its own lag, and
within 0.05 (at most 0.14) with steps drawn per peer and position.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from ddlscope.modeling.progress import (DHT_LATENCY_S, EpochDraws, TracedStep, TrackerSettings, replay_transitions,
                                        simulate_overshoot)

POSITIONS = 3
"""Positions in an epoch the step times are grouped by: first after the round, second, third or later."""
SIMULATED_EPOCHS = 1000
"""Epochs the simulation counts (its mean moved by at most 0.015 steps between seeds on issue 14's runs)."""


@dataclass(frozen=True)
class EpochRuleCheck:
    """The rule against one run.

    Attributes:
        decisions: step ends replayed (before the first peer's last step).
        agreed: of them, those where the rule's answer was what the peer did.
        step_s_by_position: mean seconds from a step's start (the round's end, or the peer's previous
            report) to its report, per :data:`POSITIONS` position; None where no step was there.
        steps_by_position: the steps behind each mean.
        round_end_lag_s: median seconds by which the peer with the shortest first step after a round
            ended that round after the others (mean of their ends), over the epochs every peer
            timed whole; negative where it ended first.
        simulated_overshoot_steps: the rule's mean steps per peer per epoch beyond the target on
            these epochs drawn whole, each with its own lag.
    """

    decisions: int
    agreed: int
    step_s_by_position: list[float | None]
    steps_by_position: list[int]
    round_end_lag_s: float
    simulated_overshoot_steps: float


def check_epoch_rule(steps: list[dict], target_batch_size: int, batch_size: int,
                     seed: int = 0) -> EpochRuleCheck | None:
    """Replay and simulate hivemind's rule on a swarm run's step rows (every peer's).

    The simulation draws the run's own epochs whole (:class:`ddlscope.modeling.progress.EpochDraws`:
    one epoch's peers together, since hivemind's work after a round lands on one of them), each
    with its own lag: how much later the round before it ended for the peer with the shortest
    first step.

    Args:
        steps: step rows with ``worker_index``, ``step``, ``wall_time`` (start, s), ``step_s``,
            ``data_load_s``, ``forward_s``, ``backward_s``, ``samples``, ``global_epoch`` and ``warmup``.
        target_batch_size, batch_size: the run's, samples.
        seed: the simulation's random draws.

    Returns:
        the check, or None where it cannot be made: fewer than 2 trainers, a step without its
        times or epoch, a peer without steps after the first epoch at the first two positions, or
        no epoch that every peer timed whole.
    """
    by_peer: dict[int, list[dict]] = {}
    for s in steps:
        by_peer.setdefault(int(s["worker_index"]), []).append(s)
    if len(by_peer) < 2 or any(s.get(k) is None for s in steps
                               for k in ("forward_s", "backward_s", "step_s", "global_epoch")):
        return None
    start = min(float(s["wall_time"]) for s in steps)
    traced: dict[int, list[TracedStep]] = {}
    pools: dict[int, list[list[float]]] = {}  # per peer (renumbered), per position: its step times
    whole: dict[int, dict[int, list[float]]] = {}  # per peer, per epoch timed whole: its step times in order
    began: dict[int, dict[int, float]] = {}  # per peer, per epoch: when its round before ended
    for index, peer in enumerate(sorted(by_peer)):
        rows = sorted(by_peer[peer], key=lambda r: r["step"])
        previous_epoch, position, since = 0, 0, None
        traced[index], whole[index], began[index] = [], {}, {}
        pools[index] = [[] for _ in range(POSITIONS)]
        cut: set[int] = set()
        for i, r in enumerate(rows):
            report = float(r["wall_time"]) + float(r.get("data_load_s") or 0.0) + r["forward_s"] + r["backward_s"]
            ended = int(r["global_epoch"]) > previous_epoch
            traced[index].append(TracedStep(report, float(r["wall_time"]) + r["step_s"], int(r["samples"]), ended))
            # the step times of whole epochs after the first (the last step may be cut by the run's end)
            if since is not None and not r.get("warmup") and previous_epoch > 0 and i < len(rows) - 1:
                pools[index][min(position, POSITIONS - 1)].append(report - since)
                whole[index].setdefault(previous_epoch, []).append(report - since)
            else:
                cut.add(previous_epoch)
            if ended:
                began[index][int(r["global_epoch"])] = float(r["wall_time"]) + r["step_s"]
            position, since = (0, float(r["wall_time"]) + r["step_s"]) if ended else (position + 1, report)
            previous_epoch = int(r["global_epoch"])
        whole[index] = {e: t for e, t in whole[index].items() if e not in cut and e in began[index]}
    common = sorted(set.intersection(*(set(w) for w in whole.values())))
    if any(not mine[0] or not mine[1] for mine in pools.values()) or not common:
        return None
    epochs = [[whole[q][e] for q in sorted(whole)] for e in common]
    lags = []  # per epoch: how much later the peer with the shortest first step began it than the others
    for e in common:
        fast = min(whole, key=lambda q: whole[q][e][0])
        lags.append(began[fast][e] - statistics.fmean(began[q][e] for q in began if q != fast))
    settings = TrackerSettings(target_batch_size, latency_s=DHT_LATENCY_S)
    last = min(ts[-1].report_s for ts in traced.values())
    replayed = [(d, took) for d, took in replay_transitions(traced, settings, start_s=start) if d.at_s <= last]
    rounds = [t.end_s - t.report_s for ts in traced.values() for t in ts if t.ended_epoch]
    draws = EpochDraws(epochs, lags_s=lags)
    simulated = simulate_overshoot(draws, len(traced), batch_size, settings,
                                   round_s=statistics.median(rounds) if rounds else 0.0,
                                   epochs=SIMULATED_EPOCHS, seed=seed, round_end_lag_s=draws.round_end_lag_s)
    by_position = [[t for mine in pools.values() for t in mine[i]] for i in range(POSITIONS)]
    return EpochRuleCheck(decisions=len(replayed), agreed=sum(d.ready == took for d, took in replayed),
                          step_s_by_position=[statistics.fmean(t) if t else None for t in by_position],
                          steps_by_position=[len(t) for t in by_position],
                          round_end_lag_s=statistics.median(lags),
                          simulated_overshoot_steps=simulated)
