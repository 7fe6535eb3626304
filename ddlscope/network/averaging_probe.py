"""What hivemind's own averaging rounds carry over emulated links, each peer on the cores a run gives it.

A TCP transfer (:mod:`ddlscope.network.duplex`) says what a link carries both ways. hivemind's
butterfly all-reduce carries less where each peer's processes (the averager, the DHT, ``p2pd``)
share one core: on a 200/20 Mbit/s pair, rounds of 8.5 MiB took 4.45 s with the peers free to use
both of this machine's cores and 5.0 s with each peer pinned to one (0.80 and 0.71 of the slow
link's rate; the TCP probe read 0.81), and the collaborative validation runs, one core per peer,
sent at 0.71 of it during their rounds (docs/validation.md, issue 14). So the collaborative cost
model's links are priced at what this probe measures: plain ``hivemind.DecentralizedAverager`` s in
network namespaces of their own, each pinned to its cores, averaging one float32 tensor.

:func:`averaging_round_seconds` runs the rounds of one swarm; :func:`measure_averaging_goodput` runs
:data:`SWARMS` swarms and turns their rounds into a share of the rate (:func:`share_of_rate`: the
butterfly all-reduce's predicted round at the configured rates over the measured ones). Run as
``python -m ddlscope.network.averaging_probe --peer I ...`` inside a namespace (that is how the
rounds start each peer).
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

ROUNDS = 3
"""Measured rounds per swarm after one warm-up round; the swarm's median round is kept."""
SWARMS = 3
"""Fresh swarms a probe measures, one after the other (each its own namespaces, DHT, p2pd connections and
averager): the share is over the mean of their median rounds. Swarms differ more than one swarm's rounds
do. Five one-swarm probes of 5 rounds in a row (17.9 MiB, two 50 Mbit/s links, one core per peer; a 2-core
AMD EPYC, stop 52) had median rounds of 3.87, 4.06, 4.22, 4.24 and 4.47 s (shares 0.78 to 0.67; standard
deviation 0.22 s), where a swarm's rounds spread by 0.06-0.23 s, which moves a median of 5 by about 0.1 s:
each swarm, as a run's, draws its own rate, about 4 % apart (docs/validation.md, stop 52). Earlier, three
one-swarm probes of 3 rounds (8 MiB, a 200/20 Mbit/s pair) read 0.83, 0.73 and 0.73 on a 2-core Xeon."""
WIRE_S = 3.0
"""Seconds of wire time at the configured rate that a probe's round lasts at least
(:func:`ddlscope.modeling.links.averaging_goodput` sizes the rounds by it), so that the share is the
rounds' throughput and not their fixed costs."""
MEGABYTES = 8.0
"""MiB averaged per round when the caller names no size: about the parameters of MobileNetV2 (8.9 MB),
the validation's network on slow links. The share shrinks with smaller rounds (fixed costs per round)."""


@dataclass(frozen=True)
class AveragingGoodput:
    """hivemind's averaging rounds over a set of emulated links.

    Attributes:
        share: the round predicted at the configured rates (:func:`~ddlscope.modeling.collectives.
            butterfly_allreduce_s`, equal parts, no latency) over the mean of the swarms' median
            rounds, in (0, 1] (capped at 1); see :func:`share_of_rate`.
        round_s: the measured rounds, seconds each (warm-up left out), swarm after swarm.
        swarm_median_s: each swarm's median round, seconds.
        predicted_round_s: the round at the configured rates, seconds.
        megabytes: MiB averaged per round.
        cores: each peer's cores (None: not pinned).
    """

    share: float
    round_s: tuple[float, ...]
    swarm_median_s: tuple[float, ...]
    predicted_round_s: float
    megabytes: float
    cores: tuple[tuple[int, ...], ...] | None


