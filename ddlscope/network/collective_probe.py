"""What FSDP's unit collectives on CPU workers (gloo) carry over emulated links, each worker on one core.

A TCP transfer (:mod:`ddlscope.network.duplex`) says what a link carries both ways with bulk data.
gloo's all-gathers and reduce-scatters of an FSDP step carry less where they are large and the
link is slow: MobileNetV2's unit collectives, two workers each pinned to one core, took 0.767,
3.499 and 9.851 s per step over 200, 50 and 200/20 Mbit/s links, 0.93, 0.82 and 0.73 of the
rate, where the duplex probe read 0.95, 0.915 and 0.805. Messages up to 84 KB took their wire time
plus at most 1.5 ms; the 0.5-1.9 MB ones reached 0.62-0.80 of the slow links' rates. The fsdp
runs' step time beyond their compute matched these steps within 5 % (docs/validation.md, stop 41),
so fsdp's cost model prices its collectives over emulated links at what this probe measures
(``ClusterSpec.fsdp_link``, :func:`ddlscope.modeling.links.over_links`).

:func:`fsdp_collective_step_seconds` runs the steps; :func:`measure_fsdp_goodput` turns them into a
share of the slowest link's rate (:func:`~ddlscope.modeling.collectives.gloo_fsdp_step_wire_s` at
the configured rate over the measured step). Run as ``python -m ddlscope.network.collective_probe
--rank I ...`` inside a namespace (that is how the steps start each worker).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ddlscope.launch.processes import kill_processes

STEPS = 3
"""Measured steps after one warm-up step; the median is kept."""
PORT = 29613
"""The rendezvous port in worker 0's namespace (the namespaces are the probe's own: nothing else listens)."""


@dataclass(frozen=True)
class CollectiveGoodput:
    """FSDP's unit collectives (gloo) over a set of emulated links.

    Attributes:
        share: the step's wire time at the slowest link's configured rate
            (:func:`~ddlscope.modeling.collectives.gloo_fsdp_step_wire_s`) over the measured median
            step, in (0, 1] (capped at 1).
        step_s: the measured steps, seconds each (warm-up left out): from a barrier to the last
            worker's last collective.
        predicted_step_s: the step's wire time at the configured rate, seconds.
        unit_bytes: the units' parameter bytes, in forward order.
        cores: each worker's cores (None: not pinned).
    """

    share: float
    step_s: tuple[float, ...]
    predicted_step_s: float
    unit_bytes: tuple[int, ...]
    cores: tuple[tuple[int, ...], ...] | None


def fsdp_collective_step_seconds(rates_mbit_per_s: list[float], unit_bytes: list[int], steps: int = STEPS,
                                 reshard: bool = True, cores: list[list[int]] | None = None,
                                 bucket_ms: float | None = None) -> list[float]:
    """Seconds of each measured step (one warm-up step dropped) of FSDP's unit collectives among
    ``len(rates_mbit_per_s)`` CPU workers on torch's gloo backend, worker i in a namespace of its own
    with a link of ``rates_mbit_per_s[i]`` up and down and pinned to ``cores[i]`` (None: not pinned).
    A step is, per unit of ``unit_bytes[i]`` float32 parameter bytes (padded to a multiple of the
    workers, as FSDP2 pads), an ``all_gather_into_tensor`` in forward order, then in reverse order
    another with ``reshard`` (``reshard_after_forward``) and a ``reduce_scatter_tensor``; it lasts
    from a barrier to the last worker's last collective. No compute, no FSDP: the wire as gloo
    drives it. ``bucket_ms``: the links' token bucket (None: the default,
    :data:`~ddlscope.network.emulated.BUCKET_MS`).

    Raises:
        UserError: emulated networks cannot be built here (not root, no iproute2).
        ValueError: fewer than 2 workers, a rate <= 0, no unit with bytes > 0, ``steps`` < 1, or
            ``cores`` not one list per worker.
        RuntimeError: a worker failed (its output is in the message).
    """
    from ddlscope.network.emulated import BUCKET_MS, EmulatedNetwork, check_can_emulate

    n = len(rates_mbit_per_s)
    if n < 2 or not all(r > 0 for r in rates_mbit_per_s):
        raise ValueError(f"rates {rates_mbit_per_s}; allowed: at least 2 workers, each Mbit/s > 0")
    sizes = [int(b) for b in unit_bytes if b > 0]
    if not sizes or steps < 1:
        raise ValueError(f"unit_bytes {list(unit_bytes)}, steps = {steps}; allowed: at least one unit with bytes > 0, "
                         "steps >= 1")
    if cores is not None and (len(cores) != n or not all(cores)):
        raise ValueError(f"cores {cores}; allowed: one non-empty list of cores per worker")
    check_can_emulate()
    with tempfile.TemporaryDirectory() as folder, \
            EmulatedNetwork([(r, r) for r in rates_mbit_per_s],
                            bucket_ms=BUCKET_MS if bucket_ms is None else bucket_ms) as net:
        (Path(folder) / "units.json").write_text(json.dumps(sizes))
        env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=folder, GLOO_SOCKET_IFNAME=net.interface)
        procs = []
        try:
            for i in range(n):
                cmd = [sys.executable, "-m", "ddlscope.network.collective_probe", "--rank", str(i), "--workers",
                       str(n), "--master", net.address(0), "--folder", folder, "--steps", str(steps)] \
                    + (["--reshard"] if reshard else []) \
                    + (["--cores", ",".join(map(str, cores[i]))] if cores is not None else [])
                procs.append(subprocess.Popen(net.wrap(i, cmd), env=env, stdout=subprocess.DEVNULL,
                                              stderr=subprocess.PIPE, text=True))
            for i, p in enumerate(procs):
                try:
                    err = p.communicate(timeout=900)[1]
                except subprocess.TimeoutExpired:
                    raise RuntimeError(f"collective probe: worker {i} did not finish within 900 s") from None
                if p.returncode != 0:
                    raise RuntimeError(f"collective probe: worker {i} exited with code {p.returncode}: "
                                       f"{(err or '')[-500:]}")
        finally:  # whatever stopped the probe, no worker outlives it (the namespaces go with the network)
            kill_processes(procs)
        per_worker = [json.loads((Path(folder) / f"rank{i}.json").read_text()) for i in range(n)]
    return [max(w[s] for w in per_worker) for s in range(1, steps + 1)]


def measure_fsdp_goodput(rates_mbit_per_s: list[float], unit_bytes: list[int], steps: int = STEPS,
                         reshard: bool = True, cores: list[list[int]] | None = None,
                         bucket_ms: float | None = None) -> CollectiveGoodput:
    """The share of the slowest link's configured rate that FSDP's unit collectives of ``unit_bytes``
    reach over these links with each worker pinned to ``cores[i]`` (see
    :func:`fsdp_collective_step_seconds`): the ring's wire time at that rate
    (:func:`~ddlscope.modeling.collectives.gloo_fsdp_step_wire_s`, a ring is as fast as its slowest
    link) over the measured median step.

    Raises:
        what :func:`fsdp_collective_step_seconds` raises.
    """
    from ddlscope.modeling.cluster import LinkSpec
    from ddlscope.modeling.collectives import gloo_fsdp_step_wire_s

    seconds = fsdp_collective_step_seconds(rates_mbit_per_s, unit_bytes, steps, reshard, cores, bucket_ms)
    sizes = [int(b) for b in unit_bytes if b > 0]
    link = LinkSpec(bandwidth_gb_per_s=min(rates_mbit_per_s) / 8e3, latency_s=0.0)
    predicted = gloo_fsdp_step_wire_s(sizes, len(rates_mbit_per_s), link, reshard)
    return CollectiveGoodput(share=min(1.0, predicted / statistics.median(seconds)), step_s=tuple(seconds),
                             predicted_step_s=predicted, unit_bytes=tuple(sizes),
                             cores=None if cores is None else tuple(tuple(c) for c in cores))


def _worker(args: argparse.Namespace) -> None:
    """One gloo worker: join the group, run ``steps + 1`` steps of the units' collectives, write their seconds."""
    if args.cores:
        os.sched_setaffinity(0, {int(c) for c in args.cores.split(",")})
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    folder, w = Path(args.folder), args.workers
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{PORT}", rank=args.rank, world_size=w,
                            timeout=timedelta(seconds=600))
    units = []
    for nbytes in json.loads((folder / "units.json").read_text()):
        elements = -(-nbytes // 4 // w) * w  # float32, padded to a multiple of the workers
        units.append((torch.zeros(elements), torch.zeros(elements // w)))
    seconds = []
    for _ in range(args.steps + 1):
        dist.barrier()
        start = time.perf_counter()
        for full, shard in units:  # forward
            dist.all_gather_into_tensor(full, shard)
        for full, shard in reversed(units):  # backward
            if args.reshard:
                dist.all_gather_into_tensor(full, shard)
            dist.reduce_scatter_tensor(shard, full)
        seconds.append(time.perf_counter() - start)
    (folder / f"rank{args.rank}.json").write_text(json.dumps(seconds))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="one worker of ddlscope.network.collective_probe")
    for name, kind in (("--rank", int), ("--workers", int), ("--master", str), ("--folder", str), ("--steps", int),
                       ("--cores", str)):
        parser.add_argument(name, type=kind, required=name != "--cores")
    parser.add_argument("--reshard", action="store_true")
    _worker(parser.parse_args())
