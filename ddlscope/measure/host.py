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
  remains. **Unknown (None)** when they cannot be counted (:class:`TcpByteCounter` says why:
  ``ss`` not installed or failing, sockets of the tree that ``ss`` does not attribute to it,
  a kernel without ``bytes_sent``); 0 only when counted: the tree had no TCP traffic, or the
  sampler was told the worker uses no network (``network=False``: a single-device run).

A metric that could not be measured is reported once to the sampler's ``note`` callback (see
:class:`HostSampler`), which the training loop stores as a :data:`UNKNOWN_EVENT` event.
"""

from __future__ import annotations

import multiprocessing
import re
import shutil
import subprocess
import threading
import time
from typing import Callable

import psutil

_SS_PID = re.compile(r"pid=(\d+)")
_SS_BYTES = re.compile(r"\bbytes_(sent|received|acked):(\d+)")

UNKNOWN_EVENT = "host_metric_unknown"
"""Event kind of a host metric that could not be measured; detail: ``metric`` (a host_samples column) and ``reason``."""

NOT_BACKGROUND_THREAD_PREFIX = "ddlscope-"
"""Python threads whose name starts with this are ddlscope's own (host sampler, store writer): not background work."""

_DATALOADER_MODULE = "torch.utils.data"


def _is_dataloader(target: object) -> bool:
    """Whether a thread's or process's target function is torch's DataLoader's (worker loop, pin-memory loop)."""
    return str(getattr(target, "__module__", "") or "").startswith(_DATALOADER_MODULE)


def _plain_multiprocessing_children() -> set[int]:
    """Pids of this process's live multiprocessing children that are instances of :mod:`multiprocessing`'s
    own ``Process`` classes, not of a subclass: DataLoader workers are (torch starts
    ``multiprocessing_context.Process``); hivemind's DHT and averagers are subclasses."""
    return {p.pid for p in multiprocessing.active_children()
            if p.pid is not None and type(p).__module__.startswith("multiprocessing")}


def background_threads() -> dict[int, str]:
    """The Python threads of this process that count as background work, as ``{native thread id: name}``:
    every live :mod:`threading` thread except the calling one, ddlscope's own (names starting with
    :data:`NOT_BACKGROUND_THREAD_PREFIX`) and DataLoader's pin-memory thread. Native threads (torch's
    intra-op OpenMP pool, its inter-op pool, autograd's device threads, CUDA's) are never Python threads.
    """
    me = threading.get_native_id()
    return {t.native_id: t.name for t in threading.enumerate()
            if t.native_id is not None and t.native_id != me and not t.name.startswith(NOT_BACKGROUND_THREAD_PREFIX)
            and not _is_dataloader(getattr(t, "_target", None))}


RESCAN_S = 2.0
"""Seconds a :class:`BackgroundCpu` keeps its list of background processes before it lists them again."""


def _background_processes() -> list[psutil.Process]:
    """This process's descendants whose CPU counts as background (:func:`background_cpu_s`): all of
    them except the trees of plain multiprocessing children (DataLoader workers). One scan of ``/proc``."""
    me = psutil.Process()
    try:
        descendants = me.children(recursive=True)
    except psutil.Error:
        return []
    parent: dict[int, int] = {}
    for p in descendants:
        try:
            parent[p.pid] = p.ppid()
        except psutil.Error:
            continue
    excluded = _plain_multiprocessing_children()

    def under_a_loader(pid: int) -> bool:
        while pid in parent:
            if pid in excluded:
                return True
            pid = parent[pid]
        return False

    return [p for p in descendants if p.pid in parent and not under_a_loader(p.pid)]


def _background_thread_cpu_s() -> float:
    """CPU seconds of the Python threads of :func:`background_threads` (0.0 when they cannot be read)."""
    wanted = background_threads()
    try:
        return float(sum(t.user_time + t.system_time for t in psutil.Process().threads() if t.id in wanted))
    except psutil.Error:
        return 0.0


class BackgroundCpu:
    """:func:`background_cpu_s` for a caller that reads it often (every training step): the list of
    background processes is kept for ``rescan_s`` seconds (default :data:`RESCAN_S`) and only their CPU
    times are read in between (one ``/proc/PID/stat`` each): 0.16 ms of CPU per call against 1.4 ms
    for listing the tree every time, and 3.6 ms before a listing was one scan of ``/proc`` (a peer
    with a hivemind optimizer on the 2-core development machine). A process that
    starts between two listings is counted from the next listing on, its CPU until then included;
    one that exits is not counted, as in :func:`background_cpu_s`. Calling it returns CPU seconds.

    Raises:
        ValueError: ``rescan_s`` < 0.
    """

    def __init__(self, rescan_s: float = RESCAN_S) -> None:
        if rescan_s < 0:
            raise ValueError(f"rescan_s must be >= 0 seconds, got {rescan_s}")
        self.rescan_s = rescan_s
        self._processes: list[psutil.Process] = []
        self._listed_at: float | None = None

    def __call__(self) -> float:
        now = time.monotonic()
        if self._listed_at is None or now - self._listed_at >= self.rescan_s:
            self._processes, self._listed_at = _background_processes(), now
        total = _background_thread_cpu_s()
        for p in self._processes:
            try:
                t = p.cpu_times()
            except psutil.Error:
                continue
            total += t.user + t.system
        return total


