"""hivemind's butterfly all-reduce over slow and uneven links: measured vs. ddlscope's cost model.

The collaborative cost model prices an averaging round with :func:`ddlscope.modeling.collectives.
butterfly_allreduce_s`: hivemind's load-balancing LP over the peers' bandwidths (DeDLOC,
Diskin et al. 2021, section 3.2; ``hivemind.averaging.load_balancing``). On loopback every link is
several Gbit/s and the round is nearly free, so the model was never checked where it matters.
This benchmark checks it on emulated networks (:mod:`ddlscope.network.emulated`): each peer a
plain ``hivemind.DecentralizedAverager`` in a network namespace of its own, its links limited.

Per scenario (peers and their Mbit/s), each peer averages one float32 tensor of ``--megabytes``
``--rounds`` times (after one warm-up round). A round is started with ``require_trigger``: each
peer triggers the all-reduce once its group is formed, so matchmaking is left out; the round lasts
from the last peer's trigger to the last peer's result (wall clocks of one machine). Scenarios run
twice where bandwidths differ: peers declaring their bandwidth to the averager (``bandwidth=``,
hivemind's LP balances the parts) and not declaring it (equal parts); the model predicts each
(``balanced=True/False``). The link rate counts TCP/IP headers; the model gets the configured rate.

    python benchmarks/averaging_links.py [--megabytes 8] [--rounds 3]

Needs root and iproute2. Prints a table, writes ``benchmarks/results/averaging_links.json`` and
rewrites the ``averaging-links`` block of ``docs/emulated-networks.md`` (``--no-docs`` to leave it).
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

from _docs import check_docs_block, markdown_table, provenance, update_docs_block

from ddlscope.modeling.collectives import butterfly_allreduce_s
from ddlscope.network.emulated import EmulatedNetwork, check_can_emulate

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs" / "emulated-networks.md"
SCENARIOS: dict[str, list[float]] = {
    "2 peers, 100 Mbit/s": [100, 100],
    "2 peers, 20 Mbit/s": [20, 20],
    "3 peers, 100 Mbit/s": [100, 100, 100],
    "3 peers, 200/100/20 Mbit/s": [200, 100, 20],
    "4 peers, 3x100 + 10 Mbit/s": [100, 100, 100, 10],
}
"""Each peer's upload and download, Mbit/s."""


# ---------------------------------------------------------------------------- one peer (child process)

