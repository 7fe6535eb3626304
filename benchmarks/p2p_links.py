"""gloo's point-to-point transfers over emulated links, as the pipelines make them: measured vs. the model.

The pipelines' cost model (:func:`ddlscope.distribution.pipeline.simulate_pipeline`) rests on how
torch's gloo backend moves one micro-batch's activation or gradient between two stages, each on
one core, over a link limited by tc ``tbf`` (:mod:`ddlscope.network.emulated`). This benchmark
measures each of those rules on its own, for two workers (rank 0 and rank 1) in namespaces of
their own, per link and message size (median of ``--repeats`` after one warm-up):

- ``one way``: rank 1 has posted its receive; rank 0 sends after the link was idle >= 50 ms. The
  model: the wire time less the link's token bucket (``LinkSpec.burst_s``).
- ``exchange``: both post a send and a receive at once (torch's ``batch_isend_irecv``), until both
  have arrived. The model: one transfer (each direction its own stream; both ready-to-receive
  notices cross before any data moves).
- ``1F1B turn``: rank 0 has posted the receive of message X; rank 1 posts the send of X, then the
  receive of message Y, as a 1F1B stage does; 5 ms later rank 0 sends Y; until Y has arrived.
  The model: Y's notice travels behind X's data, so the directions take turns (two transfers).
  Every pattern starts on idle links, so the model takes each transfer's wire time less the bucket.
- ``late receive``: rank 0 sends at once; rank 1 computes ~60 ms first, then receives. Reported:
  how long rank 0's send waited beyond rank 1's compute (rendezvous: it waits for the receive,
  then its data is handed to the connection), and rank 1's receive beyond its compute.
- ``compute while sending / receiving``: ~60 ms of 256 x 256 matrix products on the core while a
  transfer flows (the send or receive posted just before), against the same products alone: the
  share of the stage's compute the transfer takes on its core (the model has none).

Needs root and iproute2. ``python benchmarks/p2p_links.py [--kbytes 400] [--repeats 5]``.
Prints a table, writes ``benchmarks/results/p2p_links.json`` and rewrites the ``p2p-links`` block
of ``docs/emulated-networks.md`` (``--no-docs`` to leave it).
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
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs" / "emulated-networks.md"
LINKS: dict[str, list[float]] = {"200 Mbit/s": [200.0, 200.0], "50 Mbit/s": [50.0, 50.0],
                                 "200/20 Mbit/s": [200.0, 20.0]}
"""Each worker's upload and download, Mbit/s."""
PORT = 29671
COMPUTE_S = 0.06


def _worker(rank: int, master: str, folder: str, nbytes: int, repeats: int) -> None:
    """One of the two gloo workers: run every pattern ``repeats + 1`` times, write the seconds."""
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{master}:{PORT}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=300))
    peer = 1 - rank
    a, b = torch.randn(256, 256), torch.randn(256, 256)

    def compute(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            a @ b
        return time.perf_counter() - t0

    compute(50)
    products = max(1, int(100 * COMPUTE_S / compute(100)))
    x, y = torch.zeros(nbytes // 4), torch.zeros(nbytes // 4)
    out: dict[str, list[float]] = {}

    def keep(name: str, seconds: float) -> None:
        out.setdefault(name, []).append(seconds)

    def idle() -> None:
        dist.barrier()
        time.sleep(0.05)  # the link's token bucket refills
        dist.barrier()

    for _ in range(repeats + 1):
        idle()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(x, 1)
        else:
            dist.recv(x, 0)
            keep("one_way", time.perf_counter() - t0)
        idle()
        t0 = time.perf_counter()
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, peer), dist.P2POp(dist.irecv, y, peer)]):
            work.wait()
        keep("exchange", time.perf_counter() - t0)
        idle()
        t0 = time.perf_counter()
        if rank == 0:  # has posted X's receive; sends Y a moment after rank 1 has started on X
            got_x = dist.irecv(x, 1)
            time.sleep(0.005)
            dist.send(y, 1)
            got_x.wait()
        else:  # 1F1B's order: the send, then the receive that goes with it
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, 0), dist.P2POp(dist.irecv, y, 0)])
            for work in works:
                work.wait()
            keep("turn", time.perf_counter() - t0)
        idle()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(x, 1)
            keep("late_send", time.perf_counter() - t0)
        else:
            c = compute(products)
            keep("late_compute", c)
            dist.recv(x, 0)
            keep("late_recv", time.perf_counter() - t0)
        idle()
        keep("alone", compute(products))
        idle()
        work = dist.isend(x, 1) if rank == 0 else dist.irecv(x, 0)
        keep("send_compute" if rank == 0 else "recv_compute", compute(products))
        work.wait()
    Path(folder, f"rank{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def measure(name: str, nbytes: int, repeats: int) -> dict:
    """One link: both workers' seconds per pattern (warm-up dropped), medians, and the model's."""
    from ddlscope.launch.processes import kill_processes
    from ddlscope.modeling.links import over_links
    from ddlscope.modeling.cluster import load_cluster
    from ddlscope.examples import example_path
    from ddlscope.network.emulated import EmulatedNetwork

    rates = LINKS[name]
    with tempfile.TemporaryDirectory() as folder, EmulatedNetwork([(r, r) for r in rates]) as net:
        env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=net.interface)
        procs = [subprocess.Popen(net.wrap(i, [sys.executable, __file__, "--worker", str(i), net.address(0), folder,
                                               str(nbytes), str(repeats)]), env=env) for i in range(2)]
        try:
            for i, p in enumerate(procs):
                if p.wait(timeout=600) != 0:
                    raise RuntimeError(f"p2p_links: worker {i} exited with code {p.returncode}")
        finally:
            kill_processes(procs)
        got = [json.loads(Path(folder, f"rank{i}.json").read_text()) for i in range(2)]
    med = {}
    for rank, seconds in enumerate(got):
        for key, values in seconds.items():
            med[f"{key}{rank}"] = statistics.median(values[1:])
    link = over_links(load_cluster(example_path("cluster-local-2cores.toml")), rates, 2).p2p_link
    wire = nbytes / (link.bandwidth_gb_per_s * 1e9)
    idle_wire = max(0.0, wire - link.burst_s)  # every pattern starts on idle links, each direction its own bucket
    return {"link": name, "rates_mbit_per_s": rates, "bytes": nbytes, "wire_s": wire, "bucket_s": link.burst_s,
            "one_way_s": med["one_way1"], "exchange_s": max(med["exchange0"], med["exchange1"]),
            "turn_s": med["turn1"], "late_send_beyond_compute_s": med["late_send0"] - med["late_compute1"],
            "late_recv_beyond_compute_s": med["late_recv1"] - med["late_compute1"],
            "compute_alone_s": [med["alone0"], med["alone1"]],
            "send_compute_slowdown": med["send_compute0"] / med["alone0"] - 1,
            "recv_compute_slowdown": med["recv_compute1"] / med["alone1"] - 1,
            "model": {"one_way_s": idle_wire, "exchange_s": idle_wire, "turn_s": 2 * idle_wire,
                      "late_send_beyond_compute_s": 0.0, "late_recv_beyond_compute_s": idle_wire}}


