"""Emulated networks: each peer of a run in a Linux network namespace of its own, links rate-limited.

One run gets one emulated network (:class:`EmulatedNetwork`): a bridge, and per peer ``i`` a
network namespace ``ddl-<tag>-<i>`` joined to the bridge by a veth pair, with address
``10.201.0.<i+2>/24``; a run's services (dmoe's expert servers) get namespaces of their own after
the peers' (server ``s``: ``i = peers + s``). Each peer's upload is limited by a token-bucket
filter (tc ``tbf``) on the namespace's end of its veth, its download by one on the bridge's end,
so a peer's link is what a host with that uplink and downlink would see. The namespaces have no route out and the bridge no
address: traffic stays between the run's peers (the results store is a file; namespaces separate
the network only). ``<tag>`` is the owner process's pid in hex, so concurrent runs never share
names, and a network whose owner died is recognised and removed (:func:`remove_stale`).

Latency needs tc ``netem``; kernels without it (this project's CI machine) get a clear error,
never a silently unlimited link (:func:`check_can_emulate`).

Nothing is left behind: :meth:`EmulatedNetwork.remove` kills what still runs in the namespaces
and deletes them (deleting a namespace deletes its veth ends and qdiscs) and the bridge; a reaper
process (:mod:`ddlscope.network.reaper`, in a session of its own) does the same when the owner is
killed before it could (SIGKILL, OOM).

Needs root (``CAP_NET_ADMIN``) and iproute2's ``ip`` and ``tc``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ddlscope.errors import UserError
from ddlscope.launch.processes import is_shm_manager

SUBNET = "10.201.0"
"""The /24 every emulated network uses (namespaces of different runs never see each other)."""
PREFIX = "ddl"
"""Names of ddlscope's namespaces (``ddl-<tag>-<i>``), bridges (``ddl<tag>-br``) and veths (``ddl<tag>-h<i>``)."""
QUEUE_LATENCY_MS = 100
"""tbf's queue: packets that would wait longer than this at the configured rate are dropped (as
on a real bottleneck link's buffer)."""
BUCKET_MS = 10.0
"""tbf's bucket by default (``[network] bucket_ms``), in milliseconds at the configured rate: what
an idle link lets through at once. A real link has none (every byte waits for the bytes before
it), but a bucket smaller than the kernel's 64 KiB segmentation-offload packets makes tbf cut them
into 1,514-byte packets in software, on the cores that train: with 1 ms, fsdp's steps over 50 Mbit/s
links took 11 % longer (docs/emulated-networks.md). With 10 ms a request/response of 8 KiB each way
over a 10 Mbit/s link takes 0.3 ms instead of the 13 ms its bytes need at that rate; ``bucket_ms =
1`` holds such small messages (dmoe's remote calls) to the rate."""
BUCKET_MIN_BYTES = 2048
"""The smallest bucket: above one full-size packet (1,514 bytes with its Ethernet header), which
must fit in the bucket or tbf drops it."""
_NAMESPACE = re.compile(rf"^{PREFIX}-([0-9a-f]+)-(\d+)$")


class LinkConfig(BaseModel):
    """One peer's or one expert server's link, overriding the network's default (``[[network.links]]``).

    Exactly one of ``peer`` (a worker/peer index) and ``server`` (an index among the run's services:
    dmoe's expert server ``s``) names whose link it is.
    """

    model_config = ConfigDict(extra="forbid")

    peer: int | None = Field(None, ge=0, description="worker/peer index")
    server: int | None = Field(None, ge=0, description="expert server index (dmoe's services)")
    bandwidth_mbit_per_s: float | None = Field(None, gt=0, le=400_000, description="upload and download, Mbit/s")
    upload_mbit_per_s: float | None = Field(None, gt=0, le=400_000, description="this link's upload, Mbit/s")
    download_mbit_per_s: float | None = Field(None, gt=0, le=400_000, description="this link's download, Mbit/s")

    @model_validator(mode="after")
    def _peer_or_server(self) -> "LinkConfig":
        if (self.peer is None) == (self.server is None):
            raise ValueError("a network.links entry names exactly one of peer and server; allowed: "
                             "{ peer = 1, ... } or { server = 0, ... }")
        return self

    @property
    def owner(self) -> str:
        """``"peer 1"`` or ``"server 0"``: whose link this is."""
        return f"peer {self.peer}" if self.peer is not None else f"server {self.server}"

    def over(self, up: float | None, down: float | None) -> tuple[float | None, float | None]:
        """This entry's (upload, download) in Mbit/s where it sets them, over the rates it replaces
        (``up``, ``down``: the network's; None: unlimited)."""
        both = self.bandwidth_mbit_per_s
        return self.upload_mbit_per_s or both or up, self.download_mbit_per_s or both or down


