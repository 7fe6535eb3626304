"""Nothing open: a local run listens on loopback only, and its torchrun agent dies with its launcher.

The fast tests check the pieces (the agent's bound stores, the command line, hivemind's p2p
options, the ``nat_traversal`` check); the slow ones watch every socket of a real ``ddlscope run``
(ddp through torchrun, collaborative through hivemind) and SIGKILL a launcher.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys
import time

import psutil
import pytest

from ddlscope.config import validate_config
from ddlscope.launch.agent import bound_store_factory, local_address_for, patch_torch_stores
from ddlscope.launch.network import is_loopback, p2p_options
from ddlscope.launch.torchrun import torchrun_command
from ddlscope.store.db import ResultsStore
from tests.conftest import tiny_run

slow = pytest.mark.slow


def _own_listeners() -> list:
    return [c for c in psutil.Process().net_connections("inet") if c.status == psutil.CONN_LISTEN]


# ---------------------------------------------------------------------- the pieces
def test_bound_store_listens_on_loopback_only_and_serves_clients():
    import torch.distributed as dist

    before = {c.laddr for c in _own_listeners()}
    server = bound_store_factory("loopback", dist.TCPStore)("127.0.0.1", 0, is_master=True, multi_tenant=True,
                                                            wait_for_workers=False)
    new = [c for c in _own_listeners() if c.laddr not in before]
    assert [c.laddr.ip for c in new] == ["127.0.0.1"], new
    assert new[0].laddr.port == server.port
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False)
    client.set("key", "value")
    assert server.get("key") == b"value"


def test_torch_default_store_listens_everywhere_which_is_why_the_agent_binds_it():
    import torch.distributed as dist

    before = {c.laddr for c in _own_listeners()}
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True, wait_for_workers=False)
    new = [c for c in _own_listeners() if c.laddr not in before]
    assert new and all(not ipaddress.ip_address(c.laddr.ip).is_loopback for c in new), new
    del server


def test_patched_rendezvous_stores_use_the_bound_factory(monkeypatch):
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, dynamic_rendezvous

    monkeypatch.setattr(c10d_rendezvous_backend, "TCPStore", c10d_rendezvous_backend.TCPStore)
    monkeypatch.setattr(dynamic_rendezvous.DynamicRendezvousHandler, "_create_tcp_store_server",
                        dynamic_rendezvous.DynamicRendezvousHandler._create_tcp_store_server)
    patch_torch_stores("loopback")
    before = {c.laddr for c in _own_listeners()}
    shared = dynamic_rendezvous.DynamicRendezvousHandler._create_tcp_store_server(None, "127.0.0.1", 0)
    new = [c for c in _own_listeners() if c.laddr not in before]
    assert [c.laddr.ip for c in new] == ["127.0.0.1"] and new[0].laddr.port == shared.port, new
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    port = _free_port()
    params = RendezvousParameters("c10d", f"127.0.0.1:{port}", "r", 1, 1, is_host="true")
    rendezvous = c10d_rendezvous_backend._create_tcp_store(params)
    assert rendezvous.port == port
    assert [c.laddr.ip for c in _own_listeners() if c.laddr.port == port] == ["127.0.0.1"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_local_torchrun_command_binds_loopback_and_dies_with_this_process():
    cmd = torchrun_command(2, "127.0.0.1:29500", ["--db", "x.db"], rdzv_id="r")
    assert cmd[1:7] == ["-m", "ddlscope.launch.agent", "--parent-pid", str(os.getpid()), "--bind", "loopback"]
    assert "--local-addr=127.0.0.1" in cmd and "--rdzv-endpoint=127.0.0.1:29500" in cmd
    cluster = torchrun_command(2, "10.1.2.3:29500", ["--db", "x.db"], nnodes=2, rdzv_id="r")
    assert cluster[5:7] == ["--bind", "reached"] and not any(a.startswith("--local-addr") for a in cluster)
    nodes_here = torchrun_command(1, "localhost:29500", ["--db", "x.db"], nnodes=2, rdzv_id="r")
    assert nodes_here[5:7] == ["--bind", "loopback"], "a loopback endpoint: every node is on this machine"


def test_an_agent_whose_launcher_is_gone_does_not_start():
    result = subprocess.run([sys.executable, "-m", "ddlscope.launch.agent", "--parent-pid", "1", "--bind", "loopback",
                             "--nproc-per-node=1", "-m", "ddlscope.train.worker"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode != 0 and "is gone" in result.stderr


def test_reached_binding_never_picks_loopback_or_foreign_addresses():
    assert local_address_for("127.0.0.1") is None
    assert local_address_for("192.0.2.254") is None or "192.0.2.254" in {
        a.address for addrs in psutil.net_if_addrs().values() for a in addrs}
    assert is_loopback("localhost") and is_loopback("127.0.0.1") and not is_loopback("0.0.0.0")


def test_p2p_discovery_is_off_unless_asked():
    assert p2p_options() == dict(nat_port_map=False, auto_nat=False, use_relay=False, use_auto_relay=False)
    assert p2p_options(nat_traversal=True)["nat_port_map"] is True


@pytest.mark.parametrize("table", ["collaborative", "dmoe"])
def test_nat_traversal_needs_a_reachable_listen_host(table):
    strategy = dict(collaborative="collaborative", dmoe="dmoe")[table]
    with pytest.raises(Exception, match="nat_traversal = true needs a listen_host"):
        validate_config(tiny_run(strategy=strategy, peers=2, **{table: dict(nat_traversal=True)}))
    cfg = validate_config(tiny_run(strategy=strategy, peers=2, **{table: dict(nat_traversal=True, listen_host="0.0.0.0")}))
    assert getattr(cfg, table).nat_traversal


# ---------------------------------------------------------------------- real runs
RUNS = {
    "ddp": dict(strategy="ddp", peers=2, vcpus_per_peer=1, sample_budget=2 * 16 * 150, final_eval=False),
    "collaborative": dict(strategy="collaborative", peers=2, vcpus_per_peer=1, sample_budget=2 * 2400, final_eval=False,
                          collaborative=dict(target_batch_size=2400, matchmaking_time_s=1.0, averaging_timeout_s=20.0,
                                             join_timeout_s=30.0)),
}


def _run_args(values: dict) -> list[str]:
    """``--set key=value`` arguments of ``ddlscope run`` (tables as dotted keys), values as TOML/JSON."""
    import json

    flat = {f"{k}.{kk}": vv for k, v in values.items() if isinstance(v, dict) for kk, vv in v.items()}
    flat.update({k: v for k, v in values.items() if not isinstance(v, dict)})
    return [a for k, v in flat.items() for a in ("--set", f"{k}={json.dumps(v)}")]


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


@slow
@pytest.mark.parametrize("strategy", sorted(RUNS))
def test_every_socket_of_a_local_run_is_on_loopback(strategy, env_data, db_path):
    values = tiny_run(dataset="digits", batch_size=16, **RUNS[strategy])
    proc = subprocess.Popen([sys.executable, "-m", "ddlscope", "run", "--no-progress", "--db", str(db_path),
                             *_run_args(values)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: dict[tuple, str] = {}  # (kind, ip, port) -> process name
    try:
        while proc.poll() is None:
            for p in _tree(proc.pid):
                try:
                    for c in p.net_connections("inet"):
                        # a UDP socket connected to a peer (a DNS query's) receives from that peer only: not a listener
                        if c.status == psutil.CONN_LISTEN or (c.type == socket.SOCK_DGRAM and not c.raddr):
                            seen[(c.type.name, c.laddr.ip, c.laddr.port)] = " ".join(p.cmdline()[:4])
                except psutil.Error:
                    continue
            time.sleep(0.1)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            for p in reversed(_tree(proc.pid)):
                p.kill()
            proc.wait(30)
    assert proc.returncode == 0, err[-2000:]
    with ResultsStore(db_path) as store:
        assert store.runs()[0]["status"] == "completed"
    # the run's listeners were seen: the agent's stores (ddp) or the p2p daemons (collaborative)
    owner = "ddlscope.launch.agent" if strategy == "ddp" else "p2pd"
    assert any(owner in who for who in seen.values()), seen
    exposed = {k: who for k, who in seen.items() if not ipaddress.ip_address(k[1]).is_loopback}
    assert not exposed, f"listening beyond loopback: {exposed}"


@slow
def test_sigkill_of_the_launcher_ends_the_torchrun_agent_and_its_workers(env_data, db_path):
    values = tiny_run(dataset="digits", batch_size=16, strategy="ddp", peers=2, vcpus_per_peer=1,
                      sample_budget=2 * 16 * 1_000_000, final_eval=False)
    proc = subprocess.Popen([sys.executable, "-m", "ddlscope", "run", "--no-progress", "--db", str(db_path),
                             *_run_args(values)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def left() -> list[psutil.Process]:
        return [p for p in psutil.process_iter(["cmdline", "status"]) if p.info["status"] != psutil.STATUS_ZOMBIE
                and str(db_path) in " ".join(p.info["cmdline"] or [])]

    try:
        deadline, steps = time.monotonic() + 120, 0
        while time.monotonic() < deadline and not steps and proc.poll() is None:
            time.sleep(0.3)
            if db_path.exists():
                with ResultsStore(db_path) as store:
                    runs = store.runs()
                    steps = sum(store.step_counts(runs[0]["run_id"]).values()) if runs else 0
        assert steps, proc.stderr.read() if proc.poll() is not None else "no step stored in 120 s"
        assert any("ddlscope.launch.agent" in " ".join(p.info["cmdline"]) for p in left())
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 10
        while left() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not left(), [" ".join(p.info["cmdline"][:6]) for p in left()]
    finally:
        for p in left():
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
