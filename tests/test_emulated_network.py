"""Emulated networks: config, namespaces and rate limits built and removed, nothing left after the owner dies."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from pydantic import ValidationError

from ddlscope.config import validate_config
from ddlscope.errors import UserError
from ddlscope.network.emulated import EmulatedNetwork, NetworkConfig, namespaces, netem_available, remove_stale
from tests.conftest import can_emulate, tiny_run

needs_root = pytest.mark.skipif(not can_emulate, reason="needs root and iproute2 (network namespaces)")


def test_rates_default_and_per_peer_overrides():
    cfg = NetworkConfig(emulate=True, bandwidth_mbit_per_s=100, links=[
        {"peer": 1, "bandwidth_mbit_per_s": 10}, {"peer": 2, "upload_mbit_per_s": 5}])
    assert cfg.rates(4) == [(100, 100), (10, 10), (5, 100), (100, 100)]
    assert NetworkConfig(emulate=True).rates(2) == [(None, None), (None, None)]


@pytest.mark.parametrize("values, words", [
    ({"emulate": True, "bandwidth_mbit_per_s": 0}, "greater than 0"),
    ({"emulate": True, "bandwidth_mbit_per_s": -3}, "greater than 0"),
    ({"bandwidth_mbit_per_s": 10}, "need network.emulate = true"),
    ({"emulate": True, "links": [{"peer": 0, "upload_mbit_per_s": 1}, {"peer": 0, "download_mbit_per_s": 1}]},
     "names a peer or server twice"),
    ({"emulate": True, "links": [{"server": 1, "upload_mbit_per_s": 1}, {"server": 1, "download_mbit_per_s": 1}]},
     "names a peer or server twice"),
    ({"emulate": True, "links": [{"peer": 0, "server": 0, "upload_mbit_per_s": 1}]}, "exactly one of peer and server"),
    ({"emulate": True, "links": [{"upload_mbit_per_s": 1}]}, "exactly one of peer and server"),
    ({"emulate": True, "links": [{"peer": 0, "speed": 1}]}, "speed"),
])
def test_bad_network_config_names_the_problem(values, words):
    with pytest.raises(ValidationError, match=words):
        NetworkConfig(**values)


def test_a_link_for_a_peer_that_does_not_exist_is_refused():
    with pytest.raises(UserError, match=r"peer 3 does not exist; allowed: 0\.\.1"):
        NetworkConfig(emulate=True, links=[{"peer": 3, "bandwidth_mbit_per_s": 1}]).rates(2)


def _ours(tag: str) -> tuple[list[str], list[str]]:
    links = subprocess.run(["ip", "-j", "link", "show"], capture_output=True, text=True).stdout
    return ([n for n in namespaces() if n.startswith(f"ddl-{tag}-")],
            [d["ifname"] for d in json.loads(links) if d["ifname"].startswith(f"ddl{tag}-")])


def _tbf(namespace: str | None, dev: str) -> list[dict]:
    """The options of every tbf qdisc on ``dev`` (in ``namespace``; None: this one), as ``tc -j`` gives them."""
    prefix = ["ip", "netns", "exec", namespace] if namespace else []
    shown = subprocess.run([*prefix, "tc", "-j", "qdisc", "show", "dev", dev], capture_output=True, text=True).stdout
    return [q["options"] for q in json.loads(shown) if q["kind"] == "tbf"]


@needs_root
def test_peers_talk_only_through_their_rate_limited_links_and_everything_is_removed():
    net = EmulatedNetwork([(20.0, None), (None, 50.0)]).create()
    try:
        ns0 = net.namespace(0)
        # the limits sit where the text says: peer 0's upload on its eth0, peer 1's download on the bridge's end
        up0, down1 = _tbf(ns0, "eth0"), _tbf(None, net.host_veth(1))
        assert [q["rate"] for q in up0] == [20_000_000 // 8]
        assert [q["rate"] for q in down1] == [50_000_000 // 8]
        # an idle link lets its bucket through at once: 10 ms at its rate by default
        assert [q["burst"] for q in up0] == [20_000_000 // 8 // 100]
        assert [q["burst"] for q in down1] == [50_000_000 // 8 // 100]
        # 2 MiB from peer 0 to peer 1 over the namespaces' addresses
        server = subprocess.Popen(net.wrap(1, [sys.executable, "-c", (
            "import socket; s = socket.socket(); s.bind(('10.201.0.3', 5555)); s.listen(); c, _ = s.accept(); n = 0\n"
            "while (d := c.recv(65536)): n += len(d)\nprint(n)")]), stdout=subprocess.PIPE, text=True)
        time.sleep(0.5)
        subprocess.run(net.wrap(0, [sys.executable, "-c", (
            "import socket; s = socket.create_connection(('10.201.0.3', 5555)); s.sendall(b'x' * (2 << 20)); s.close()")]),
            check=True, timeout=30)
        assert int(server.communicate(timeout=30)[0]) == 2 << 20
        c0, c1 = net.counters()
        assert c0["bytes_sent"] >= 2 << 20 and c1["bytes_received"] >= 2 << 20
        assert c0["drops_upload"] is not None and c0["drops_download"] is None
        # loopback of the machine is not reachable from a namespace: no route out
        out = subprocess.run(net.wrap(0, [sys.executable, "-c", (
            "import socket\ntry:\n socket.create_connection(('10.0.0.1', 9), timeout=1)\nexcept OSError as e: print(e.errno)")]),
            capture_output=True, text=True)
        assert out.stdout.strip() == "101"  # ENETUNREACH
    finally:
        net.remove()
    assert _ours(net.tag) == ([], [])
    assert net.reaper.poll() is not None


@needs_root
def test_a_runs_bucket_sets_what_an_idle_link_lets_through_at_once():
    from ddlscope.config import RunConfig

    cfg = RunConfig.model_validate(dict(name="b", strategy="ddp", model="tiny_cnn", dataset="mnist", peers=2,
                                        network=dict(emulate=True, bandwidth_mbit_per_s=50.0, bucket_ms=1.0)))
    net = EmulatedNetwork.for_run(cfg, 2).create()
    try:
        assert [q["burst"] for q in _tbf(net.namespace(0), "eth0")] == [50_000_000 // 8 // 1000]  # 1 ms
    finally:
        net.remove()
    small = EmulatedNetwork([(5.0, None)], bucket_ms=1.0).create()  # 1 ms at 5 Mbit/s is 625 B: a packet must fit
    try:
        assert [q["burst"] for q in _tbf(small.namespace(0), "eth0")][0] >= 2047  # at least 2 KiB (tc rounds)
    finally:
        small.remove()
    with pytest.raises(ValidationError, match="bucket_ms"):
        RunConfig.model_validate(dict(name="b", strategy="ddp", model="tiny_cnn", dataset="mnist", peers=2,
                                      network=dict(emulate=True, bandwidth_mbit_per_s=50.0, bucket_ms=0)))


@needs_root
def test_a_killed_owner_leaves_no_namespace_link_or_process_behind():
    owner = subprocess.Popen([sys.executable, "-c", (
        "import time\nfrom ddlscope.network.emulated import EmulatedNetwork\n"
        "net = EmulatedNetwork([(10.0, 10.0)] * 3).create()\n"
        "import subprocess, sys\n"
        "subprocess.Popen(net.wrap(1, [sys.executable, '-c', 'import time; time.sleep(60)']))\n"
        "print('ready', flush=True)\ntime.sleep(60)")], stdout=subprocess.PIPE, text=True)
    tag = f"{owner.pid:x}"
    try:
        assert owner.stdout.readline().strip() == "ready"
        assert len(_ours(tag)[0]) == 3
        sleeper = [int(p) for p in subprocess.run(["ip", "netns", "pids", f"ddl-{tag}-1"], capture_output=True,
                                                  text=True).stdout.split()]
        assert len(sleeper) == 1
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        deadline = time.monotonic() + 10
        while _ours(tag) != ([], []) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _ours(tag) == ([], [])
        time.sleep(0.2)
        assert not os.path.exists(f"/proc/{sleeper[0]}") or open(f"/proc/{sleeper[0]}/stat").read().split()[2] == "Z"
    finally:
        owner.kill()
        owner.wait()


@needs_root
def test_removing_a_network_lets_torchs_shm_manager_end_by_itself_and_kills_one_that_does_not(tmp_path, monkeypatch):
    """torch's shm manager unlinks its clients' segments in /dev/shm once they are gone: removing a network
    kills the rest first and gives it time (SIGKILLed with them it left 317 segments from one collaborative
    run); one that does not end is killed after SHM_MANAGER_WAIT_S. Stand-ins: a shell named like the manager
    (the kernel names a process after its file) that waits for its client, then removes a file."""
    import shutil

    from ddlscope.launch.processes import is_shm_manager
    from ddlscope.network import emulated

    manager = tmp_path / "torch_shm_manager"
    shutil.copy(shutil.which("sh"), manager)
    segment = tmp_path / "torch_segment"
    segment.touch()
    monkeypatch.setattr(emulated, "SHM_MANAGER_WAIT_S", 2.0)
    net = EmulatedNetwork([(10.0, 10.0)] * 2).create()
    try:
        pids = lambda peer: [int(p) for p in subprocess.run(["ip", "netns", "pids", net.namespace(peer)],  # noqa: E731
                                                            capture_output=True, text=True).stdout.split()]
        subprocess.run(net.wrap(0, ["setsid", "-f", "sleep", "60"]), check=True)  # the client, reaped by init
        (client,) = pids(0)
        # a killed client is gone for the real manager at once (its socket closes), while init may reap it seconds
        # later (this machine's init: 1-2 s, when the wait was 2 s); so a zombie counts as gone, as kill -0 would not
        gone = f"[ ! -e /proc/{client} ] || grep -q '^State:[[:space:]]*Z' /proc/{client}/status 2>/dev/null"
        subprocess.run(net.wrap(0, ["setsid", "-f", str(manager), "-c",
                                    f"until {gone}; do sleep 0.05; done; rm {segment}"]),
                       check=True)
        subprocess.run(net.wrap(1, ["setsid", "-f", str(manager), "-c", "while true; do sleep 0.05; done"]), check=True)
        time.sleep(0.3)
        stubborn = [p for p in pids(1) if is_shm_manager(p)]
        assert len(stubborn) == 1 and len([p for p in pids(0) if is_shm_manager(p)]) == 1
        t0 = time.monotonic()
        net.remove()
        took_s = time.monotonic() - t0
    finally:
        net.remove()
    assert not segment.exists()  # the manager outlived its client and unlinked the segment
    assert 2.0 <= took_s < 10  # the stubborn one was waited for, then killed
    time.sleep(0.2)
    assert not is_shm_manager(stubborn[0])
    assert _ours(net.tag) == ([], [])


@needs_root
def test_remove_stale_removes_networks_whose_owner_is_gone_and_nothing_else():
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    stale = EmulatedNetwork([(5.0, None)], owner_pid=owner.pid).create()
    stale.reaper.kill()  # an owner killed together with its reaper (e.g. kill -9 of both) leaves its network
    stale.reaper.wait()
    owner.kill()
    owner.wait()
    live = EmulatedNetwork([(None, None)]).create()
    try:
        assert _ours(stale.tag)[0] == [stale.namespace(0)]
        assert stale.tag in remove_stale()
        assert _ours(stale.tag) == ([], []) and _ours(live.tag)[0] == [live.namespace(0)]
    finally:
        live.remove()
        stale.remove()


@needs_root
@pytest.mark.skipif(can_emulate and netem_available(), reason="this kernel has netem")
def test_latency_without_netem_is_one_clear_error():
    from ddlscope.network.emulated import check_can_emulate

    with pytest.raises(UserError, match="needs the kernel's tc netem"):
        check_can_emulate(latency=True)


def test_a_missing_peer_or_server_or_servers_out_of_reach_are_refused_before_anything_starts(tmp_path):
    with pytest.raises(UserError, match="not built yet for single; allowed: collaborative, dmoe, ddp"):
        validate_config(tiny_run(strategy="single", peers=1, network=dict(emulate=True)))
    with pytest.raises(UserError, match="peer 5 does not exist"):
        validate_config(tiny_run(strategy="collaborative", peers=2,
                                 network=dict(emulate=True, links=[dict(peer=5, bandwidth_mbit_per_s=1)])))
    with pytest.raises(UserError, match=r"server 2 does not exist; allowed: 0\.\.1 \(2 expert servers\)"):
        validate_config(tiny_run(strategy="dmoe", model="moe_cnn", peers=1,
                                 network=dict(emulate=True, links=[dict(server=2, bandwidth_mbit_per_s=1)])))
    with pytest.raises(UserError, match="server 0 does not exist; allowed: none: this run starts no servers"):
        validate_config(tiny_run(strategy="dmoe", model="moe_cnn", peers=1, dmoe=dict(placement="local"),
                                 network=dict(emulate=True, links=[dict(server=0, bandwidth_mbit_per_s=1)])))
    with pytest.raises(UserError, match="the trainers could not reach those servers"):
        validate_config(tiny_run(strategy="dmoe", model="moe_cnn", peers=1, network=dict(emulate=True),
                                 dmoe=dict(initial_peers=["/ip4/10.0.0.1/tcp/5000/p2p/QmX"])))
    assert not list(tmp_path.iterdir())


def test_expert_servers_get_namespaces_after_the_peers_with_their_own_links():
    from ddlscope.network.emulated import run_rates

    cfg = validate_config(tiny_run(strategy="dmoe", model="moe_cnn", peers=2, dmoe=dict(servers=3), network=dict(
        emulate=True, bandwidth_mbit_per_s=50, links=[dict(server=1, upload_mbit_per_s=5), dict(peer=1, bandwidth_mbit_per_s=10)])))
    assert run_rates(cfg) == [(50, 50), (10, 10), (50, 50), (5, 50), (50, 50)]


@needs_root
def test_a_pair_of_links_carries_less_each_way_when_both_ways_are_busy():
    from ddlscope.network.duplex import measure_duplex_goodput

    before = set(namespaces())
    g = measure_duplex_goodput(20.0, 20.0, seconds=1.0, repeats=1)
    assert g.rates_mbit_per_s == (20.0, 20.0)
    # TCP payload one way is most of the rate; both ways at once, each direction's acknowledgements wait behind
    # the other direction's data in the token bucket's queue
    assert 0.8 < g.one_way <= 1.05 and 0 < g.both_ways < g.one_way
    assert set(namespaces()) == before
    with pytest.raises(ValueError, match="allowed"):
        measure_duplex_goodput(0.0, 20.0)
    with pytest.raises(ValueError, match="repeats = 0; allowed: >= 1"):
        measure_duplex_goodput(20.0, 20.0, repeats=0)


def test_the_averaging_probe_refuses_bad_input_before_building_anything():
    from ddlscope.network.averaging_probe import averaging_round_seconds

    with pytest.raises(ValueError, match="at least 2 peers"):
        averaging_round_seconds([20.0], 1.0, 1)
    with pytest.raises(ValueError, match="Mbit/s > 0"):
        averaging_round_seconds([20.0, 0.0], 1.0, 1)
    with pytest.raises(ValueError, match="rounds >= 1"):
        averaging_round_seconds([20.0, 20.0], 1.0, 0)
    with pytest.raises(ValueError, match="one non-empty list of cores per peer"):
        averaging_round_seconds([20.0, 20.0], 1.0, 1, cores=[[0]])
    from ddlscope.network.averaging_probe import measure_averaging_goodput
    before = set(namespaces())
    with pytest.raises(ValueError, match="swarms = 0; allowed: >= 1"):
        measure_averaging_goodput([20.0, 20.0], swarms=0)
    assert set(namespaces()) == before


def test_the_averaging_share_is_over_the_mean_of_each_swarms_median_round():
    from ddlscope.network.averaging_probe import share_of_rate

    # medians 4.0 and 5.0 s (the 9.0 s round is one swarm's outlier): mean 4.5 s
    assert share_of_rate(3.0, [[3.9, 4.0, 9.0], [5.0, 5.1, 4.8]]) == pytest.approx(3.0 / 4.5)
    # one swarm: its median; a round faster than the configured rate caps the share at 1
    assert share_of_rate(3.0, [[4.0, 6.0]]) == pytest.approx(0.6)
    assert share_of_rate(3.0, [[2.0]]) == 1.0
    for predicted, swarms in ((0.0, [[1.0]]), (3.0, []), (3.0, [[1.0], []]), (3.0, [[1.0, 0.0]])):
        with pytest.raises(ValueError, match="allowed: a predicted round > 0 s and at least one swarm"):
            share_of_rate(predicted, swarms)


@needs_root
@pytest.mark.slow
def test_hivemind_rounds_over_slow_links_carry_a_share_of_the_rate_and_leave_nothing_behind():
    from ddlscope.network.averaging_probe import measure_averaging_goodput

    before = set(namespaces())
    children_tmp = Path(os.environ["TMPDIR"])  # the suite's folder for what it starts (conftest)
    folders = set(children_tmp.glob("pymp-*"))
    core = min(os.sched_getaffinity(0))
    g = measure_averaging_goodput([20.0, 20.0], megabytes=1.0, rounds=1, cores=[[core], [core]], swarms=2)
    # 1 MiB in two halves each way at 20 Mbit/s: ~0.42 s of wire; hivemind's own costs make the round longer
    assert len(g.round_s) == 2 and min(g.round_s) > g.predicted_round_s > 0.3
    assert g.swarm_median_s == g.round_s  # one round per swarm: its median
    assert g.share == pytest.approx(g.predicted_round_s / (sum(g.round_s) / 2))
    assert 0 < g.share < 1 and g.cores == ((core,), (core,))
    assert set(namespaces()) == before
    assert not [p for p in psutil.process_iter(["cmdline"]) if "ddlscope.network.averaging_probe" in
                " ".join(p.info["cmdline"] or [])]
    assert set(children_tmp.glob("pymp-*")) <= folders  # the peers' multiprocessing folders went with the probe's



def test_the_collective_probe_refuses_bad_input_before_building_anything():
    from ddlscope.network.collective_probe import fsdp_collective_step_seconds

    with pytest.raises(ValueError, match="at least 2 workers"):
        fsdp_collective_step_seconds([20.0], [1024])
    with pytest.raises(ValueError, match="Mbit/s > 0"):
        fsdp_collective_step_seconds([20.0, -1.0], [1024])
    with pytest.raises(ValueError, match="at least one unit with bytes > 0"):
        fsdp_collective_step_seconds([20.0, 20.0], [0])
    with pytest.raises(ValueError, match="steps >= 1"):
        fsdp_collective_step_seconds([20.0, 20.0], [1024], steps=0)
    with pytest.raises(ValueError, match="one non-empty list of cores per worker"):
        fsdp_collective_step_seconds([20.0, 20.0], [1024], cores=[[0], []])


@needs_root
@pytest.mark.slow
def test_fsdp_unit_collectives_over_slow_links_carry_a_share_of_the_rate_and_leave_nothing_behind():
    from ddlscope.modeling.cluster import LinkSpec
    from ddlscope.modeling.collectives import gloo_fsdp_step_wire_s
    from ddlscope.network.collective_probe import measure_fsdp_goodput

    before = set(namespaces())
    core = min(os.sched_getaffinity(0))
    units = [4096, 1 << 20]
    g = measure_fsdp_goodput([20.0, 20.0], units, steps=1, cores=[[core], [core]])
    # per unit: 2 all-gathers of half the bytes each way and a reduce-scatter of all of them (gloo) at 20 Mbit/s
    wire = gloo_fsdp_step_wire_s(units, 2, LinkSpec(bandwidth_gb_per_s=20 / 8e3, latency_s=0.0))
    assert g.predicted_step_s == pytest.approx(wire) and wire == pytest.approx(2 * sum(units) / 2.5e6)
    assert len(g.step_s) == 1 and g.step_s[0] > 0.8 * wire
    assert 0.3 < g.share <= 1 and g.unit_bytes == tuple(units) and g.cores == ((core,), (core,))
    assert set(namespaces()) == before
    assert not [p for p in psutil.process_iter(["cmdline"]) if "ddlscope.network.collective_probe" in
                " ".join(p.info["cmdline"] or [])]

GLOO_WORKER = """
import os, sys, torch, torch.distributed as dist
rank, addr, op = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://{addr}:29612", rank=rank, world_size=2)
full, shard = torch.ones(1 << 20), torch.empty(1 << 19)
for _ in range(5):
    {"all_reduce": lambda: dist.all_reduce(full), "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, full),
     "all_gather": lambda: dist.all_gather_into_tensor(full, shard)}[op]()