class NetworkConfig(BaseModel):
    """A run's network (``[network]``): loopback (default) or an emulated one with rate-limited links.

    ``bandwidth_mbit_per_s`` is every peer's (and expert server's) upload and download unless a
    ``links`` entry says otherwise for that peer or server; None leaves a direction unlimited (veth
    speed, several Gbit/s).
    ``latency_ms`` is one-way delay per link and needs tc netem.
    """

    model_config = ConfigDict(extra="forbid")

    emulate: bool = Field(False, description="each peer in a network namespace of its own (root only)")
    bandwidth_mbit_per_s: float | None = Field(None, gt=0, le=400_000, description="every peer's upload and download, Mbit/s")
    latency_ms: float | None = Field(None, ge=0, le=10_000, description="one-way delay per link, ms (needs tc netem)")
    bucket_ms: float = Field(BUCKET_MS, gt=0, le=1_000, description=(
        "each link's token bucket, ms at its rate (at least 2 KiB): what an idle link lets through at once; "
        "1 holds small messages to the rate but costs CPU in bulk transfers, 10 (default) the reverse"))
    links: list[LinkConfig] = Field(default_factory=list, description="per-peer and per-server overrides")

    @model_validator(mode="after")
    def _one_entry_per_peer(self) -> "NetworkConfig":
        seen = [link.owner for link in self.links]
        if len(seen) != len(set(seen)):
            raise ValueError(f"network.links names a peer or server twice ({', '.join(seen)}); allowed: one entry "
                             "per peer or server")
        if not self.emulate and (self.links or self.bandwidth_mbit_per_s or self.latency_ms):
            raise ValueError("bandwidth_mbit_per_s, latency_ms and links need network.emulate = true")
        return self

    def rates(self, peers: int, servers: int = 0) -> list[tuple[float | None, float | None]]:
        """Each namespace's (upload, download) in Mbit/s (None: unlimited): the ``peers`` peers
        first, then the ``servers`` expert servers (server ``s`` is namespace ``peers + s``).

        Raises:
            UserError: a ``links`` entry names a peer >= ``peers`` or a server >= ``servers``.
        """
        out = [(self.bandwidth_mbit_per_s, self.bandwidth_mbit_per_s) for _ in range(peers + servers)]
        for link in self.links:
            if link.peer is not None and link.peer >= peers:
                raise UserError(f"network.links: peer {link.peer} does not exist; allowed: 0..{peers - 1} ({peers} peers)")
            if link.server is not None and link.server >= servers:
                allowed = f"0..{servers - 1} ({servers} expert servers)" if servers else "none: this run starts no servers"
                raise UserError(f"network.links: server {link.server} does not exist; allowed: {allowed}")
            at = link.peer if link.peer is not None else peers + link.server
            out[at] = link.over(*out[at])
        return out

    def peer_rate(self, peer: int) -> tuple[float | None, float | None]:
        """Peer ``peer``'s (upload, download) in Mbit/s (None: unlimited): its ``links`` entry's
        rates where it has one, the network's ``bandwidth_mbit_per_s`` otherwise; unlike
        :meth:`rates` it needs no count of the run's peers and servers."""
        rate = (self.bandwidth_mbit_per_s, self.bandwidth_mbit_per_s)
        for link in self.links:
            if link.peer == peer:
                rate = link.over(*rate)
        return rate


