"""What an emulated link carries when both of its directions are saturated at once.

Collectives send both ways at the same time: in a ring all-reduce, all-gather or reduce-scatter
each worker sends to one neighbour while it receives from the other, and in hivemind's butterfly
all-reduce every peer sends and receives parts at once. On a rate-limited link the TCP
acknowledgements of one direction then queue behind the other direction's data in the token
bucket's queue, so each direction gets less than the link's rate (measured on this project's
emulated links: 0.96 of the rate one way, 0.83 both ways at 50 Mbit/s, 0.71 for a pair of 200
and 20 Mbit/s links). :func:`measure_duplex_goodput` measures it for a pair of links: bulk TCP
between two network namespaces of an :class:`~ddlscope.network.emulated.EmulatedNetwork`, first
one way, then both ways at once. The cost models' collectives over emulated links use the both-ways
figure (:func:`ddlscope.modeling.links.over_links`).

Run as ``python -m ddlscope.network.duplex server|client MY_ADDRESS PEER_ADDRESS BYTES BOTH``
inside a namespace (that is how :func:`measure_duplex_goodput` starts the two ends); it prints the
seconds its transfer took.
"""

from __future__ import annotations

import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from ddlscope.network.emulated import BUCKET_MS

PORT = 5601
"""TCP port of the measurement inside the namespaces (they are the measurement's own)."""
SECONDS = 2.0
"""About how long each transfer lasts at the slower link's rate: about one phase of a collaborative
averaging round of the validation's runs on the slow link (half of MobileNetV2's 8.9 MB at 20 Mbit/s).
Longer transfers carry more both ways (4 s: 0.87-0.89 for the 200/20 Mbit/s pair, against 0.79-0.84 at 2 s)."""
REPEATS = 7
"""Transfers each way of measuring; the median is kept. For the 200/20 Mbit/s pair, four measurements
with 3 transfers each gave 0.754-0.851 both ways (12 % spread); with 7, 0.794-0.836 (5 %)."""


@dataclass(frozen=True)
class DuplexGoodput:
    """Goodput of a pair of links as a share of the slower link's rate (TCP payload, Mbit/s / Mbit/s).

    Attributes:
        one_way: one direction saturated (headers and the token bucket only).
        both_ways: both directions saturated at once, each direction's share.
        rates_mbit_per_s: the two links' rates.
    """

    one_way: float
    both_ways: float
    rates_mbit_per_s: tuple[float, float]


def measure_duplex_goodput(rate_a_mbit_per_s: float, rate_b_mbit_per_s: float,
                           seconds: float = SECONDS, repeats: int = REPEATS,
                           bucket_ms: float = BUCKET_MS) -> DuplexGoodput:
    """Measure a pair of emulated links (each the same rate up and down) one way and both ways.

    Builds a 2-namespace :class:`~ddlscope.network.emulated.EmulatedNetwork` (root only), sends
    ``seconds`` worth of bytes at the slower rate from namespace 1 to 0, then both ways at once,
    and removes the network; ``repeats`` times, keeping the median of each (single 2-s transfers
    at 50 Mbit/s gave 0.82 and 0.90 both ways on the same links). ``bucket_ms``: the links' token
    bucket (``[network] bucket_ms``).

    Raises:
        UserError: this process cannot build emulated networks (not root, no iproute2).
        ValueError: a rate <= 0.
        RuntimeError: a transfer failed (its output is in the message).
    """
    from ddlscope.network.emulated import EmulatedNetwork, check_can_emulate

    if not (rate_a_mbit_per_s > 0 and rate_b_mbit_per_s > 0):
        raise ValueError(f"rates {rate_a_mbit_per_s}, {rate_b_mbit_per_s}: allowed: Mbit/s > 0")
    if repeats < 1:
        raise ValueError(f"repeats = {repeats}; allowed: >= 1")
    check_can_emulate()
    slower = min(rate_a_mbit_per_s, rate_b_mbit_per_s)
    nbytes = int(slower * 1e6 / 8 * seconds)
    shares: dict[bool, list[float]] = {False: [], True: []}
    for both in [False, True] * repeats:
        links = [(rate_a_mbit_per_s, rate_a_mbit_per_s), (rate_b_mbit_per_s, rate_b_mbit_per_s)]
        with EmulatedNetwork(links, bucket_ms=bucket_ms) as net:
            a, b = net.address(0), net.address(1)
            ends = [subprocess.Popen(net.wrap(i, [sys.executable, "-m", "ddlscope.network.duplex", role, me, peer,
                                                  str(nbytes), str(int(both))]),
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                    for i, role, me, peer in ((0, "server", a, b), (1, "client", b, a))]
            outs = [p.communicate(timeout=60 + 10 * seconds) for p in ends]
            if any(p.returncode for p in ends):
                raise RuntimeError(f"duplex measurement failed: {[o[1][-500:] for o in outs]}")
            took_s = max(float(o[0].split()[-1]) for o in outs)
        shares[both].append(nbytes * 8 / took_s / 1e6 / slower)
    return DuplexGoodput(one_way=statistics.median(shares[False]), both_ways=statistics.median(shares[True]),
                         rates_mbit_per_s=(rate_a_mbit_per_s, rate_b_mbit_per_s))


def _transfer(role: str, me: str, peer: str, nbytes: int, both: bool) -> float:
    """One end of a measurement: connect, send and/or receive ``nbytes``; return the seconds it took."""
    if role == "server":
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((me, PORT))
        listener.listen(1)
        conn, _ = listener.accept()
    else:
        deadline = time.monotonic() + 10
        while True:
            try:
                conn = socket.create_connection((peer, PORT))
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
    sends, receives = both or role == "client", both or role == "server"

    def send() -> None:
        chunk, left = b"\0" * 65536, nbytes
        while left > 0:
            left -= conn.send(chunk[:min(left, len(chunk))])

    start = time.perf_counter()
    sender = threading.Thread(target=send) if sends else None
    if sender:
        sender.start()
    got = 0
    while receives and got < nbytes:
        data = conn.recv(1 << 20)
        if not data:
            raise RuntimeError(f"connection closed after {got} of {nbytes} bytes")
        got += len(data)
    if sender:
        sender.join()
    took = time.perf_counter() - start
    conn.close()
    return took


if __name__ == "__main__":
    role_, me_, peer_, nbytes_, both_ = sys.argv[1:6]
    print(f"{role_} {_transfer(role_, me_, peer_, int(nbytes_), both_ == '1'):.4f}", flush=True)
