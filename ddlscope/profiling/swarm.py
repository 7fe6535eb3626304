"""Calibrating hivemind: a short collaborative run of a reference network among the calibration workers.

The collaborative cost model (:func:`ddlscope.distribution.collaborative.predict_collaborative`) accumulates
the target batch from the peers' profiled steps. On CPU peers two things that belong to hivemind,
not to the workload, make real runs slower and gloo microbenchmarks cannot see them:

- **hivemind's own work**: beside the training loop every peer runs a DHT process, a ``p2pd``
  daemon, an averager process per averaged state and a progress-tracker thread, all on the
  peer's cores. Matchmaking, the gradient round, the parameter round that follows in the
  background, progress reports and polling took 1.0-1.6 CPU-seconds per global epoch on one-core
  peers in every workload measured here (9 MB MobileNetV2 and 45 MB ResNet-18 alike).
- **overshoot**: a peer acts on the swarm's progress only between its steps and learns of the
  other peers' progress late (``ProgressTracker`` refreshes at most every 0.5 s), so a global
  epoch holds more than the target batch.

A synthetic model does not reproduce these (their cost depended on its tensor layout and varied
by 2x between runs); the real training of a fixed reference network does. So every worker
trains a reference network (random inputs; :data:`REFERENCE` unless the calibration names another)
with ``hivemind.Optimizer`` at a target batch of :data:`STEPS_PER_EPOCH` steps per peer, once per
batch size (:data:`BATCH_SIZES` unless named), and the fit reads whole global epochs after the
first (which includes start-up).

The time hivemind adds per epoch grows with the peers' step: in validation runs on one-core peers
it was 1.3-1.6 s for VGG-11 (0.2-0.3 s steps) and 1.9-2.2 s for ResNet-18 (0.8-1.0 s steps),
and 9 MB MobileNetV2 mostly sat between them by its step, not by its bytes. Two causes: the
peer that ends the epoch waits for the others to finish the step they are in, and hivemind's
polling threads use CPU for as long as the epoch lasts. One reference batch size cannot separate
that from the fixed part, so the swarm runs at two (about 0.8 and 0.25 s steps here) and the fit
draws a line through them:

- ``epoch_overhead_s`` + ``overhead_steps`` x the step: the epoch's wall time beyond its steps'
  compute at the speed measured just before, a trimmed mean over peers and epochs of each swarm;
- ``step_pattern_s``: where hivemind's work lands in an epoch's steps (the compute beyond the
  compute alone of the first step after the round, the second, later ones): the prediction runs
  hivemind's epoch-ending rule on it (:mod:`ddlscope.modeling.progress`), which gives the
  overshoot at any steps per peer;
- ``overshoot_steps``: mean steps per peer per epoch beyond the target batch, over both swarms,
  and ``overshoot_points``, each swarm's own (a prediction from a fit without the pattern reads
  them at its peers' step). The
  overshoot depends on the network and its step in ways no trend in the step captures (on this
  machine, 2026-11-28: resnet18 overshot 0.5 steps at batch 32, 0.86 s steps, and 0.6 at batch 8,
  0.22 s; mobilenet_v2 0.3 at batch 32, 0.64 s, and 1.5 at batch 8, 0.35 s; training runs of
  mobilenet_v2 at batch 32 overshot 0.2-0.4). So ``calibrate --hivemind --swarm-network
  --swarm-dataset --swarm-batch-sizes`` can train the workload's own network at its own batch;
- ``epoch_cpu_s``: median CPU seconds of hivemind's processes and threads per epoch
  (:func:`ddlscope.measure.host.background_cpu_s`), for the record;
- ``peer_startup_s``: what a peer that joins a running swarm takes before its first step, beside
  loading the swarm's state (:func:`fit_peer_startup`): a fresh interpreter importing torch,
  hivemind and ddlscope's worker and building its network and first optimizer
  (:data:`PEER_PROCESS`), joining the DHT, making the ``hivemind.Optimizer``. A rejoining peer in a churn
  validation run took 7.6 s from its start to its first step.

These figures depend on ``matchmaking_time_s`` too: hivemind pre-schedules the gradient round
once the epoch's estimated end is that close, and the earlier it starts matchmaking the more of its
work overlaps the last steps. In swarms of the reference network at batch 32, matchmaking 0.5 s
gave 0.75-0.92 overshoot steps and 1.6-1.8 s of overhead per epoch, matchmaking 1.0 s gave
0.33-0.5 steps and 1.8-2.4 s. So the swarm runs at the matchmaking time the predictions will
use (:data:`MATCHMAKING_S` by default, the validation grid's) and the fit records it. The
overhead is fitted as measured, including any wait for matchmaking; the cost model takes the
larger of the two (:func:`ddlscope.distribution.collaborative.predict_collaborative`). This module holds both
sides: :func:`measure_swarm` runs inside a calibration worker, :func:`swarm_epochs` collects the
workers' epochs and :func:`fit_swarm` reduces them to a :class:`ddlscope.modeling.cluster.HivemindFit`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from ddlscope.measure.host import BackgroundCpu
from ddlscope.measure.stats import time_call, time_repeats, trimmed_mean
from ddlscope.modeling.cluster import HivemindFit

PEER_PROCESS = """
import torch, hivemind
import ddlscope.strategies.collaborative, ddlscope.train.loop, ddlscope.train.worker
from ddlscope.workloads.models import build_model
from ddlscope.workloads.step import build_optimizer
build_optimizer(build_model({network!r}, {dataset!r}).parameters(), "sgd")
"""
"""What a peer's fresh process does before it joins the swarm, timed as ``import_s``: import torch, hivemind and
ddlscope's worker, build its network and its optimizer. A process's first torch optimizer imports
``torch._dynamo`` (torch 2.13: 0.78-0.81 s on one core of a 2-core Xeon, 2026-12-06), which a rejoining
peer in a churn run pays; timing only ``import torch, hivemind`` had such a peer predicted 1.3-2.7 s early
(docs/validation.md, stop 68)."""
#: (network, dataset shape): thesis 000's network on MNIST-shaped inputs
REFERENCE = ("resnet18", "mnist")
#: samples per step of the reference swarms, one swarm each (about 0.8 and 0.25 s steps on one core)
BATCH_SIZES = (32, 8)
#: each peer's share of the target batch, in steps (target batch = STEPS_PER_EPOCH x peers x batch)
STEPS_PER_EPOCH = 2
#: seconds; the default matchmaking time of the swarm (the validation grid's)
MATCHMAKING_S = 1.0
#: global epochs timed after the first, per swarm (overshoot is a whole number of steps per epoch: its mean needs many)
EPOCHS = 10
#: positions in an epoch the steps' pattern is kept by: the first step after the round, the second, later ones
PATTERN_POSITIONS = 3
#: a round not finished after this long is given up (hivemind's averaging_timeout)
ROUND_TIMEOUT_S = 15.0


def measure_swarm(rank: int, workers: int, epochs: int, deadline_s: float, say: Callable[[str], None],
                  matchmaking_time_s: float = MATCHMAKING_S, reference: tuple[str, str] = REFERENCE,
                  batch_sizes: tuple[int, ...] = BATCH_SIZES) -> dict[str, Any]:
    """Train ``reference`` (zoo network, dataset shape; default :data:`REFERENCE`) with
    ``hivemind.Optimizer`` in this worker, all workers together, once per batch size of
    ``batch_sizes`` (default :data:`BATCH_SIZES`).

    Needs the calibration's gloo process group (for the DHT address and barriers). Each swarm stops
    after ``epochs + 1`` global epochs or ``deadline_s`` seconds of training; each global epoch
    it reaches is a progress line (``say``), which keeps the calibration's watchdog from firing.
    ``matchmaking_time_s``: hivemind's ``matchmaking_time`` (seconds).

    Returns:
        ``param_bytes``, ``matchmaking_time_s`` and ``swarms``: per batch size ``batch_size``,
        ``compute_alone_s`` (median step compute before the optimizer existed, seconds) and
        ``steps``: per step ``[compute s, hivemind step s, local epoch after, background CPU s]``,
        ``optimizer_init_s`` (seconds to make its ``hivemind.Optimizer`` around a torch optimizer made
        before); ``import_s`` (a fresh interpreter running :data:`PEER_PROCESS`, seconds) and ``join_s`` (joining the DHT through
        worker 0's address; None on worker 0, which starts it).
    """
    import subprocess
    import sys

    import hivemind
    import torch.distributed as dist

    from ddlscope.launch.network import p2p_options
    from ddlscope.workloads.models import build_model

    param_bytes = sum(p.numel() * p.element_size() for p in build_model(*reference).parameters())
    t0 = time.perf_counter()  # what a new peer's process does before anything of the swarm
    subprocess.run([sys.executable, "-c", PEER_PROCESS.format(network=reference[0], dataset=reference[1])], check=True,
                   capture_output=True, timeout=300)
    import_s = time.perf_counter() - t0
    join_s = None
    maddrs: list[Any] = [None]
    if rank == 0:
        dht = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True, **p2p_options())
        maddrs = [[str(a) for a in dht.get_visible_maddrs()]]
    dist.broadcast_object_list(maddrs, src=0)
    if rank != 0:
        t0 = time.perf_counter()
        dht = hivemind.DHT(initial_peers=maddrs[0], host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True, **p2p_options())
        join_s = time.perf_counter() - t0
    try:
        swarms = [_one_swarm(hivemind, dht, rank, batch, workers, epochs, deadline_s, matchmaking_time_s, say,
                             reference) for batch in batch_sizes]
    finally:
        dht.shutdown()
    return {"param_bytes": param_bytes, "matchmaking_time_s": matchmaking_time_s, "reference": list(reference),
            "swarms": swarms, "import_s": import_s, "join_s": join_s}


def _one_swarm(hivemind, dht, rank: int, batch: int, workers: int, epochs: int, deadline_s: float,
               matchmaking_time_s: float, say: Callable[[str], None], reference: tuple[str, str]) -> dict[str, Any]:
    """One swarm of :func:`measure_swarm` at ``batch`` samples per step (its own hivemind run id).

    Each swarm trains its own copy of ``reference`` (seeded by ``rank``): the previous swarm's
    ``hivemind.Optimizer`` may still be shutting down in the background (``shutdown_hivemind`` gives
    up waiting after a few seconds), and its pending parameter round then copies the averaged
    parameters into its model, which must not be the one the next swarm is differentiating (a CI
    run failed with "modified by an inplace operation" when the swarms shared one).
    """
    import torch
    import torch.distributed as dist

    from ddlscope.strategies.collaborative import shutdown_hivemind
    from ddlscope.workloads.models import build_model, input_spec
    from ddlscope.workloads.step import build_optimizer, loss_function

    torch.manual_seed(rank)
    model = build_model(*reference)
    spec = input_spec(reference[1])
    x = torch.randn(batch, spec.channels, spec.height, spec.width)
    y = torch.randint(0, spec.num_classes, (batch,))
    loss_fn = loss_function()

    def compute() -> None:  # the step's forward and backward; hivemind.Optimizer does the rest
        loss_fn(model(x), y).backward()

    for _ in range(3):  # the first steps allocate gradients and warm the allocator
        compute()
    model.zero_grad()
    alone = statistics.median(time_repeats(compute, 5))
    model.zero_grad()
    local = build_optimizer(model.parameters(), "sgd")  # a process's first one imports torch._dynamo: not hivemind's
    t0 = time.perf_counter()
    opt = hivemind.Optimizer(
        dht=dht, run_id=f"ddlscope-calibrate-swarm-b{batch}", batch_size_per_step=batch, optimizer=local,
        target_batch_size=STEPS_PER_EPOCH * workers * batch, matchmaking_time=matchmaking_time_s,
        averaging_timeout=ROUND_TIMEOUT_S, verbose=False)
    optimizer_init_s = time.perf_counter() - t0
    dist.barrier()
    steps: list[list[float]] = []
    deadline = time.monotonic() + deadline_s
    read_background_cpu = BackgroundCpu()  # read every step, as a collaborative peer reads it
    before = read_background_cpu()
    try:
        while opt.local_epoch < epochs + 1 and time.monotonic() < deadline:
            compute_s = time_call(compute)
            t0 = time.perf_counter()
            opt.step(batch_size=batch)
            opt.zero_grad()
            after = read_background_cpu()
            if opt.local_epoch > (steps[-1][2] if steps else 0):
                say(f"hivemind swarm, batch {batch}: global epoch {opt.local_epoch} of {epochs + 1}")
            steps.append([compute_s, time.perf_counter() - t0, opt.local_epoch, max(0.0, after - before)])
            before = after
    finally:
        shutdown_hivemind(opt, None)
    dist.barrier()  # no peer of this swarm still averaging when the next one starts
    say(f"hivemind swarm: {reference[0]} on {reference[1]} shapes, batch {batch}, {len(steps)} steps, "
        f"global epoch {opt.local_epoch}")
    return {"batch_size": batch, "compute_alone_s": alone, "steps": steps, "optimizer_init_s": optimizer_init_s}


def swarm_epochs(raw: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every whole global epoch after the first of every worker, per swarm of :func:`measure_swarm`.

    Returns:
        per swarm: ``batch_size``, ``compute_alone_s`` (median over workers, seconds) and per
        epoch (all workers) ``overhead_s`` (wall time beyond the steps' compute alone),
        ``compute_overhead_s`` (the epoch's compute beyond its steps' compute alone: what
        hivemind's background work added to the steps), ``extra_steps`` (steps beyond the target)
        and ``cpu_s`` (hivemind's CPU seconds); ``step_extra_s``: per position in the epoch
        (:data:`PATTERN_POSITIONS`: the first step after the round, the second, later ones), every
        such step's compute beyond the compute alone, seconds; and ``epoch_step_extra_s``: the
        same figures kept together per global epoch that every worker timed whole, per worker in
        rank order, its steps in order (``[[[s0, s1], [s0, s1, s2]], ...]``).

    Raises:
        ValueError: a worker timed fewer than 2 whole global epochs after the first in a swarm.
    """
    out = []
    for i in range(len(raw[0]["swarms"])):
        alone, overheads, in_steps, extra, cpu = [], [], [], [], []
        by_position: list[list[float]] = [[] for _ in range(PATTERN_POSITIONS)]
        by_epoch: list[dict[int, list[float]]] = []  # per worker: global epoch -> its steps' extras
        for rank, w in enumerate(raw):
            swarm = w["swarms"][i]
            steps = swarm["steps"]
            ends = [j for j in range(1, len(steps)) if steps[j][2] > steps[j - 1][2]]
            by_epoch.append({})
            if len(ends) < 3:
                raise ValueError(f"the hivemind swarm at batch {swarm['batch_size']}: worker {rank} timed "
                                 f"{max(0, len(ends) - 1)} whole global epochs after the first; need at least 2")
            alone.append(swarm["compute_alone_s"])
            for start, end in zip(ends, ends[1:]):
                epoch = steps[start + 1:end + 1]
                overheads.append(sum(c + t for c, t, *_ in epoch) - len(epoch) * swarm["compute_alone_s"])
                in_steps.append(sum(s[0] for s in epoch) - len(epoch) * swarm["compute_alone_s"])
                cpu.append(sum(s[3] for s in epoch))
                extra.append(len(epoch) - STEPS_PER_EPOCH)
                by_epoch[-1][steps[start][2]] = [step[0] - swarm["compute_alone_s"] for step in epoch]
                for position, step in enumerate(epoch):
                    by_position[min(position, PATTERN_POSITIONS - 1)].append(step[0] - swarm["compute_alone_s"])
        out.append({"batch_size": raw[0]["swarms"][i]["batch_size"], "compute_alone_s": statistics.median(alone),
                    "overhead_s": overheads, "compute_overhead_s": in_steps, "extra_steps": extra, "cpu_s": cpu,
                    "step_extra_s": by_position,
                    "epoch_step_extra_s": [[mine[e] for mine in by_epoch]
                                           for e in sorted(set.intersection(*(set(m) for m in by_epoch)))]})
    return out


def fit_peer_startup(raw: list[dict[str, Any]]) -> float | None:
    """A joining peer's start-up, seconds: the median over workers of a fresh interpreter's start
    (:data:`PEER_PROCESS`: imports, the reference network and its first optimizer), plus the median
    DHT join (workers other than 0), plus the median ``hivemind.Optimizer`` creation (every worker
    and swarm), from :func:`measure_swarm`'s results ``raw``. Reading the peer's own dataset is not
    in it (milliseconds for the validation's synthetic MNIST). None when a part is missing (a result
    from before these were measured)."""
    imports = [w["import_s"] for w in raw if w.get("import_s") is not None]
    joins = [w["join_s"] for w in raw if w.get("join_s") is not None]
    inits = [sw["optimizer_init_s"] for w in raw for sw in w["swarms"] if sw.get("optimizer_init_s") is not None]
    if not (imports and joins and inits):
        return None
    return statistics.median(imports) + statistics.median(joins) + statistics.median(inits)


def fit_swarm(swarms: list[dict[str, Any]], param_bytes: int, matchmaking_time_s: float,
              reference: tuple[str, str] = REFERENCE) -> HivemindFit:
    """Reduce the swarms' epochs (:func:`swarm_epochs`) to a :class:`HivemindFit` (see the module docstring).

    ``param_bytes``, ``matchmaking_time_s`` and ``reference``: the reference network's bytes, the
    swarms' matchmaking time and what was trained, as :func:`measure_swarm` returns them. The
    overshoot is kept per swarm (``overshoot_points``: its compute step, its mean extra steps) and
    as their mean. Per swarm: the epochs' typical overhead, a 10 % trimmed mean
    (:func:`ddlscope.measure.stats.trimmed_mean`: an epoch's time adds up, so the mean, not the
    median; trimmed, so that one averaging round given up after :data:`ROUND_TIMEOUT_S` does not
    decide it), against the swarm's compute step. A least-squares line through those points gives
    ``epoch_overhead_s`` (intercept, seconds) and ``overhead_steps`` (slope); a slope below 0 is
    taken as 0 (the mean overhead), an intercept below 0 as 0 (a line through the origin). One
    swarm: slope 0. Of that overhead, ``compute_overhead_s`` is what landed in the steps' compute
    (hivemind's background work on the peer's cores while it trains): the epochs' compute beyond
    their steps' compute alone, a 10 % trimmed mean over every epoch of every swarm, at least 0.
    ``step_pattern_s``: where in the epoch that work lands, per position (:data:`PATTERN_POSITIONS`),
    the mean and standard deviation over every swarm's steps there of the compute beyond the
    compute alone (positions with fewer than 2 steps end the list), and ``step_epochs_s``, the
    same figures per global epoch that every worker timed, all swarms' epochs together: the cost
    model runs hivemind's epoch-ending rule on these epochs drawn whole
    (:class:`ddlscope.modeling.progress.EpochDraws`), or on the pattern for a fit without them.
    """
    import numpy as np

    step = np.array([sw["compute_alone_s"] for sw in swarms])
    overhead = np.array([trimmed_mean(sw["overhead_s"]) for sw in swarms])
    slope = float(np.polyfit(step, overhead, 1)[0]) if len(swarms) > 1 and np.ptp(step) > 0 else 0.0
    if slope <= 0:
        slope, intercept = 0.0, float(overhead.mean())
    else:
        intercept = float(overhead.mean() - slope * step.mean())
        if intercept < 0:
            slope, intercept = float((step * overhead).sum() / (step * step).sum()), 0.0
    batches = "/".join(str(sw["batch_size"]) for sw in swarms)
    points = sorted((float(sw["compute_alone_s"]), max(0.0, statistics.fmean(sw["extra_steps"]))) for sw in swarms)
    pattern = []
    for position in range(PATTERN_POSITIONS):
        values = [x for sw in swarms for x in (sw.get("step_extra_s") or [[]] * PATTERN_POSITIONS)[position]]
        if len(values) < 2:
            break
        pattern.append((statistics.fmean(values), statistics.stdev(values)))
    return HivemindFit(epoch_overhead_s=max(0.0, intercept), overhead_steps=slope,
                       compute_overhead_s=max(0.0, trimmed_mean([x for sw in swarms for x in sw["compute_overhead_s"]])),
                       overshoot_steps=max(0.0, statistics.fmean(x for sw in swarms for x in sw["extra_steps"])),
                       overshoot_points=points, step_pattern_s=pattern,
                       step_epochs_s=[e for sw in swarms for e in sw.get("epoch_step_extra_s") or []],
                       epoch_cpu_s=statistics.median(x for sw in swarms for x in sw["cpu_s"]),
                       reference=f"{reference[0]} on {reference[1]} shapes, {STEPS_PER_EPOCH} steps of {batches} "
                       f"per peer per epoch", reference_param_bytes=int(param_bytes), reference_network=reference[0],
                       matchmaking_time_s=float(matchmaking_time_s))