def run_rates(cfg: Any) -> list[tuple[float | None, float | None]]:
    """The (upload, download) of every namespace of run config ``cfg`` (a
    :class:`ddlscope.config.RunConfig`): its peers', then its services' (dmoe's expert servers).

    Raises:
        UserError: a ``links`` entry names a peer or server the run does not have.
    """
    services = cfg.distribution_model.services
    return cfg.network.rates(cfg.peers, len(services(cfg)) if services is not None else 0)


def emulated_models() -> list[str]:
    """Distribution models whose runs can be placed on an emulated network: every one but
    ``single``. The swarm models (collaborative, dmoe) start each peer in its namespace, and each
    of dmoe's expert servers in a namespace of its own after the peers' (:meth:`EmulatedNetwork.for_run`);
    torchrun's models (ddp, fsdp, gpipe, 1f1b, diloco) start each worker by an agent of its own in
    its namespace, as one node of a cluster."""
    from ddlscope import distribution

    return [*distribution.with_launcher("swarm"), *distribution.with_launcher("torchrun")]


def check_can_emulate(latency: bool = False) -> None:
    """Raise :class:`UserError` unless this process can build emulated networks.

    Args:
        latency: also require tc netem (for ``latency_ms``).
    """
    if not sys.platform.startswith("linux"):
        raise UserError("network.emulate needs Linux network namespaces; this is " + sys.platform)
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise UserError(f"network.emulate needs iproute2 ({' and '.join(missing)} not found on PATH)")
    if os.geteuid() != 0:
        raise UserError("network.emulate needs root (CAP_NET_ADMIN) to create namespaces and links; "
                        "run as root or leave network.emulate = false")
    if latency and not netem_available():
        raise UserError("network.latency_ms needs the kernel's tc netem qdisc (sch_netem), which this kernel "
                        "does not have; leave latency_ms unset (bandwidth limits work without it)")


