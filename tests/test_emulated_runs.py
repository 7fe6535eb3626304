"""Runs on an emulated network: collaborative peers in namespaces of their own, links rate-limited.

Real processes: a 2-peer hivemind swarm, each peer in its own network namespace, one peer's link
limited; then the launcher SIGKILLed in the middle of such a run. Needs root (skipped otherwise).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from ddlscope.config import validate_config
from ddlscope.launch.local import run_local
from ddlscope.network.emulated import namespaces
from ddlscope.store.db import ResultsStore
from tests.conftest import tiny_run

can_emulate = sys.platform.startswith("linux") and os.geteuid() == 0 and subprocess.run(
    ["ip", "netns", "list"], capture_output=True).returncode == 0
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not can_emulate, reason="needs root and iproute2")]

COLLAB = dict(strategy="collaborative", peers=2, vcpus_per_peer=1,
              collaborative=dict(target_batch_size=1200, matchmaking_time_s=1.0, averaging_timeout_s=20.0,
                                 join_timeout_s=30.0))


def _ddl_links() -> list[str]:
    out = subprocess.run(["ip", "-j", "link", "show"], capture_output=True, text=True).stdout
    return [d["ifname"] for d in json.loads(out) if d["ifname"].startswith("ddl")]


def test_a_collaborative_run_trains_through_limited_links_and_records_what_they_carried(env_data, db_path):
    before = (set(namespaces()), set(_ddl_links()))
    cfg = validate_config(tiny_run(sample_budget=4 * 1200, **COLLAB,
                                   network=dict(emulate=True, bandwidth_mbit_per_s=200,
                                                links=[dict(peer=1, upload_mbit_per_s=20)])))
    run_id = run_local(cfg, db_path, progress=False)
    with ResultsStore(db_path) as store:
        run = store.run(run_id)
        assert run["status"] == "completed", run["reason"]
        # the peers listened on their namespaces' addresses, not loopback
        maddrs = json.loads(next(w for w in store.workers(run_id) if w["worker_index"] == 0)["maddrs"])
        assert maddrs and all("/ip4/10.201.0.2/" in m for m in maddrs), maddrs
        links = {r["worker_index"]: r for r in store.rows("network_links", run_id)}
        assert links[0]["upload_mbit_per_s"] == 200 and links[1]["upload_mbit_per_s"] == 20
        assert links[1]["download_mbit_per_s"] == 200
        # what one peer sent, the other received (the bridge joins nothing else)
        assert links[0]["bytes_sent"] > 100_000 and links[1]["bytes_sent"] > 100_000
        assert abs(links[0]["bytes_sent"] - links[1]["bytes_received"]) < 0.05 * links[0]["bytes_sent"]
        rounds = [s for s in store.rows("steps", run_id) if s["averaging_round"] and s["averaging_succeeded"]]
        assert rounds
    assert (set(namespaces()), set(_ddl_links())) == before


def test_a_killed_launcher_leaves_no_namespace_link_or_process(env_data, tmp_path):
    db = tmp_path / "r.db"
    config = tmp_path / "run.toml"
    config.write_text("""[run]
strategy = "collaborative"
model = "tiny_cnn"
dataset = "mnist"
peers = 2
vcpus_per_peer = 1
batch_size = 16
sample_budget = 1000000
loader_workers = 0
[collaborative]
target_batch_size = 1200
matchmaking_time_s = 1.0
[network]
emulate = true
bandwidth_mbit_per_s = 50
""")
    before = (set(namespaces()), set(_ddl_links()))
    launcher = subprocess.Popen([sys.executable, "-m", "ddlscope", "run", str(config), "--db", str(db), "--no-progress"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        steps = 0
        while time.monotonic() < deadline and steps < 10 and launcher.poll() is None:
            time.sleep(0.5)
            if db.exists():
                with ResultsStore(db) as store:
                    runs = store.runs()
                    steps = sum(store.step_counts(runs[0]["run_id"]).values()) if runs else 0
        assert steps >= 10, launcher.stderr.read() if launcher.poll() is not None else "no progress"
        assert len(set(namespaces()) - before[0]) == 2
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 20
        left = None
        while time.monotonic() < deadline:
            procs = [p.pid for p in psutil.process_iter(["cmdline"]) if str(db) in " ".join(p.info["cmdline"] or [])]
            left = (set(namespaces()) - before[0], set(_ddl_links()) - before[1], procs)
            if left == (set(), set(), []):
                break
            time.sleep(0.2)
        assert left == (set(), set(), []), left
    finally:
        launcher.kill()
        launcher.wait()


def test_two_hosts_as_namespaces_train_one_swarm_through_the_commands_a_user_types(env_data, tmp_path):
    """Host A starts the run with one local peer listening on its address; host B joins with
    `ddlscope peer`, the command host A printed, over the emulated link (not loopback). Peer 0 does
    not wait for peer 1 (hivemind peers join whenever they come): 1500 steps each (~15-30 s) leave
    peer 1's start-up (~5 s) well inside peer 0's training."""
    from ddlscope.network.emulated import EmulatedNetwork

    config = tmp_path / "run.toml"
    config.write_text("""[run]