def to_markdown(result: dict) -> str:
    from _docs import markdown_table, provenance

    ms = lambda s: f"{1e3 * s:.1f}"  # noqa: E731
    header = ["link", "wire time", "one way (model)", "exchange (model)", "1F1B turn (model)",
              "late receive: send waits beyond its compute", "receive beyond its compute (model)",
              "compute while sending", "while receiving"]
    rows = [[r["link"], ms(r["wire_s"]), f"{ms(r['one_way_s'])} ({ms(r['model']['one_way_s'])})",
             f"{ms(r['exchange_s'])} ({ms(r['model']['exchange_s'])})", f"{ms(r['turn_s'])} ({ms(r['model']['turn_s'])})",
             ms(r["late_send_beyond_compute_s"]),
             f"{ms(r['late_recv_beyond_compute_s'])} ({ms(r['model']['late_recv_beyond_compute_s'])})",
             f"{100 * r['send_compute_slowdown']:+.0f} %", f"{100 * r['recv_compute_slowdown']:+.0f} %"] for r in result["rows"]]
    return "\n\n".join([provenance("benchmarks/p2p_links.py", result["measured_at"]),
                        f"Two gloo workers, each on one core, one message of {result['bytes'] / 1e3:.0f} KB per "
                        f"transfer; milliseconds, median of {result['repeats']} after a warm-up; the model's figure in "
                        "brackets (the bucket: 10 ms at the slower rate). Compute: ~60 ms of matrix products on the "
                        "worker's core while a transfer flows, against the same alone.",
                        markdown_table(header, rows)])


def main() -> None:
    from _docs import check_docs_block, update_docs_block

    from ddlscope.network.emulated import check_can_emulate

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kbytes", type=int, default=400, help="KB per message (MobileNetV2's activation at "
                   "micro-batch 16 on MNIST shapes: 401 KB)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--link", action="append", choices=list(LINKS), default=None, help="default: every link")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "p2p_links.json")
    p.add_argument("--no-docs", action="store_true")
    args = p.parse_args()
    if not 1 <= args.kbytes <= 100_000 or not 1 <= args.repeats <= 50:
        p.error(f"--kbytes {args.kbytes}, --repeats {args.repeats}; allowed: 1..100000 KB, 1..50 repeats")
    check_can_emulate()
    if not args.no_docs:
        check_docs_block(DOCS, "p2p-links")
    rows = [measure(name, args.kbytes * 1000, args.repeats) for name in args.link or list(LINKS)]
    result = {"measured_at": time.strftime("%Y-%m-%d %H:%M"), "bytes": args.kbytes * 1000, "repeats": args.repeats,
              "rows": rows}
    print(to_markdown(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    if not args.no_docs:
        update_docs_block(DOCS, "p2p-links", to_markdown(result))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6]))
    else:
        main()