dist.destroy_process_group()
"""


@needs_root
@pytest.mark.slow
def test_gloo_reduce_scatter_sends_an_all_reduces_bytes(tmp_path):
    """What fsdp's cost model assumes on CPU workers (distribution/fsdp.py): on torch's gloo backend a
    reduce-scatter of a 4 MiB tensor between 2 workers sends the whole tensor from each, as an all-reduce
    does, while an all-gather sends half of it. Counted on the links of an emulated network."""
    script = tmp_path / "gloo_worker.py"
    script.write_text(GLOO_WORKER)
    sent = {}
    for op in ("all_reduce", "reduce_scatter", "all_gather"):
        with EmulatedNetwork([(None, None), (None, None)]) as net:
            before = [c["bytes_sent"] for c in net.counters()]
            procs = [subprocess.Popen(net.wrap(i, [sys.executable, str(script), str(i), net.address(0), op]),
                                      env={**os.environ, "GLOO_SOCKET_IFNAME": net.interface, "OMP_NUM_THREADS": "1"},
                                      stderr=subprocess.DEVNULL)
                     for i in range(2)]
            assert [p.wait(timeout=60) for p in procs] == [0, 0]
            sent[op] = [(c["bytes_sent"] - b) / 5 / (4 << 20) for c, b in zip(net.counters(), before)]
    assert all(0.95 < x < 1.1 for x in sent["all_reduce"] + sent["reduce_scatter"]), sent
    assert all(0.45 < x < 0.6 for x in sent["all_gather"]), sent