strategy = "collaborative"
model = "tiny_cnn"
dataset = "mnist"
peers = 2
batch_size = 16
sample_budget = 48000
loader_workers = 0
[collaborative]
target_batch_size = 2400
matchmaking_time_s = 1.0
averaging_timeout_s = 20.0
listen_host = "10.201.0.2"
""")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with EmulatedNetwork([(100.0, 100.0), (100.0, 100.0)]) as net:
        host_a = subprocess.Popen(net.wrap(0, [sys.executable, "-m", "ddlscope", "run", str(config), "--local-peers", "1",
                                               "--db", str(tmp_path / "a" / "r.db"), "--no-progress"]),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path / "a")
        join = None
        for line in host_a.stderr:
            if line.strip().startswith("ddlscope peer"):
                join = line.split()
                break
        assert join, "host A printed no join command"
        # "ddlscope peer --run-id R ... --initial-peers M --config <the same run config>": B has that config too
        args = join[1:join.index("--config")] + ["--config", str(config)]
        host_b = subprocess.run(net.wrap(1, [sys.executable, "-m", "ddlscope", *args, "--listen", "/ip4/10.201.0.3/tcp/0",
                                             "--db", str(tmp_path / "b" / "r.db")]),
                                capture_output=True, text=True, timeout=300, cwd=tmp_path / "b")
        assert host_b.returncode == 0, host_b.stderr[-2000:]
        assert host_a.wait(timeout=120) == 0, host_a.stderr.read()[-2000:]
        counters = net.counters()
    with ResultsStore(tmp_path / "a" / "r.db") as a, ResultsStore(tmp_path / "b" / "r.db") as b:
        run_id = a.runs()[0]["run_id"]
        assert a.run(run_id)["status"] == "completed"
        assert set(a.step_counts(run_id)) == {0} and set(b.step_counts(run_id)) == {1}
        full = [s for s in a.rows("steps", run_id) + b.rows("steps", run_id)
                if s["averaging_round"] and s["averaging_group_size"] == 2 and s["averaging_succeeded"]]
        rounds = [(s["worker_index"], s["step"], s["averaging_group_size"], s["averaging_succeeded"])
                  for s in a.rows("steps", run_id) + b.rows("steps", run_id) if s["averaging_round"]]
        assert full, f"no averaging round gathered both hosts: {rounds}"
    # the hosts talked over the emulated link
    assert counters[0]["bytes_sent"] > 50_000 and counters[1]["bytes_sent"] > 50_000


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_torchrun_models_run_one_agent_per_worker_in_its_namespace(env_data, db_path, strategy):
    before = (set(namespaces()), set(_ddl_links()))
    cfg = validate_config(tiny_run(strategy=strategy, peers=2, vcpus_per_peer=1, sample_budget=2 * 16 * 30,
                                   network=dict(emulate=True, bandwidth_mbit_per_s=100)))
    run_id = run_local(cfg, db_path, progress=False)
    with ResultsStore(db_path) as store:
        run = store.run(run_id)
        assert run["status"] == "completed", run["reason"]
        assert sorted(w["cores"] for w in store.workers(run_id)) == ["0", "1"]  # each agent pinned its own worker
        links = {r["worker_index"]: r for r in store.rows("network_links", run_id)}
        # the gradients crossed the emulated links: 30 all-reduces of the tiny CNN's gradients each way
        assert links[0]["bytes_sent"] > 100_000 and links[1]["bytes_sent"] > 100_000, links
    assert (set(namespaces()), set(_ddl_links())) == before