def netem_available() -> bool:
    """True when tc can create a netem qdisc (tried on a throw-away namespace's loopback)."""
    ns = f"{PREFIX}-probe{os.getpid():x}"
    try:
        _ip("netns", "add", ns)
        done = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "netem",
                               "delay", "1ms"], capture_output=True)
        return done.returncode == 0
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@dataclass
class EmulatedNetwork:
    """The namespaces, veths and rate limits of one run.

    Args:
        rates_mbit_per_s: per peer (upload, download) in Mbit/s; None is unlimited.
        latency_ms: one-way delay added to each direction of every link (netem; None: none).
        bucket_ms: each tbf's bucket, milliseconds at its rate (:data:`BUCKET_MS`).
        owner_pid: the process that owns it (its death removes it); default this process.

    Use :meth:`create`, start peer ``i`` with :meth:`wrap` (``ip netns exec``), let it listen on
    :meth:`address`, read :meth:`counters` before :meth:`remove`. Also a context manager.
    """

    rates_mbit_per_s: list[tuple[float | None, float | None]]
    latency_ms: float | None = None
    bucket_ms: float = BUCKET_MS
    owner_pid: int = field(default_factory=os.getpid)
    created: bool = False
    reaper: subprocess.Popen | None = None

    @property
    def tag(self) -> str:
        """Hex pid of the owner: unique among live networks on this machine."""
        return f"{self.owner_pid:x}"

    @property
    def bridge(self) -> str:
        return f"{PREFIX}{self.tag}-br"

    def namespace(self, peer: int) -> str:
        """Network namespace of ``peer``."""
        return f"{PREFIX}-{self.tag}-{peer}"

    def host_veth(self, peer: int) -> str:
        """The bridge's end of ``peer``'s veth (its egress is the peer's download)."""
        return f"{PREFIX}{self.tag}-h{peer}"

    interface = "eth0"
    """The name of each namespace's end of its veth (its only interface besides loopback)."""

    def address(self, peer: int) -> str:
        """``peer``'s IPv4 address (``10.201.0.<peer+2>``)."""
        return f"{SUBNET}.{peer + 2}"

    def wrap(self, peer: int, cmd: list[str]) -> list[str]:
        """``cmd`` run inside ``peer``'s namespace (``ip netns exec`` execs it: same pid, same session)."""
        return ["ip", "netns", "exec", self.namespace(peer), *cmd]

    # ------------------------------------------------------------------ build
    def create(self) -> "EmulatedNetwork":
        """Build the bridge, namespaces, veths and rate limits; start the reaper.

        Raises:
            UserError: not root, no iproute2, or more than 250 peers.
            RuntimeError: an ``ip``/``tc`` command failed (what was built is removed first).
        """
        check_can_emulate(latency=self.latency_ms is not None)
        if len(self.rates_mbit_per_s) > 250:
            raise UserError(f"network.emulate: {len(self.rates_mbit_per_s)} peers; allowed: at most 250 (one /24)")
        self.created = True
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            for peer, (up, down) in enumerate(self.rates_mbit_per_s):
                self._add_peer(peer, up, down)
        except BaseException:
            self.remove()
            raise
        self.reaper = subprocess.Popen([sys.executable, "-m", "ddlscope.network.reaper", "--owner-pid",
                                        str(self.owner_pid), "--peers", str(len(self.rates_mbit_per_s))],
                                       start_new_session=True, stdin=subprocess.DEVNULL,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return self

    def _add_peer(self, peer: int, up: float | None, down: float | None) -> None:
        ns, host_end, ns_end = self.namespace(peer), self.host_veth(peer), f"{PREFIX}{self.tag}-n{peer}"
        _ip("netns", "add", ns)
        _ip("link", "add", host_end, "type", "veth", "peer", "name", ns_end)
        _ip("link", "set", ns_end, "netns", ns)
        _ip("link", "set", host_end, "master", self.bridge)
        _ip("link", "set", host_end, "up")
        _ip("-n", ns, "link", "set", ns_end, "name", self.interface)
        _ip("-n", ns, "addr", "add", f"{self.address(peer)}/24", "dev", self.interface)
        _ip("-n", ns, "link", "set", self.interface, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        if up is not None or self.latency_ms is not None:
            _shape(["ip", "netns", "exec", ns, "tc"], self.interface, up, self.latency_ms, self.bucket_ms)
        if down is not None or self.latency_ms is not None:
            _shape(["tc"], host_end, down, self.latency_ms, self.bucket_ms)

    # ------------------------------------------------------------------ read
    def counters(self) -> list[dict[str, float | int | str | None]]:
        """Per peer: namespace, address, the configured rates and what its links carried so far.

        Returns one dict per peer with ``peer``, ``namespace``, ``address``, ``upload_mbit_per_s``,
        ``download_mbit_per_s`` (None: unlimited), ``bytes_sent`` / ``bytes_received`` (bytes the
        peer's interface sent / the bridge delivered to it, from the kernel's link counters),
        ``drops_upload`` / ``drops_download`` (packets the rate limit dropped; None without one).
        """
        rows = []
        for peer, (up, down) in enumerate(self.rates_mbit_per_s):
            ns = self.namespace(peer)
            link = _link_stats(["ip", "-n", ns], "eth0")
            rows.append({"peer": peer, "namespace": ns, "address": self.address(peer), "upload_mbit_per_s": up,
                         "download_mbit_per_s": down, "bytes_sent": link.get("tx_bytes"),
                         "bytes_received": link.get("rx_bytes"),
                         "drops_upload": _tbf_drops(["ip", "netns", "exec", ns, "tc"], "eth0") if up else None,
                         "drops_download": _tbf_drops(["tc"], self.host_veth(peer)) if down else None})
        return rows

    # ------------------------------------------------------------------ remove
    def remove(self) -> None:
        """Kill what still runs in the namespaces, delete them (their veths and qdiscs go with them)
        and the bridge; end the reaper. Safe to call twice and on a half-built network."""
        if not self.created:
            return
        remove_network(self.tag, len(self.rates_mbit_per_s))
        if self.reaper is not None and self.reaper.poll() is None:
            self.reaper.kill()
            self.reaper.wait()
        self.created = False

    # ------------------------------------------------------------------ runs
    @classmethod
    def for_run(cls, cfg: Any, workers_here: int) -> "EmulatedNetwork | None":
        """The (not yet built) network of run config ``cfg``, or None when it runs on loopback.

        Checks, before anything starts, that it can be built here.

        Namespaces ``0 .. peers-1`` are the peers', then one per service (dmoe's expert server
        ``s`` in namespace ``peers + s``), each with its own link (:func:`run_rates`).

        Args:
            cfg: a :class:`ddlscope.config.RunConfig`.
            workers_here: peers this launcher starts (all of them: an emulated network is one machine).

        Raises:
            UserError: some peers run elsewhere, not root, no iproute2, latency without netem.
        """
        net = cfg.network
        if not net.emulate:
            return None
        if workers_here != cfg.peers:
            raise UserError(f"network.emulate: {cfg.peers} peers, {workers_here} started here; allowed: every peer "
                            "on this machine (an emulated network lives on one machine)")
        check_can_emulate(latency=net.latency_ms is not None)
        remove_stale()
        return cls(run_rates(cfg), net.latency_ms, net.bucket_ms)

    def peer_command(self, peer: int, cmd: list[str]) -> list[str]:
        """A worker's or service's command line run inside namespace ``peer``, listening on its
        address (``--listen /ip4/<address>/tcp/0``)."""
        return self.wrap(peer, [*cmd, "--listen", f"/ip4/{self.address(peer)}/tcp/0"])

    def record(self, store: Any, run_id: str) -> None:
        """Store :meth:`counters` as the run's ``network_links`` rows, ``worker_index`` the namespace
        index (a dmoe run's expert server ``s``: ``peers + s``)."""
        rows = [{"run_id": run_id, "worker_index": c.pop("peer"), **c} for c in self.counters()]
        store.add_rows("network_links", rows)

    def __enter__(self) -> "EmulatedNetwork":
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.remove()


def remove_network(tag: str, peers: int | None = None, grace_s: float = 0.0) -> None:
    """Remove the emulated network ``tag``: end every process in its namespaces, delete them and
    its bridge. torch's shm manager, which a peer sharing tensors started in its namespace, gets up
    to :data:`SHM_MANAGER_WAIT_S` after the other processes to unlink their segments and end by itself.

    Args:
        tag: the network's tag (its owner's pid in hex).
        peers: how many namespaces it has; None removes every namespace with that tag that exists.
        grace_s: SIGTERM first and wait up to this long for the processes to exit (so that a worker
            whose launcher died can record why it stops), then SIGKILL what is left.
    """
    names = [f"{PREFIX}-{tag}-{i}" for i in range(peers)] if peers is not None else \
        [n for n in namespaces() if _NAMESPACE.match(n) and _NAMESPACE.match(n).group(1) == tag]
    if grace_s > 0:
        _signal_all([pid for ns in names for pid in _netns_pids(ns) if not is_shm_manager(pid)], signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(not is_shm_manager(p) for ns in names for p in _netns_pids(ns)):
            time.sleep(0.1)
    managers = []
    for ns in names:
        pids = _netns_pids(ns)
        managers += [pid for pid in pids if is_shm_manager(pid)]
        _signal_all([pid for pid in pids if pid not in managers], signal.SIGKILL)
    # torch's shm manager unlinks its clients' segments in /dev/shm and exits once they are gone; killed
    # with them, it left every segment behind (317 from one collaborative run)
    deadline = time.monotonic() + SHM_MANAGER_WAIT_S
    while time.monotonic() < deadline and any(is_shm_manager(pid) for pid in managers):
        time.sleep(0.05)
    _signal_all([pid for pid in managers if is_shm_manager(pid)], signal.SIGKILL)
    for ns in names:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    # a namespace's veth goes with it, but asynchronously: delete the bridge's ends (and the bridge) now
    for dev in _links(f"{PREFIX}{tag}-"):
        subprocess.run(["ip", "link", "del", dev], capture_output=True)


SHM_MANAGER_WAIT_S = 5.0
"""Seconds :func:`remove_network` lets torch's shm manager (:data:`ddlscope.launch.processes.SHM_MANAGER`)
end by itself after its clients, before SIGKILL: it needs 1-4 s to unlink their segments."""


def _links(prefix: str) -> list[str]:
    done = subprocess.run(["ip", "-j", "link", "show"], capture_output=True, text=True)
    return [d["ifname"] for d in json.loads(done.stdout or "[]") if d["ifname"].startswith(prefix)]


def _signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def namespaces() -> list[str]:
    """Names of the network namespaces ``ip netns`` knows (all of them, not only ddlscope's)."""
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def remove_stale() -> list[str]:
    """Remove every ddlscope network whose owner process is gone; return their tags."""
    tags = {m.group(1) for n in namespaces() if (m := _NAMESPACE.match(n))}
    stale = [t for t in sorted(tags) if not _pid_alive(int(t, 16))]
    for tag in stale:
        remove_network(tag)
    return stale


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _netns_pids(ns: str) -> list[int]:
    done = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    return [int(p) for p in done.stdout.split() if p.isdigit()]


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip() or f'exit code {done.returncode}'}")


def bucket_bytes(rate_mbit_per_s: float, bucket_ms: float) -> int:
    """tbf's bucket on a link of ``rate_mbit_per_s``: ``bucket_ms`` at the rate, in bytes, at least
    :data:`BUCKET_MIN_BYTES`."""
    return max(BUCKET_MIN_BYTES, int(rate_mbit_per_s * 1e6 / 8 * bucket_ms / 1e3))


def _shape(tc: list[str], dev: str, rate_mbit_per_s: float | None, latency_ms: float | None,
           bucket_ms: float) -> None:
    """Limit ``dev``'s egress: a tbf rate limit, or with a latency netem's delay and rate together.

    tbf's bucket holds ``bucket_ms`` at the rate (at least :data:`BUCKET_MIN_BYTES`); its queue
    :data:`QUEUE_LATENCY_MS`. netem (latency) queues up to 1000 packets.
    """
    if latency_ms is not None:
        rate = ["rate", f"{rate_mbit_per_s * 1000:.0f}kbit"] if rate_mbit_per_s is not None else []
        cmd = [*tc, "qdisc", "replace", "dev", dev, "root", "netem", "delay", f"{latency_ms:g}ms", *rate, "limit", "1000"]
    else:
        cmd = [*tc, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{rate_mbit_per_s * 1000:.0f}kbit",
               "burst", str(bucket_bytes(rate_mbit_per_s, bucket_ms)), "latency", f"{QUEUE_LATENCY_MS}ms"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")


def _link_stats(ip: list[str], dev: str) -> dict[str, int]:
    done = subprocess.run([*ip, "-s", "-j", "link", "show", "dev", dev], capture_output=True, text=True)
    if done.returncode != 0 or not done.stdout.strip():
        return {}
    stats = json.loads(done.stdout)[0].get("stats64", {})
    return {"tx_bytes": stats.get("tx", {}).get("bytes"), "rx_bytes": stats.get("rx", {}).get("bytes")}


def _tbf_drops(tc: list[str], dev: str) -> int | None:
    done = subprocess.run([*tc, "-s", "-j", "qdisc", "show", "dev", dev], capture_output=True, text=True)
    if done.returncode != 0 or not done.stdout.strip():
        return None
    return next((q.get("drops") for q in json.loads(done.stdout) if q.get("kind") in ("tbf", "netem")), None)


def wait_removed(tag: str, timeout_s: float = 10.0) -> bool:
    """Wait up to ``timeout_s`` for every namespace of network ``tag`` to be gone; True if they are."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not [n for n in namespaces() if n.startswith(f"{PREFIX}-{tag}-")]:
            return True
        time.sleep(0.1)
    return False