def peer_main(args: argparse.Namespace) -> None:
    """One averager: join the swarm, average ``rounds + 1`` times, write the trigger/done times."""
    import hivemind
    import torch

    torch.set_num_threads(1)
    folder = Path(args.folder)
    initial = json.loads((folder / "maddrs.json").read_text()) if args.index else None
    dht = hivemind.DHT(initial_peers=initial, host_maddrs=[f"/ip4/{args.address}/tcp/0"], start=True)
    if args.index == 0:
        (folder / "maddrs.json.tmp").write_text(json.dumps([str(a) for a in dht.get_visible_maddrs()]))
        os.replace(folder / "maddrs.json.tmp", folder / "maddrs.json")
    tensor = torch.full((int(args.megabytes * 2**20 / 4),), float(args.index))
    averager = hivemind.DecentralizedAverager(
        [tensor], dht, prefix="bench", target_group_size=args.peers, min_group_size=args.peers,
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
    (folder / f"peer{args.index}.json").write_text(json.dumps(times))
    # a peer that has its result may still be sending parts to the others: leave together
    deadline = time.monotonic() + 120
    while len(list(folder.glob("peer*.json"))) < args.peers and time.monotonic() < deadline:
        time.sleep(0.1)
    averager.shutdown()
    dht.shutdown()


# ---------------------------------------------------------------------------- scenarios (parent)

def run_scenario(mbit: list[float], megabytes: float, rounds: int, declare: bool) -> list[float]:
    """Seconds of each measured round (warm-up dropped)."""
    with tempfile.TemporaryDirectory() as folder, EmulatedNetwork([(b, b) for b in mbit]) as net:
        def start(i: int) -> subprocess.Popen:
            cmd = [sys.executable, __file__, "--peer", str(i), "--peers", str(len(mbit)), "--address", net.address(i),
                   "--folder", folder, "--megabytes", str(megabytes), "--rounds", str(rounds),
                   "--bandwidth", str(mbit[i])] + (["--declare"] if declare else [])
            return subprocess.Popen(net.wrap(i, cmd), env=dict(os.environ, OMP_NUM_THREADS="1"))

        procs = [start(0)]
        deadline = time.monotonic() + 60
        while not (Path(folder) / "maddrs.json").exists():
            if time.monotonic() > deadline or procs[0].poll() is not None:
                raise RuntimeError("peer 0 did not start its DHT")
            time.sleep(0.1)
        procs += [start(i) for i in range(1, len(mbit))]
        for p in procs:
            if p.wait(timeout=1800) != 0:
                raise RuntimeError(f"a peer exited with code {p.returncode}")
        per_peer = [json.loads((Path(folder) / f"peer{i}.json").read_text()) for i in range(len(mbit))]
    out = []
    for r in range(1, rounds + 1):
        rows = [p[r] for p in per_peer]
        if any(row["group"] != len(mbit) for row in rows):
            raise RuntimeError(f"round {r}: groups {[row['group'] for row in rows]}, not all {len(mbit)} peers")
        out.append(max(row["done"] for row in rows) - max(row["trigger"] for row in rows))
    return out


def measure(megabytes: float, rounds: int) -> list[dict]:
    rows = []
    for name, mbit in SCENARIOS.items():
        for declare in ([True, False] if len(set(mbit)) > 1 else [True]):
            seconds = run_scenario(mbit, megabytes, rounds, declare)
            nbytes = megabytes * 2**20
            predicted = butterfly_allreduce_s(nbytes, [b / 8e3 for b in mbit], [0.0] * len(mbit), balanced=declare)
            median = statistics.median(seconds)
            rows.append({"scenario": name, "mbit_per_s": mbit, "bandwidth_declared": declare, "megabytes": megabytes,
                         "round_s": seconds, "median_round_s": median, "predicted_round_s": predicted,
                         "error": (predicted - median) / median})
            print(f"{name:28s} {'LP' if declare else 'equal':5s} measured {median:7.2f} s "
                  f"({', '.join(f'{s:.2f}' for s in seconds)}), predicted {predicted:7.2f} s, "
                  f"error {100 * rows[-1]['error']:+.1f} %", flush=True)
    return rows


def to_markdown(result: dict) -> str:
    header = ["peers (Mbit/s each way)", "parts", "measured round (median)", "predicted", "error"]
    rows = [[r["scenario"], "hivemind's LP (bandwidth declared)" if r["bandwidth_declared"] else "equal (not declared)",
             f"{r['median_round_s']:.2f} s", f"{r['predicted_round_s']:.2f} s", f"{100 * r['error']:+.1f} %"]
            for r in result["rows"]]
    return "\n\n".join([provenance("benchmarks/averaging_links.py", result["measured_at"]),
                        f"One float32 tensor of {result['megabytes']:g} MiB, median of {result['rounds']} rounds "
                        f"after a warm-up; predicted by `butterfly_allreduce_s` at the configured rates.",
                        markdown_table(header, rows)])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--megabytes", type=float, default=8.0, help="MiB averaged per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "averaging_links.json")
    p.add_argument("--no-docs", action="store_true")
    # one peer (started by the benchmark itself inside its namespace)
    p.add_argument("--peer", dest="index", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--peers", type=int, help=argparse.SUPPRESS)
    p.add_argument("--address", help=argparse.SUPPRESS)
    p.add_argument("--folder", help=argparse.SUPPRESS)
    p.add_argument("--bandwidth", type=float, help=argparse.SUPPRESS)
    p.add_argument("--declare", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.index is not None:
        return peer_main(args)
    check_can_emulate()
    if not args.no_docs:
        check_docs_block(DOCS, "averaging-links")
    result = {"measured_at": time.strftime("%Y-%m-%d %H:%M"), "megabytes": args.megabytes, "rounds": args.rounds,
              "rows": measure(args.megabytes, args.rounds)}
    print(to_markdown(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    if not args.no_docs:
        update_docs_block(DOCS, "averaging-links", to_markdown(result))


if __name__ == "__main__":
    main()
