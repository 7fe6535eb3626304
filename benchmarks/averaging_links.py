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

    python benchmarks/averaging_links.py [--megabytes 8] [--rounds 3] [--pin] [--scenario "2 peers, 200/20 Mbit/s" ...]

The peers run in ``ddlscope.network.averaging_probe`` (the probe that prices the collaborative model's links);
``--pin`` gives each peer one core, as a ``ddlscope run`` does.

Needs root and iproute2. Prints a table, writes ``benchmarks/results/averaging_links.json`` and
rewrites the ``averaging-links`` block of ``docs/emulated-networks.md`` (``--no-docs`` to leave it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from _docs import check_docs_block, markdown_table, provenance, update_docs_block

from ddlscope.modeling.collectives import butterfly_allreduce_s
from ddlscope.network.averaging_probe import averaging_round_seconds, one_core_each
from ddlscope.network.emulated import check_can_emulate

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs" / "emulated-networks.md"
SCENARIOS: dict[str, list[float]] = {
    "2 peers, 100 Mbit/s": [100, 100],
    "2 peers, 20 Mbit/s": [20, 20],
    "2 peers, 200/20 Mbit/s": [200, 20],
    "3 peers, 100 Mbit/s": [100, 100, 100],
    "3 peers, 200/100/20 Mbit/s": [200, 100, 20],
    "4 peers, 3x100 + 10 Mbit/s": [100, 100, 100, 10],
}
"""Each peer's upload and download, Mbit/s."""


def measure(megabytes: float, rounds: int, scenarios: list[str], pinned: bool) -> list[dict]:
    rows = []
    for name in scenarios:
        mbit = SCENARIOS[name]
        for declare in ([True, False] if len(set(mbit)) > 1 else [True]):
            cores = one_core_each(len(mbit)) if pinned else None
            seconds = averaging_round_seconds(mbit, megabytes, rounds, declare, cores)
            nbytes = megabytes * 2**20
            predicted = butterfly_allreduce_s(nbytes, [b / 8e3 for b in mbit], [0.0] * len(mbit), balanced=declare)
            median = statistics.median(seconds)
            rows.append({"scenario": name, "mbit_per_s": mbit, "bandwidth_declared": declare, "megabytes": megabytes,
                         "cores": cores,
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
                        f"after a warm-up; predicted by `butterfly_allreduce_s` at the configured rates; "
                        f"{'each peer on one core' if result.get('pinned') else 'the peers share every core'}.",
                        markdown_table(header, rows)])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--megabytes", type=float, default=8.0, help="MiB averaged per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--scenario", action="append", choices=list(SCENARIOS), default=None,
                   help="run only these scenarios (repeatable; default: all)")
    p.add_argument("--pin", action="store_true", help="each peer on one core of this process's, in turn "
                   "(as a ddlscope run places its peers); default: the peers share every core")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "averaging_links.json")
    p.add_argument("--no-docs", action="store_true")
    # one peer (started by the benchmark itself inside its namespace)
    args = p.parse_args()
    check_can_emulate()
    if not args.no_docs:
        check_docs_block(DOCS, "averaging-links")
    result = {"measured_at": time.strftime("%Y-%m-%d %H:%M"), "megabytes": args.megabytes, "rounds": args.rounds,
              "pinned": args.pin, "rows": measure(args.megabytes, args.rounds, args.scenario or list(SCENARIOS), args.pin)}
    print(to_markdown(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    if not args.no_docs:
        update_docs_block(DOCS, "averaging-links", to_markdown(result))


if __name__ == "__main__":
    main()
