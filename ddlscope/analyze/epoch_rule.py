"""Why a swarm run overshot its target batch: hivemind's epoch-ending rule checked on the run's steps.

:mod:`ddlscope.modeling.progress` models when a hivemind peer ends its global epoch. This module
takes a stored ``collaborative`` run and

- **replays** the rule on its steps (:func:`ddlscope.modeling.progress.replay_transitions`): at
  every step end, the rule's answer given what happened before, against what the peer did;
- **simulates** the rule on the run's own step times (:func:`ddlscope.modeling.progress.simulate_overshoot`),
  drawn at random from the run's steps at the same position in their epoch (the first after the
  round, the second, the third or later), and gives the overshoot that follows from them.

When both agree with the run, the overshoot is explained by its step times: where in the epoch
hivemind's own work slowed the steps. A share that ends with a step longer than the peer's
average ends at the tracker's estimate; one that ends with a shorter step is followed by another
step. Each peer's steps are drawn from its own (peers on uneven links step differently). On issue
14's runs (2 one-core peers, MobileNetV2/MNIST, 2 steps of 32 per peer per epoch, 2026-11-29;
``docs/validation.md``, stop 46) the replays gave 90-98 % of the decisions, and the simulations came
within 0.06 steps of the measured overshoot but on the uneven pair (0.08). The overshoot rose with
the ratio of the first step after the round to the second (0.23-0.25 at 0.78-0.82, 0.36-0.38 at
0.89-0.97), not with the link's rate:

============  =========  ==========  =====  ==========  =========
link          first (s)  second (s)  ratio  overshoot   simulated
============  =========  ==========  =====  ==========  =========
50 Mbit/s     1.00       1.28        0.78   0.25        0.25
200 Mbit/s    1.07       1.30        0.82   0.23        0.23
100 Mbit/s    1.23       1.41        0.87   0.30        0.32
loopback      1.19       1.33        0.89   0.38        0.32
20 Mbit/s     1.17       1.27        0.92   0.38        0.40
200/20 Mbit/s 1.16       1.20        0.97   0.36        0.44
============  =========  ==========  =====  ==========  =========
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass

from ddlscope.modeling.progress import (DHT_LATENCY_S, TracedStep, TrackerSettings, replay_transitions,
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
        simulated_overshoot_steps: the rule's mean steps per peer per epoch beyond the target on
            these step times.
    """

    decisions: int
    agreed: int
    step_s_by_position: list[float | None]
    steps_by_position: list[int]
    simulated_overshoot_steps: float


def check_epoch_rule(steps: list[dict], target_batch_size: int, batch_size: int,
                     seed: int = 0) -> EpochRuleCheck | None:
    """Replay and simulate hivemind's rule on a swarm run's step rows (every peer's).

    Args:
        steps: step rows with ``worker_index``, ``step``, ``wall_time`` (start, s), ``step_s``,
            ``data_load_s``, ``forward_s``, ``backward_s``, ``samples``, ``global_epoch`` and ``warmup``.
        target_batch_size, batch_size: the run's, samples.
        seed: the simulation's random draws.

    Returns:
        the check, or None where it cannot be made: fewer than 2 trainers, a step without its
        times or epoch, or a peer without steps after the first epoch at the first two positions.
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
    for index, peer in enumerate(sorted(by_peer)):
        rows = sorted(by_peer[peer], key=lambda r: r["step"])
        previous_epoch, position, since = 0, 0, None
        traced[index] = []
        pools[index] = [[] for _ in range(POSITIONS)]
        for i, r in enumerate(rows):
            report = float(r["wall_time"]) + float(r.get("data_load_s") or 0.0) + r["forward_s"] + r["backward_s"]
            ended = int(r["global_epoch"]) > previous_epoch
            traced[index].append(TracedStep(report, float(r["wall_time"]) + r["step_s"], int(r["samples"]), ended))
            # the step times of whole epochs after the first (the last step may be cut by the run's end)
            if since is not None and not r.get("warmup") and previous_epoch > 0 and i < len(rows) - 1:
                pools[index][min(position, POSITIONS - 1)].append(report - since)
            position, since = (0, float(r["wall_time"]) + r["step_s"]) if ended else (position + 1, report)
            previous_epoch = int(r["global_epoch"])
    if any(not mine[0] or not mine[1] for mine in pools.values()):
        return None
    settings = TrackerSettings(target_batch_size, latency_s=DHT_LATENCY_S)
    last = min(ts[-1].report_s for ts in traced.values())
    replayed = [(d, took) for d, took in replay_transitions(traced, settings, start_s=start) if d.at_s <= last]
    rounds = [t.end_s - t.report_s for ts in traced.values() for t in ts if t.ended_epoch]

    def drawn(peer: int, epoch: int, position: int, rng: random.Random) -> float:
        mine = pools[peer]
        return rng.choice(mine[min(position, POSITIONS - 1)] or mine[1])

    simulated = simulate_overshoot(drawn, len(traced), batch_size, settings,
                                   round_s=statistics.median(rounds) if rounds else 0.0,
                                   epochs=SIMULATED_EPOCHS, seed=seed)
    by_position = [[t for mine in pools.values() for t in mine[i]] for i in range(POSITIONS)]
    return EpochRuleCheck(decisions=len(replayed), agreed=sum(d.ready == took for d, took in replayed),
                          step_s_by_position=[statistics.fmean(t) if t else None for t in by_position],
                          steps_by_position=[len(t) for t in by_position], simulated_overshoot_steps=simulated)
