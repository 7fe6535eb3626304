"""How faithful are ddlscope's emulated links? Configured rate vs. the goodput TCP gets through them.

Every figure measured on an emulated network (``[network] emulate = true``) is only as good as
the links: this benchmark builds :class:`ddlscope.network.emulated.EmulatedNetwork` s and sends
bulk TCP data between namespaces, timed at the receiver (first byte to last byte), the way a
user would check a shaped link with iperf:

* ``upload``: peer 0's upload limited, one stream 0 -> 1;
* ``download``: peer 2's download limited, two peers send to it at once (the limit is on the
  bridge's end of its veth, shared by both streams);
* ``unlimited``: no limit (the veth's own speed on this machine, for reference);
* ``messages``: request/response exchanges, ``M`` bytes each way, between two peers whose links
  are limited both ways, with a pause before each (an idle link, as between the remote calls of a
  dmoe step), timed at the requester against the ``2 M`` bytes' wire time at the rate. A faithful
  link takes about 1.04 x the wire time (headers); a token bucket that lets a burst through at
  once takes less, down to almost nothing for a message that fits in it.

Each case sends ``--seconds`` worth of data at the configured rate (at least 1 MiB), ``--repeats``
times; the table gives the median goodput and its ratio to the configured rate (TCP/IP headers
take about 3-5 % of a 1500-byte packet, so about 0.95 is a faithful link).

    python benchmarks/emulated_links.py [--rates 5 20 100 500] [--seconds 2] [--repeats 3]
                                        [--message-rates 5 10 50] [--message-kib 8 32 256]
                                        [--bucket-ms 10 1]

``--bucket-ms`` measures every case with each token bucket given (``[network] bucket_ms``; default:
the network's default and 1 ms).

Needs root and iproute2. Prints a table, writes ``benchmarks/results/emulated_links.json`` and
rewrites the ``emulated-links`` block of ``docs/emulated-networks.md`` (``--no-docs`` to leave it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _docs import check_docs_block, markdown_table, provenance, update_docs_block

from ddlscope.network.emulated import BUCKET_MS, EmulatedNetwork, check_can_emulate

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs" / "emulated-networks.md"
PORT = 5601

RECEIVER = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(); print("ready", flush=True)
conns = [s.accept()[0] for _ in range(int(sys.argv[3]))]
n, first = 0, None
import selectors
sel = selectors.DefaultSelector()
for c in conns: sel.register(c, selectors.EVENT_READ)
open_conns = len(conns)
while open_conns:
    for key, _ in sel.select():
        d = key.fileobj.recv(1 << 16)
        if first is None: first = time.monotonic()
        if not d:
            sel.unregister(key.fileobj); open_conns -= 1
        n += len(d)
print(n, time.monotonic() - first)
"""
SENDER = """
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2]))); c.sendall(b"x" * int(sys.argv[3])); c.close()
"""


def goodput_mbit_per_s(net: EmulatedNetwork, senders: list[int], receiver: int, nbytes: int) -> float:
    """Receiver-timed goodput in Mbit/s of ``nbytes`` from each of ``senders`` to ``receiver`` at once."""
    rx = subprocess.Popen(net.wrap(receiver, [sys.executable, "-c", RECEIVER, net.address(receiver), str(PORT),
                                              str(len(senders))]), stdout=subprocess.PIPE, text=True)
    assert rx.stdout.readline().strip() == "ready"
    txs = [subprocess.Popen(net.wrap(s, [sys.executable, "-c", SENDER, net.address(receiver), str(PORT), str(nbytes)]))
           for s in senders]
    for tx in txs:
        tx.wait(timeout=600)
    received, seconds = rx.communicate(timeout=600)[0].split()
    return int(received) * 8 / float(seconds) / 1e6

RESPONDER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(); print("ready", flush=True)
c = s.accept()[0]; c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
m = int(sys.argv[3])
while True:
    got = 0
    while got < m:
        d = c.recv(1 << 16)
        if not d:
            sys.exit(0)
        got += len(d)
    c.sendall(b"y" * m)
"""
REQUESTER = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2]))); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
m, n, pause = int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
for _ in range(n):
    time.sleep(pause)
    t0 = time.perf_counter(); c.sendall(b"x" * m); got = 0
    while got < m:
        got += len(c.recv(1 << 16))
    print(time.perf_counter() - t0, flush=True)
"""
MESSAGE_PAUSE_S = 0.2
"""Idle time before each exchange: longer than any bucket takes to refill."""


def exchange_s(net: EmulatedNetwork, nbytes: int, exchanges: int) -> list[float]:
    """Seconds of each of ``exchanges`` request/response exchanges of ``nbytes`` each way between
    peers 0 and 1 (TCP_NODELAY, one connection, :data:`MESSAGE_PAUSE_S` idle before each); the
    first two (the connection's slow start) are left out."""
    rx = subprocess.Popen(net.wrap(1, [sys.executable, "-c", RESPONDER, net.address(1), str(PORT), str(nbytes)]),
                          stdout=subprocess.PIPE, text=True)
    try:
        assert rx.stdout.readline().strip() == "ready"
        out = subprocess.run(net.wrap(0, [sys.executable, "-c", REQUESTER, net.address(1), str(PORT), str(nbytes),
                                          str(exchanges + 2), str(MESSAGE_PAUSE_S)]),
                             capture_output=True, text=True, timeout=600, check=True).stdout
    finally:
        rx.kill()
        rx.wait()
    return [float(x) for x in out.split()][2:]