def background_cpu_s() -> float:
    """CPU seconds (user + system) used so far by this process's background work: hivemind's threads
    and processes on a collaborative peer (its progress tracker, state-fetcher and RPC threads, its
    DHT and averager processes, ``p2pd``), not training's own work.

    Method. Counted: the Python threads of :func:`background_threads` (the kernel's per-thread
    ticks, ``/proc/self/task/TID/stat``), plus every descendant process, except the trees of
    multiprocessing children of :mod:`multiprocessing`'s own ``Process`` classes: that is what
    DataLoader workers are (the worker's Process object keeps no target after it starts, so its
    class is what tells it apart), while hivemind's DHT and averager processes are subclasses
    (``hivemind.DHT``, ``DecentralizedAverager``) and ``p2pd`` is their subprocess. Not counted: the calling (training) thread; native threads, which is what torch's
    intra-op (OpenMP) and inter-op pools, autograd's device threads and CUDA's threads are, however
    many cores the peer has (hivemind creates its threads with :mod:`threading`, so they are Python
    threads); ddlscope's own threads; DataLoader workers (and any child started as a plain
    ``multiprocessing.Process``) and pin-memory thread. Torch threads that a
    hivemind *thread* starts by running tensor ops are native and not counted; tensor ops in
    hivemind's *processes* are.

    Differences between two calls give the background CPU of an interval; on a peer whose cores the
    training thread keeps busy, that CPU time is taken from training. Threads and descendants that
    exited between the calls are not counted. The kernel accounts CPU time in clock ticks (usually
    10 ms): that is this figure's resolution, and a difference over a short interval may come out
    a tick below zero. Errors reading an exiting process are skipped; nothing is raised.

    Each call lists the process tree afresh (one scan of ``/proc``, 1.4 ms of CPU next to a hivemind
    optimizer); a caller that reads it every step keeps a :class:`BackgroundCpu` instead.
    """
    return BackgroundCpu(rescan_s=0.0)()


class TcpByteCounter:
    """Cumulative TCP bytes sent/received by a set of processes, from ``ss -tinpH``.

    Attributes:
        reason: why the last :meth:`totals` could not count (None when it could).
    """

    def __init__(self) -> None:
        self.ss = shutil.which("ss")
        self.reason: str | None = None
        self._per_socket: dict[tuple[str, str], tuple[int, int]] = {}

    def totals(self, pids: set[int]) -> tuple[int, int] | None:
        """``(sent_bytes, received_bytes)`` over all TCP sockets of ``pids`` ever seen, or None when
        they cannot be counted (:attr:`reason` says why): ``ss`` is not installed or fails; a process
        of ``pids`` hold TCP sockets (per psutil, open before ``ss`` ran and still after it) of which
        ``ss`` attributes none to them (it cannot read their processes); a socket of theirs
        acknowledges bytes but shows no ``bytes_sent`` (a kernel older than 4.19). ``ss`` prints a
        counter only when it is not zero. Sockets that close while ``ss`` runs (a peer shutting
        down) are not counted as unreadable: a CI run's last sample of a finishing hivemind peer
        was stored as unknown that way, and with it the whole worker's bytes.

        Cost: one ``ss`` (about 5 ms of CPU). psutil's list of the processes' sockets (about 15 ms
        for a hivemind peer's 6 processes, each reading the namespace's whole socket table) is
        read only when ``ss`` attributes no socket to them, the one case it decides; it used to be
        read at every sample, 1.5 % of a one-core peer's CPU at one sample a second.
        """
        if self.ss is None:
            self.reason = "ss (iproute2) is not installed, so TCP bytes cannot be counted"
            return None
        listed = self._listed(pids)
        if listed is None:
            return None
        seen, counts = listed
        if not seen:  # no socket of theirs, or ss cannot read their processes: ask psutil, around a second ss
            held = _tcp_sockets(pids)  # before ss: a socket it lists then is one ss lists too, unless it closed
            if held:
                listed = self._listed(pids)
                if listed is None:
                    return None
                seen, counts = listed
                # a socket that psutil saw open before ss ran and still sees open after it must be in ss's list;
                # one that closed in between (a peer shutting down at the end of its run) is not a sign of
                # unreadable processes
                still_open = held - seen and held & _tcp_sockets(pids)
                if still_open and not held & seen:
                    local, peer = sorted(still_open)[0]
                    self.reason = (f"ss shows none of the worker's {len(held)} TCP socket(s) as its own (e.g. "
                                   f"{local} -> {peer}): it cannot read their processes")
                    return None
        self._per_socket.update(counts)
        self.reason = None
        sent = sum(s for s, _ in self._per_socket.values())
        received = sum(r for _, r in self._per_socket.values())
        return sent, received

    def _listed(self, pids: set[int]) -> tuple[set, dict] | None:
        """One ``ss -tinpH``: the ``(local, peer)`` sockets it attributes to ``pids`` and their
        ``(sent, received)`` bytes; None (and :attr:`reason`) when ``ss`` fails or the kernel lacks
        the counter."""
        try:
            run = subprocess.run([self.ss, "-tinpH"], capture_output=True, text=True, timeout=5)
        except (OSError, subprocess.SubprocessError) as err:
            self.reason = f"'ss -tinpH' failed: {err}"
            return None
        if run.returncode != 0:
            self.reason = f"'ss -tinpH' exited {run.returncode}: {run.stderr.strip()[:200]}"
            return None
        key, owned, seen, counts = None, False, set(), {}
        for line in run.stdout.splitlines():
            if not line.startswith(("\t", " ")):  # a socket line: state, queues, local, peer, users
                parts = line.split()
                key = (parts[3], parts[4]) if len(parts) >= 5 else None
                owned = any(int(p) in pids for p in _SS_PID.findall(line))
                if owned and key is not None:
                    seen.add(key)
            elif key is not None and owned:  # its tcp_info line
                found = {k: int(v) for k, v in _SS_BYTES.findall(line)}
                if found.get("acked") and "sent" not in found:
                    self.reason = "this kernel's TCP info has no bytes_sent counter (needs Linux >= 4.19)"
                    return None
                counts[key] = (found.get("sent", 0), found.get("received", 0))
        return seen, counts


