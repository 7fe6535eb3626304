"""A plain hivemind swarm peer: ``hivemind.Optimizer`` in a bare loop, what ``ddlscope run`` with
``strategy = "collaborative"`` replaces. Start one process per peer; the first writes its
multiaddrs to ``--maddrs-out``, the others join through them:

    python benchmarks/plain/plain_hivemind.py --index 0 --maddrs-out maddrs.txt --out peer0.json ...
    python benchmarks/plain/plain_hivemind.py --index 1 --initial-peers $(cat maddrs.txt) --out peer1.json ...

Each peer accumulates gradients until the swarm has processed ``--target-batch-size`` samples,
then hivemind averages them (matchmaking for ``--matchmaking-time-s``, at most
``--averaging-timeout-s``) and steps SGD. The peers listen on loopback only, without NAT
traversal or relaying (the swarm is on one machine). Before training, the peers wait until all ``--peers``
of them announced themselves in the DHT, so that nobody trains alone. Each peer writes one row
per timed step (``worker_index``, ``wall_time`` at its start, ``step_s``, ``samples``): the swarm's
throughput is read from them as ddlscope reads its own peers' steps
(:func:`ddlscope.experiments.results.swarm_window`). On a GPU each step ends with a
synchronisation, so that its time is the device's.
"""

from __future__ import annotations

import os
import time

import hivemind
import torch
from hivemind.utils import get_dht_time

import common

READY_KEY = "plain-peers-ready"


def wait_for_peers(dht: hivemind.DHT, index: int, peers: int, timeout_s: float = 120.0) -> None:
    """Announce this peer in the DHT and wait until ``peers`` peers did.

    Raises:
        RuntimeError: fewer peers were seen within ``timeout_s``.
    """
    deadline, seen = time.monotonic() + timeout_s, 0
    while time.monotonic() < deadline:
        dht.store(READY_KEY, subkey=index, value=True, expiration_time=get_dht_time() + 600)
        found = dht.get(READY_KEY, latest=True)
        seen = len(found.value) if found is not None and isinstance(found.value, dict) else 0
        if seen >= peers:
            return
        time.sleep(0.2)
    raise RuntimeError(f"peer {index} saw {seen} of {peers} peers within {timeout_s:g} s")


def main() -> None:
    p = common.parser(__doc__)
    p.add_argument("--index", type=int, required=True, help="this peer's index (0 starts the swarm)")
    p.add_argument("--peers", type=int, default=2)
    p.add_argument("--initial-peers", nargs="*", default=[])
    p.add_argument("--maddrs-out", default=None, help="file the first peer writes its multiaddrs to")
    p.add_argument("--target-batch-size", type=int, required=True)
    p.add_argument("--matchmaking-time-s", type=float, required=True)
    p.add_argument("--averaging-timeout-s", type=float, required=True)
    args = p.parse_args()
    common.pin(args.core_sets, 0)
    common.keep_hivemind_sockets_in_tmpdir()
    # one machine: p2pd listens on loopback and neither maps ports, probes for NATs nor relays (as ddlscope's peers)
    dht = hivemind.DHT(initial_peers=args.initial_peers or None, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True,
                       nat_port_map=False, auto_nat=False, use_relay=False, use_auto_relay=False)
    if args.maddrs_out:
        with open(args.maddrs_out + ".part", "w") as f:
            f.write(" ".join(str(a) for a in dht.get_visible_maddrs()))
        os.replace(args.maddrs_out + ".part", args.maddrs_out)
    model, batches, device = common.workload(args, data_rank=args.index, local_rank=0)
    # an optimizer instance, as in hivemind's quickstart and as ddlscope passes it; params and a factory
    # instead would turn on hivemind's offload_optimizer and reuse_tensors, another configuration
    optimizer = hivemind.Optimizer(
        dht=dht, run_id="plain-hivemind", optimizer=common.sgd(model.parameters(), args),
        target_batch_size=args.target_batch_size,
        batch_size_per_step=args.batch_size, matchmaking_time=args.matchmaking_time_s,
        averaging_timeout=args.averaging_timeout_s, verbose=False)
    loss_fn = torch.nn.CrossEntropyLoss()
    wait_for_peers(dht, args.index, args.peers)
    model.train()
    rows = []
    for step in range(args.warmup + args.steps):
        wall, start = time.time(), time.perf_counter()
        x, y = next(batches)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss_fn(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        common.sync(device)
        if step >= args.warmup:
            rows.append(dict(worker_index=args.index, step=step, wall_time=wall,
                             step_s=time.perf_counter() - start, samples=len(y)))
    common.write_result(args.out, steps=rows)
    optimizer.shutdown()
    dht.shutdown()


if __name__ == "__main__":
    main()