def averaging_round_seconds(rates_mbit_per_s: list[float], megabytes: float, rounds: int, declare: bool = False,
                            cores: list[list[int]] | None = None) -> list[float]:
    """Seconds of each measured averaging round (one warm-up round dropped) of ``len(rates_mbit_per_s)``
    peers, peer i in a namespace of its own with a link of ``rates_mbit_per_s[i]`` up and down, and
    pinned to ``cores[i]`` (None: not pinned). A round is started with ``require_trigger``: each peer
    triggers its all-reduce once the group is formed, so matchmaking is left out; it lasts from the
    last peer's trigger to the last peer's result. ``declare``: the peers tell the averager their
    bandwidth (hivemind's load balancing), else equal parts.

    Raises:
        UserError: emulated networks cannot be built here (not root, no iproute2).
        ValueError: fewer than 2 peers, a rate <= 0, ``megabytes`` <= 0, ``rounds`` < 1, or ``cores``
            not one list per peer.
        RuntimeError: a peer failed or a round did not gather every peer.
    """
    from ddlscope.network.emulated import EmulatedNetwork, check_can_emulate

    if len(rates_mbit_per_s) < 2 or not all(r > 0 for r in rates_mbit_per_s):
        raise ValueError(f"rates {rates_mbit_per_s}; allowed: at least 2 peers, each Mbit/s > 0")
    if not (megabytes > 0 and rounds >= 1):
        raise ValueError(f"megabytes = {megabytes}, rounds = {rounds}; allowed: megabytes > 0, rounds >= 1")
    if cores is not None and (len(cores) != len(rates_mbit_per_s) or not all(cores)):
        raise ValueError(f"cores {cores}; allowed: one non-empty list of cores per peer")
    check_can_emulate()
    n = len(rates_mbit_per_s)
    with tempfile.TemporaryDirectory() as folder, EmulatedNetwork([(r, r) for r in rates_mbit_per_s]) as net:
        def start(i: int) -> subprocess.Popen:
            cmd = [sys.executable, "-m", "ddlscope.network.averaging_probe", "--peer", str(i), "--peers", str(n),
                   "--address", net.address(i), "--folder", folder, "--megabytes", str(megabytes),
                   "--rounds", str(rounds), "--bandwidth", str(rates_mbit_per_s[i])] \
                + (["--declare"] if declare else []) \
                + (["--cores", ",".join(map(str, cores[i]))] if cores is not None else [])
            return subprocess.Popen(net.wrap(i, cmd), env=dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=folder),
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

        procs = [start(0)]
        try:
            deadline = time.monotonic() + 60
            while not (Path(folder) / "maddrs.json").exists():
                if time.monotonic() > deadline or procs[0].poll() is not None:
                    raise RuntimeError(f"averaging probe: peer 0 did not start its DHT: {_stderr(procs[0])}")
                time.sleep(0.1)
            procs += [start(i) for i in range(1, n)]
            for i, p in enumerate(procs):
                if p.wait(timeout=600) != 0:
                    raise RuntimeError(f"averaging probe: peer {i} exited with code {p.returncode}: {_stderr(p)}")
        finally:  # whatever stopped the probe, no peer outlives it (the namespaces go with the network)
            kill_processes(procs)
        per_peer = [json.loads((Path(folder) / f"peer{i}.json").read_text()) for i in range(n)]
    out = []
    for r in range(1, rounds + 1):
        rows = [p[r] for p in per_peer]
        if any(row["group"] != n for row in rows):
            raise RuntimeError(f"averaging probe: round {r} gathered groups of {[row['group'] for row in rows]}, "
                               f"not all {n} peers")
        out.append(max(row["done"] for row in rows) - max(row["trigger"] for row in rows))
    return out


def share_of_rate(predicted_round_s: float, swarm_rounds_s: list[list[float]]) -> float:
    """The share of the configured rates that measured averaging rounds reached: ``predicted_round_s``
    (the round at those rates, seconds, > 0) over the mean of each swarm's median round, capped at 1.
    ``swarm_rounds_s``: per swarm, its measured rounds in seconds (each > 0). The median keeps a
    swarm's outlying round from moving its figure; the mean over swarms averages the swarm-to-swarm
    spread (:data:`SWARMS`).

    Raises:
        ValueError: ``predicted_round_s`` <= 0, no swarm, a swarm without rounds, or a round <= 0.
    """
    if not (predicted_round_s > 0 and swarm_rounds_s and all(swarm_rounds_s)
            and all(r > 0 for rounds in swarm_rounds_s for r in rounds)):
        raise ValueError(f"predicted round {predicted_round_s} s, swarms' rounds {swarm_rounds_s}; allowed: a "
                         f"predicted round > 0 s and at least one swarm, each with rounds > 0 s")
    return min(1.0, predicted_round_s / statistics.fmean(statistics.median(r) for r in swarm_rounds_s))


