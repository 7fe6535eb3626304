"""Host metrics of one worker, sampled on a background thread (psutil).

A worker is a process tree: the training process, its DataLoader workers and, for collaborative
peers, hivemind's averager process and its p2pd daemon. Each sample sums over the live tree:

- ``cpu_percent``: CPU use since the previous sample, 100 = one core busy;
- ``rss_bytes``: resident memory;
- ``disk_read_bytes`` / ``disk_write_bytes``: cumulative block I/O (``/proc/<pid>/io``);
- ``ctx_switches``: cumulative voluntary + involuntary context switches;
- ``net_sent_bytes`` / ``net_recv_bytes``: cumulative TCP payload bytes of the tree's sockets,
  read from the kernel's per-socket counters (``ss -tinp``: ``bytes_sent`` /
  ``bytes_received``). Counters of a socket are kept after it closes, so the totals only grow.
  Sockets to the worker's own tree (loopback between its processes) count too, but hivemind
  talks to its daemon over a Unix socket, which is not TCP, so peer-to-peer traffic is what
  remains. Zero when ``ss`` is not installed or networking is off.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
import time
from typing import Callable

import psutil

_SS_PID = re.compile(r"pid=(\d+)")
_SS_BYTES = re.compile(r"\bbytes_(sent|received):(\d+)")


def background_cpu_s() -> float:
    """CPU seconds (user + system) used so far by this process's work other than the calling
    thread: its other threads and all of its descendant processes (for a collaborative peer:
    hivemind's progress tracker and RPC threads, its DHT process, ``p2pd`` and averagers; also
    DataLoader workers and this module's sampler). Differences between two calls give the
    background CPU of an interval; on a peer whose cores the training thread keeps busy, that
    CPU time is taken from training. Descendants that exited between the calls are not counted.
    The kernel accounts a process's CPU time in clock ticks (usually 10 ms): that is this figure's
    resolution, and a difference over a short interval may come out a tick below zero.
    """
    me = psutil.Process()
    own = me.cpu_times()
    # the calling thread from the same tick accounting as the process (/proc/self/task/TID/stat):
    # time.thread_time() is a precise clock, and over minutes of CPU the two drift apart by tens of ms
    tid = threading.get_native_id()
    mine = next((t for t in me.threads() if t.id == tid), None)
    total = own.user + own.system - (mine.user_time + mine.system_time if mine else time.thread_time())
    for child in me.children(recursive=True):
        try:
            t = child.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


class TcpByteCounter:
    """Cumulative TCP bytes sent/received by a set of processes, from ``ss -tinpH``."""

    def __init__(self) -> None:
        self.ss = shutil.which("ss")
        self._per_socket: dict[tuple[str, str], tuple[int, int]] = {}

    def totals(self, pids: set[int]) -> tuple[int, int]:
        """Return ``(sent_bytes, received_bytes)`` over all sockets of ``pids`` ever seen."""
        if self.ss is None:
            return 0, 0
        try:
            out = subprocess.run([self.ss, "-tinpH"], capture_output=True, text=True, timeout=5).stdout
        except (OSError, subprocess.SubprocessError):
            out = ""
        key, owned = None, False
        for line in out.splitlines():
            if not line.startswith(("\t", " ")):  # a socket line: state, queues, local, peer, users
                parts = line.split()
                key = (parts[3], parts[4]) if len(parts) >= 5 else None
                owned = any(int(p) in pids for p in _SS_PID.findall(line))
            elif key is not None and owned:  # its tcp_info line
                counts = dict(_SS_BYTES.findall(line))
                if counts:
                    self._per_socket[key] = (int(counts.get("sent", 0)), int(counts.get("received", 0)))
        sent = sum(s for s, _ in self._per_socket.values())
        received = sum(r for _, r in self._per_socket.values())
        return sent, received


class HostSampler:
    """Samples the host metrics of the current process tree every ``interval_s`` seconds.

    Args:
        sink: called with each sample dict (keys: see the module docstring plus ``wall_time``).
        interval_s: seconds between samples.
        network: also count TCP bytes (spawns ``ss`` once per sample; off for single-device runs).

    Use as a context manager; the last sample is taken on exit.
    """

    def __init__(self, sink: Callable[[dict], None], interval_s: float = 1.0, network: bool = False):
        self.sink = sink
        self.interval_s = interval_s
        self.tcp = TcpByteCounter() if network else None
        self.root = psutil.Process()
        self._procs: dict[int, psutil.Process] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ddlscope-host-sampler", daemon=True)

    def __enter__(self) -> "HostSampler":
        self.sample()  # primes cpu_percent counters
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.sample()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sample()
            except Exception:  # a sampler must never kill training
                pass

    def _tree(self) -> list[psutil.Process]:
        live = [self.root]
        try:
            live += self.root.children(recursive=True)
        except psutil.Error:
            pass
        procs = []
        for p in live:  # keep Process objects so cpu_percent() measures since the last call
            procs.append(self._procs.setdefault(p.pid, p))
        self._procs = {p.pid: p for p in procs}
        return procs

    def sample(self) -> dict:
        """Take one sample now, hand it to the sink and return it."""
        sample = dict(wall_time=time.time(), cpu_percent=0.0, rss_bytes=0, disk_read_bytes=0,
                      disk_write_bytes=0, ctx_switches=0, net_sent_bytes=0, net_recv_bytes=0)
        procs = self._tree()
        for p in procs:
            try:
                with p.oneshot():
                    sample["cpu_percent"] += p.cpu_percent()
                    sample["rss_bytes"] += p.memory_info().rss
                    io = p.io_counters()
                    sample["disk_read_bytes"] += io.read_bytes
                    sample["disk_write_bytes"] += io.write_bytes
                    ctx = p.num_ctx_switches()
                    sample["ctx_switches"] += ctx.voluntary + ctx.involuntary
            except (psutil.Error, AttributeError):
                continue
        if self.tcp is not None:
            sample["net_sent_bytes"], sample["net_recv_bytes"] = self.tcp.totals({p.pid for p in procs})
        self.sink(sample)
        return sample