def measure_messages(rates: list[float], sizes_kib: list[float], exchanges: int, bucket_ms: float) -> list[dict]:
    rows = []
    for rate in rates:
        with EmulatedNetwork([(rate, rate), (rate, rate)], bucket_ms=bucket_ms) as net:
            for kib in sizes_kib:
                nbytes = int(kib * 1024)
                got = exchange_s(net, nbytes, exchanges)
                wire_s = 2 * nbytes * 8 / (rate * 1e6)
                median = statistics.median(got)
                rows.append({"bucket_ms": bucket_ms, "configured_mbit_per_s": rate, "message_bytes": nbytes, "exchange_s": got,
                             "median_s": median, "wire_s": wire_s, "ratio": median / wire_s})
                print(f"messages   bucket {bucket_ms:g} ms, {rate:>6g} Mbit/s, {kib:g} KiB each way: median {median * 1e3:8.2f} ms, "
                      f"wire {wire_s * 1e3:8.2f} ms ({median / wire_s:.3f})", flush=True)
    return rows


def measure(rates: list[float], seconds: float, repeats: int, bucket_ms: float, unlimited: bool = True) -> list[dict]:
    rows = []
    cases = [("unlimited", None)] * unlimited + [(kind, r) for r in rates for kind in ("upload", "download")]
    for kind, rate in cases:
        if kind == "download":
            links, senders, receiver = [(None, None), (None, None), (None, rate)], [0, 1], 2
        else:
            links, senders, receiver = [(rate, None), (None, None)], [0], 1
        nbytes = max(1 << 20, int((rate or 2000) * 1e6 / 8 * seconds / len(senders)))
        with EmulatedNetwork(links, bucket_ms=bucket_ms) as net:
            got = [goodput_mbit_per_s(net, senders, receiver, nbytes) for _ in range(repeats)]
            drops = net.counters()[senders[0] if kind == "upload" else receiver]
        median = statistics.median(got)
        rows.append({"bucket_ms": bucket_ms, "case": kind, "configured_mbit_per_s": rate, "streams": len(senders),
                     "bytes_per_stream": nbytes, "goodput_mbit_per_s": got, "median_mbit_per_s": median,
                     "ratio": median / rate if rate else None,
                     "drops": drops["drops_upload"] if kind == "upload" else drops["drops_download"]})
        print(f"bucket {bucket_ms:g} ms: {kind:10s} {rate or '-':>6} Mbit/s: median {median:8.1f} Mbit/s "
              f"({', '.join(f'{g:.1f}' for g in got)})", flush=True)
    return rows


def to_markdown(result: dict) -> str:
    header = ["bucket", "link", "configured", "streams", "goodput (median)", "ratio", "packets dropped by the limit"]
    rows = [[f"{r['bucket_ms']:g} ms", r["case"], f"{r['configured_mbit_per_s']:g} Mbit/s" if r["configured_mbit_per_s"] else "none",
             str(r["streams"]), f"{r['median_mbit_per_s']:.1f} Mbit/s",
             f"{r['ratio']:.3f}" if r["ratio"] else "–", "–" if r["drops"] is None else str(r["drops"])]
            for r in result["rows"]]
    parts = [provenance("benchmarks/emulated_links.py", result["measured_at"]), markdown_table(header, rows)]
    if result.get("messages"):
        parts.append(f"Request/response exchanges over two links of the rate (both ways), "
                     f"{MESSAGE_PAUSE_S * 1e3:g} ms idle before each, median of {result['exchanges']}; "
                     f"wire time: both messages' bytes at the rate:")
        parts.append(markdown_table(
            ["bucket", "link", "message each way", "exchange (median)", "wire time", "ratio"],
            [[f"{m['bucket_ms']:g} ms", f"{m['configured_mbit_per_s']:g} Mbit/s", f"{m['message_bytes'] / 1024:g} KiB",
              f"{m['median_s'] * 1e3:.2f} ms", f"{m['wire_s'] * 1e3:.2f} ms", f"{m['ratio']:.3f}"]
             for m in result["messages"]]))
    return "\n\n".join(parts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", type=float, nargs="+", default=[5, 20, 100, 500], help="Mbit/s")
    p.add_argument("--seconds", type=float, default=2.0, help="data per case, in seconds at the configured rate")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--message-rates", type=float, nargs="*", default=[5, 10, 50], help="Mbit/s (none: skip)")
    p.add_argument("--message-kib", type=float, nargs="+", default=[8, 32, 256], help="bytes each way, KiB")
    p.add_argument("--exchanges", type=int, default=15, help="timed exchanges per message size")
    p.add_argument("--bucket-ms", type=float, nargs="+", default=[BUCKET_MS, 1.0], help="token buckets, ms at the rate")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "emulated_links.json")
    p.add_argument("--no-docs", action="store_true")
    args = p.parse_args()
    check_can_emulate()
    if not args.no_docs:
        check_docs_block(DOCS, "emulated-links")
    result = {"measured_at": time.strftime("%Y-%m-%d %H:%M"), "seconds": args.seconds, "repeats": args.repeats,
              # no bucket limits the unlimited case: measured once
              "rows": [r for i, b in enumerate(args.bucket_ms)
                       for r in measure(args.rates, args.seconds, args.repeats, b, unlimited=i == 0)],
              "exchanges": args.exchanges,
              "messages": [m for b in args.bucket_ms
                           for m in measure_messages(args.message_rates, args.message_kib, args.exchanges, b)]}
    print(to_markdown(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    if not args.no_docs:
        update_docs_block(DOCS, "emulated-links", to_markdown(result))


if __name__ == "__main__":
    main()