def measure_averaging_goodput(rates_mbit_per_s: list[float], megabytes: float = MEGABYTES, rounds: int = ROUNDS,
                              cores: list[list[int]] | None = None, swarms: int = SWARMS) -> AveragingGoodput:
    """The share of the configured rates that hivemind's averaging rounds reach over these links with
    each peer pinned to ``cores[i]``: ``swarms`` fresh swarms one after the other, ``rounds`` measured
    rounds each (see :func:`averaging_round_seconds`; equal parts, as ddlscope's peers declare no
    bandwidth unless told to), combined by :func:`share_of_rate`. About ``swarms`` x (``rounds`` + 1)
    x (the round + 2 s of matchmaking) + a few seconds of start-up per swarm.

    Raises:
        ValueError: ``swarms`` < 1 (before anything is built), and what :func:`averaging_round_seconds`
            raises.
    """
    from ddlscope.modeling.collectives import butterfly_allreduce_s

    if swarms < 1:
        raise ValueError(f"swarms = {swarms}; allowed: >= 1")
    per_swarm = [averaging_round_seconds(rates_mbit_per_s, megabytes, rounds, cores=cores) for _ in range(swarms)]
    predicted = butterfly_allreduce_s(megabytes * 2**20, [r / 8e3 for r in rates_mbit_per_s],
                                      [0.0] * len(rates_mbit_per_s), balanced=False)
    return AveragingGoodput(share=share_of_rate(predicted, per_swarm), round_s=tuple(r for s in per_swarm for r in s),
                            swarm_median_s=tuple(statistics.median(s) for s in per_swarm),
                            predicted_round_s=predicted, megabytes=megabytes,
                            cores=None if cores is None else tuple(tuple(c) for c in cores))


def one_core_each(peers: int) -> list[list[int]]:
    """Peer i's cores for a probe: one core of this process's in turn, as ``ddlscope run`` places peers."""
    mine = sorted(os.sched_getaffinity(0))
    return [[mine[i % len(mine)]] for i in range(peers)]


def _stderr(p: subprocess.Popen) -> str:
    try:
        return (p.communicate(timeout=5)[1] or "")[-500:]
    except subprocess.TimeoutExpired:
        return "(no output)"


def _peer(args: argparse.Namespace) -> None:
    """One averager: join the swarm, average ``rounds + 1`` times, write the trigger/done times."""
    if args.cores:  # before hivemind starts its processes: they inherit the affinity
        os.sched_setaffinity(0, {int(c) for c in args.cores.split(",")})
    import hivemind
    import torch

    from ddlscope.launch.network import p2p_options
    from ddlscope.launch.processes import route_hivemind_sockets

    torch.set_num_threads(1)
    folder = Path(args.folder)
    route_hivemind_sockets(str(folder))  # hivemind's socket files go with the probe's folder, not into /tmp
    initial = json.loads((folder / "maddrs.json").read_text()) if args.peer else None
    dht = hivemind.DHT(initial_peers=initial, host_maddrs=[f"/ip4/{args.address}/tcp/0"], start=True,
                       **p2p_options())  # p2pd as a run's peers have it: no NAT traversal, no relay
    if args.peer == 0:
        (folder / "maddrs.json.tmp").write_text(json.dumps([str(a) for a in dht.get_visible_maddrs()]))
        os.replace(folder / "maddrs.json.tmp", folder / "maddrs.json")
    tensor = torch.full((int(args.megabytes * 2**20 / 4),), float(args.peer))
    averager = hivemind.DecentralizedAverager(
        [tensor], dht, prefix="ddlscope-probe", target_group_size=args.peers, min_group_size=args.peers,
        min_matchmaking_time=2.0, request_timeout=1.0, allreduce_timeout=600.0,
        bandwidth=args.bandwidth if args.declare else None, start=True)
    times = []
    for _ in range(args.rounds + 1):
        control = averager.step(wait=False, require_trigger=True, timeout=120.0)
        while control.stage.name in ("IDLE", "LOOKING_FOR_GROUP") and not control.done():
            time.sleep(0.005)
        triggered = time.time()
        control.allow_allreduce()
        result = control.result()
        times.append({"trigger": triggered, "done": time.time(), "group": len(result or {})})
    (folder / f"peer{args.peer}.json").write_text(json.dumps(times))
    # a peer that has its result may still be sending parts to the others: leave together
    deadline = time.monotonic() + 120
    while len(list(folder.glob("peer*.json"))) < args.peers and time.monotonic() < deadline:
        time.sleep(0.1)
    averager.shutdown()
    dht.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="one peer of ddlscope.network.averaging_probe")
    for name, kind in (("--peer", int), ("--peers", int), ("--address", str), ("--folder", str),
                       ("--megabytes", float), ("--rounds", int), ("--bandwidth", float), ("--cores", str)):
        parser.add_argument(name, type=kind, required=name not in ("--cores",))
    parser.add_argument("--declare", action="store_true")
    _peer(parser.parse_args())