def _tcp_sockets(pids: set[int]) -> set[tuple[str, str]]:
    """``(local, peer)`` address pairs, formatted as ``ss`` does, of the connected TCP sockets of ``pids`` (psutil)."""
    out = set()
    for pid in pids:
        try:
            conns = psutil.Process(pid).net_connections(kind="tcp")
        except psutil.Error:
            continue
        for c in conns:
            if c.raddr and c.status != psutil.CONN_LISTEN:
                out.add((_ss_address(c.laddr), _ss_address(c.raddr)))
    return out


def _ss_address(addr) -> str:
    """An address as ``ss`` prints it: ``ip:port``, IPv6 in brackets."""
    return f"[{addr.ip}]:{addr.port}" if ":" in addr.ip else f"{addr.ip}:{addr.port}"


class HostSampler:
    """Samples the host metrics of the current process tree every ``interval_s`` seconds.

    Args:
        sink: called with each sample dict (keys: see the module docstring plus ``wall_time``); a
            metric that could not be measured is None in it.
        interval_s: seconds between samples.
        network: also count TCP bytes (spawns ``ss`` once per sample; off for single-device runs,
            whose samples then read 0 bytes).
        note: called as ``note(metric=..., reason=...)`` once per metric that could not be measured
            (a host_samples column, e.g. ``net_sent_bytes``), on the thread that enters or leaves the
            context manager (the sampler's own thread only records it); e.g.
            ``functools.partial(store.add_event, run_id, worker, UNKNOWN_EVENT)``.

    Use as a context manager; the last sample is taken on exit.
    """

    def __init__(self, sink: Callable[[dict], None], interval_s: float = 1.0, network: bool = False,
                 note: Callable[..., None] | None = None):
        self.sink = sink
        self.interval_s = interval_s
        self.tcp = TcpByteCounter() if network else None
        self.note = note
        #: metric -> why it could not be measured (the first reason seen), over the samples so far
        self.unknown: dict[str, str] = {}
        self._noted: set[str] = set()
        self.root = psutil.Process()
        self._procs: dict[int, psutil.Process] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{NOT_BACKGROUND_THREAD_PREFIX}host-sampler",
                                        daemon=True)

    def __enter__(self) -> "HostSampler":
        self.sample()  # primes cpu_percent counters
        self._report_unknown()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.sample()
        self._report_unknown()

    def _report_unknown(self) -> None:
        for metric, reason in list(self.unknown.items()):
            if self.note is not None and metric not in self._noted:
                self._noted.add(metric)
                try:
                    self.note(metric=metric, reason=reason)
                except Exception:  # a sampler must never kill training
                    pass

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
            counted = self.tcp.totals({p.pid for p in procs})
            sample["net_sent_bytes"], sample["net_recv_bytes"] = counted if counted is not None else (None, None)
            if counted is None:
                for metric in ("net_sent_bytes", "net_recv_bytes"):
                    self.unknown.setdefault(metric, self.tcp.reason or "not counted")
        self.sink(sample)
        return sample
