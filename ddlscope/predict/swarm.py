"""Calibrating hivemind: a short collaborative run of a reference network among the calibration workers.

The collaborative cost model (:func:`ddlscope.predict.costs.predict_collaborative`) accumulates
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
trains :data:`REFERENCE` (random inputs) with ``hivemind.Optimizer`` at a target batch of
:data:`STEPS_PER_EPOCH` steps per peer, and the fit reports, over whole global epochs after the
first (which includes start-up):

- ``epoch_overhead_s``: median over peers and epochs of the epoch's wall time beyond its steps'
  compute at the speed measured just before (the per-epoch time hivemind adds);
- ``overshoot_steps``: mean steps per peer per epoch beyond the target batch;
- ``epoch_cpu_s``: median CPU seconds of hivemind's processes and threads per epoch
  (:func:`ddlscope.measure.host.background_cpu_s`), for the record.

Both figures depend on ``matchmaking_time_s``: hivemind pre-schedules the gradient round once the
epoch's estimated end is that close, and the earlier it starts matchmaking the more of its work
overlaps the last steps. In swarms of the reference network on one-core peers, matchmaking 0.5 s
gave 0.75-0.92 overshoot steps and 1.6-1.8 s of overhead per epoch, matchmaking 1.0 s gave
0.33-0.5 steps and 1.8-2.4 s. So the swarm runs at the matchmaking time the predictions will
use (:data:`MATCHMAKING_S` by default, the validation grid's) and the fit records it. At 1 s
matchmaking starts about one step before the epoch's end, so by the cost model's own rule no
round waits for it. This module holds both sides:
:func:`measure_swarm` runs inside a calibration worker, :func:`fit_swarm` reduces the workers'
raw figures to a :class:`ddlscope.predict.cluster.HivemindFit`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from ddlscope.measure.host import background_cpu_s
from ddlscope.predict.cluster import HivemindFit

#: (network, dataset shape, samples per step): thesis 000's network on MNIST-shaped inputs
REFERENCE = ("resnet18", "mnist", 32)
#: each peer's share of the target batch, in steps (target batch = STEPS_PER_EPOCH x peers x batch)
STEPS_PER_EPOCH = 2
#: seconds; the default matchmaking time of the swarm (the validation grid's)
MATCHMAKING_S = 1.0
#: global epochs timed after the first (overshoot is a whole number of steps per epoch: its mean needs many)
EPOCHS = 12
#: a round not finished after this long is given up (hivemind's averaging_timeout)
ROUND_TIMEOUT_S = 15.0


def measure_swarm(rank: int, workers: int, epochs: int, deadline_s: float, say: Callable[[str], None],
                  matchmaking_time_s: float = MATCHMAKING_S) -> dict[str, Any]:
    """Train :data:`REFERENCE` with ``hivemind.Optimizer`` in this worker, all workers together.

    Needs the calibration's gloo process group (for the DHT address and a barrier). Stops after
    ``epochs + 1`` global epochs or ``deadline_s`` seconds of training. ``matchmaking_time_s``:
    hivemind's ``matchmaking_time`` (seconds).

    Returns:
        ``compute_alone_s`` (median step compute before the optimizer existed, seconds),
        ``param_bytes``, ``matchmaking_time_s``, and ``steps``: per step ``[compute s, hivemind step s, local epoch after,
        background CPU s]``.
    """
    import hivemind
    import torch
    import torch.distributed as dist

    from ddlscope.predict.calibrate import _timed
    from ddlscope.strategies.collaborative import shutdown_hivemind
    from ddlscope.workloads.models import build_model, input_spec

    network, family, batch = REFERENCE
    torch.manual_seed(rank)
    model = build_model(network, family)
    spec = input_spec(family)
    x = torch.randn(batch, spec.channels, spec.height, spec.width)
    y = torch.randint(0, spec.num_classes, (batch,))
    loss_fn = torch.nn.CrossEntropyLoss()

    def compute() -> None:
        loss_fn(model(x), y).backward()

    maddrs: list[Any] = [None]
    if rank == 0:
        dht = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
        maddrs = [[str(a) for a in dht.get_visible_maddrs()]]
    dist.broadcast_object_list(maddrs, src=0)
    if rank != 0:
        dht = hivemind.DHT(initial_peers=maddrs[0], host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    try:
        for _ in range(3):  # the first steps allocate gradients and warm the allocator
            compute()
        model.zero_grad()
        alone = statistics.median(_timed(compute) for _ in range(5))
        model.zero_grad()
        opt = hivemind.Optimizer(
            dht=dht, run_id="ddlscope-calibrate-swarm", batch_size_per_step=batch,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
            target_batch_size=STEPS_PER_EPOCH * workers * batch, matchmaking_time=matchmaking_time_s,
            averaging_timeout=ROUND_TIMEOUT_S, verbose=False)
        dist.barrier()
        steps: list[list[float]] = []
        deadline = time.monotonic() + deadline_s
        before = background_cpu_s()
        try:
            while opt.local_epoch < epochs + 1 and time.monotonic() < deadline:
                compute_s = _timed(compute)
                t0 = time.perf_counter()
                opt.step(batch_size=batch)
                opt.zero_grad()
                after = background_cpu_s()
                steps.append([compute_s, time.perf_counter() - t0, opt.local_epoch, max(0.0, after - before)])
                before = after
        finally:
            shutdown_hivemind(opt, None)
        say(f"hivemind swarm: {network} on {family} shapes, {len(steps)} steps, global epoch {opt.local_epoch}")
        return {"compute_alone_s": alone, "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
                "matchmaking_time_s": matchmaking_time_s, "steps": steps}
    finally:
        dht.shutdown()


def fit_swarm(raw: list[dict[str, Any]]) -> HivemindFit:
    """Reduce every worker's :func:`measure_swarm` figures to a :class:`HivemindFit` (see the module docstring).

    Raises:
        ValueError: a worker timed fewer than 2 whole global epochs after the first.
    """
    overheads, cpu, extra_steps = [], [], []
    for rank, w in enumerate(raw):
        steps = w["steps"]
        ends = [i for i in range(1, len(steps)) if steps[i][2] > steps[i - 1][2]]
        if len(ends) < 3:
            raise ValueError(f"the hivemind swarm's worker {rank} timed {max(0, len(ends) - 1)} whole global epochs "
                             f"after the first; need at least 2")
        for start, end in zip(ends, ends[1:]):
            epoch = steps[start + 1:end + 1]
            overheads.append(sum(c + t for c, t, *_ in epoch) - len(epoch) * w["compute_alone_s"])
            cpu.append(sum(s[3] for s in epoch))
            extra_steps.append(len(epoch) - STEPS_PER_EPOCH)
    return HivemindFit(epoch_overhead_s=max(0.0, statistics.median(overheads)),
                       overshoot_steps=max(0.0, statistics.fmean(extra_steps)),
                       epoch_cpu_s=statistics.median(cpu), reference=f"{REFERENCE[0]} on {REFERENCE[1]} shapes, "
                       f"{STEPS_PER_EPOCH} steps of {REFERENCE[2]} per peer per epoch",
                       reference_param_bytes=int(raw[0]["param_bytes"]),
                       matchmaking_time_s=float(raw[0]["matchmaking_time_s"]))
