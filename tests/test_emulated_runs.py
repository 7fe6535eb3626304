"""Runs on an emulated network: collaborative peers in namespaces of their own, links rate-limited.

Real processes: a 2-peer hivemind swarm, each peer in its own network namespace, one peer's link
limited; then the launcher SIGKILLed in the middle of such a run (and of a dmoe run); a dmoe run
whose trainer and expert servers each have a namespace, one server killed and restarted. Needs
root (skipped otherwise).
"""

from __future__ import annotations

import json
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
from tests.conftest import can_emulate, tiny_run
from tests.test_integration import assert_no_new_shm_segments, shm_segments

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not can_emulate, reason="needs root and iproute2")]

COLLAB = dict(strategy="collaborative", peers=2, vcpus_per_peer=1,
              collaborative=dict(target_batch_size=1200, matchmaking_time_s=1.0, averaging_timeout_s=20.0,
                                 join_timeout_s=30.0))


def _ddl_links() -> list[str]:
    out = subprocess.run(["ip", "-j", "link", "show"], capture_output=True, text=True).stdout
    return [d["ifname"] for d in json.loads(out) if d["ifname"].startswith("ddl")]


def test_a_collaborative_run_trains_through_limited_links_and_records_what_they_carried(env_data, db_path):
    before, segments = (set(namespaces()), set(_ddl_links())), shm_segments()
    # the peers tell hivemind's load balancing their links ("network": the smaller of upload and download)
    collab = {**COLLAB, "collaborative": {**COLLAB["collaborative"], "declared_bandwidths_mbit_per_s": "network"}}
    cfg = validate_config(tiny_run(sample_budget=4 * 1200, **collab,
                                   network=dict(emulate=True, bandwidth_mbit_per_s=200,
                                                links=[dict(peer=1, upload_mbit_per_s=20)])))
    run_id = run_local(cfg, db_path, progress=False)
    with ResultsStore(db_path) as store:
        run = store.run(run_id)
        assert run["status"] == "completed", run["reason"]
        details = {e["worker_index"]: json.loads(e["detail_json"]) for e in store.rows("events", run_id)
                   if e["kind"] == "strategy_details"}
        assert {i: d["declared_bandwidth_mbit_per_s"] for i, d in details.items()} == {0: 200.0, 1: 20.0}
        assert {i: set(d["averager_bandwidths"]) for i, d in details.items()} == {0: {200.0}, 1: {20.0}}
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
    # removing the namespaces lets torch's shm manager unlink the peers' segments (killed with the
    # namespaces' other processes, it left them all behind: 317 from one run of the links grid)
    assert_no_new_shm_segments(segments, timeout_s=1.0)


KILLED_COLLABORATIVE = """[run]
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
"""

DMOE = """[run]
strategy = "dmoe"
model = "moe_cnn"
dataset = "digits"
peers = 1
batch_size = 16
sample_budget = {budget}
{run_extra}
eval_every_steps = {eval_every}
loader_workers = 0
[dmoe]
update_period_s = 2.0
{events}
[network]
emulate = true
bandwidth_mbit_per_s = 50
links = [{{ server = 1, upload_mbit_per_s = 20 }}]
"""
"""1 dmoe trainer and 2 expert servers, each in a namespace of its own; server 1 uploads at 20 Mbit/s."""


def _left_behind(db, launcher_pid: int) -> tuple[set[str], set[str], list[int]]:
    """The namespaces and links of the network the launcher ``launcher_pid`` owns (its tag is the pid in
    hex; other runs on the machine may have networks of their own), and processes of the run (they
    carry the store's path)."""
    tag = f"{launcher_pid:x}"
    procs = [p.pid for p in psutil.process_iter(["cmdline"]) if str(db) in " ".join(p.info["cmdline"] or [])]
    return ({n for n in namespaces() if n.startswith(f"ddl-{tag}-")},
            {d for d in _ddl_links() if d.startswith(f"ddl{tag}-")}, procs)


@pytest.mark.parametrize("config_text, steps_first, namespaces_made", [
    (KILLED_COLLABORATIVE, 10, 2),
    # the trainer's and both expert servers' namespaces
    (DMOE.format(budget=1_000_000, run_extra="", eval_every=20, events=""), 5, 3),
], ids=["collaborative", "dmoe"])
def test_a_killed_launcher_leaves_no_namespace_link_or_process(env_data, tmp_path, config_text, steps_first,
                                                              namespaces_made):
    db = tmp_path / "r.db"
    config = tmp_path / "run.toml"
    config.write_text(config_text)
    launcher = subprocess.Popen([sys.executable, "-m", "ddlscope", "run", str(config), "--db", str(db), "--no-progress"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        steps = 0
        while time.monotonic() < deadline and steps < steps_first and launcher.poll() is None:
            time.sleep(0.5)
            if db.exists():
                with ResultsStore(db) as store:
                    runs = store.runs()
                    steps = sum(store.step_counts(runs[0]["run_id"]).values()) if runs else 0
        assert steps >= steps_first, launcher.stderr.read() if launcher.poll() is not None else "no progress"
        assert len(_left_behind(db, launcher.pid)[0]) == namespaces_made
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 20
        left = None
        while time.monotonic() < deadline:
            left = _left_behind(db, launcher.pid)
            if left == (set(), set(), []):
                break
            time.sleep(0.2)
        assert left == (set(), set(), []), left
    finally:
        launcher.kill()
        launcher.wait()


def test_a_dmoe_run_reaches_its_servers_through_their_namespaces_and_survives_a_restart(tmp_path):
    """Run as a user runs it, in a process of its own: started from this test process after the rest of the
    suite, hivemind's server start hung at its connection handler (twice in CI; cause not found, see
    docs/validation.md). About 60 s on 2 cores. The suite's one dmoe run with a server killed and restarted."""
    db, config = tmp_path / "r.db", tmp_path / "run.toml"
    # the trainer trains for 30 s (a time limit: its 100 steps took 28 s on a slow day and 13 s on a fast one, when
    # the restarted server came up 1 s before they ended); server 1 is killed 6 s after the first step and back at
    # 9 s (the launcher sees the first step in the store ~3 s late), in time to serve (it starts in 3-10 s on a busy
    # machine) before training ends (in CI, with the kill 10 s after the launch, the trainer's start-up once
    # outlasted the restart and once the server's first start)
    # no evaluation while training (only the final one, after the restart): its expert calls are not training
    # steps' calls, and a kill during an evaluation left no failed call in moe_calls (CI, the loopback version of
    # this run, evaluating every 10 steps; and CI 2026-12-05, every 100: on this machine step 100 came 10.5 s after
    # the first, the kill landed at 7.5-8.8 s and the killed server's records expired 3 s later)
    config.write_text(DMOE.format(budget=1_000_000, run_extra="time_limit_s = 30", eval_every=100_000,
                                  events="server_events = [{ server = 1, kill_at_s = 6.0, restart_at_s = 9.0 }]"))
    launcher = subprocess.Popen([sys.executable, "-m", "ddlscope.cli", "run", str(config), "--db", str(db),
                                 "--no-progress"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    stderr = launcher.communicate(timeout=300)[1]
    assert launcher.returncode == 0, stderr[-2000:]
    with ResultsStore(db) as store:
        run_id = store.runs()[0]["run_id"]
        assert store.run(run_id)["status"] == "completed", store.run(run_id)["reason"]
        assert list(store.step_counts(run_id)) == [0] and store.step_counts(run_id)[0] >= 30
        services = {(s["service_index"], s["generation"]): s for s in store.services(run_id)}
        # each server listened on its own namespace's address (after the trainer's 10.201.0.2), every
        # generation of server 1 in the same namespace; the first may be killed before it listens on any (a
        # slow start under load: CI, 2026-11-28), the restarted one listens
        addresses = {k: {m.split("/")[2] for m in json.loads(s["maddrs"] or "[]")} for k, s in services.items()}
        # server 0 is started again only where a start hung (hivemind's server hang, docs/validation.md "Noticed":
        # CI, 2026-11-29, its first start); every generation that listened did so in its namespace, the last one did
        server0 = sorted(g for i, g in services if i == 0)
        for g in server0[:-1]:
            assert services[(0, g)]["status"] == "failed" and "did not start listening" in services[(0, g)]["reason"], \
                dict(services[(0, g)])
        assert all(addresses[(0, g)] <= {"10.201.0.3"} for g in server0), addresses
        assert addresses[(0, server0[-1])] == {"10.201.0.3"} and addresses[(1, 1)] == {"10.201.0.4"}, addresses
        assert addresses[(1, 0)] <= {"10.201.0.4"}, addresses
        status = {k: (s["status"], s["reason"]) for k, s in services.items()}
        assert services[(1, 0)]["status"] == "killed" and services[(1, 1)]["status"] == "stopped", status
        assert "SIGKILL" in services[(1, 0)]["reason"], status
        # calls to the killed server failed; the restarted one, a new peer found through the DHT, answered. The
        # killed one's peer id is stored once its DHT is up, before it is ready: its start once hung at hivemind's
        # connection handler after it had declared its experts, got 3,348 failed calls and was killed unready (stop 67)
        calls = store.rows("moe_calls", run_id)
        killed, restarted = services[(1, 0)]["peer_id"], services[(1, 1)]["peer_id"]
        assert killed != restarted
        assert sum(c["failed"] for c in calls if c["peer_id"] == killed) > 0
        assert sum(c["calls"] - c["failed"] for c in calls if c["peer_id"] == restarted) > 0
        # every step called experts, or its beam search found none and it stored all its samples as dropped (on a
        # 2-core EPYC in CI one step of 99, 10 s after the kill, found no expert while the restart joined)
        moe_steps = store.rows("moe_steps", run_id)
        assert len(moe_steps) == store.step_counts(run_id)[0]
        assert all(m["forward_calls"] > 0 or (m["experts_chosen"] == 0 and m["samples_dropped"] == m["samples"])
                   for m in moe_steps), [m for m in moe_steps if m["forward_calls"] == 0]
        assert sum(m["forward_calls"] > 0 for m in moe_steps) >= 0.9 * len(moe_steps)
        assert store.rows("moe_server_batches", run_id) and store.rows("moe_server_samples", run_id)
        kinds = [e["kind"] for e in store.rows("events", run_id)]
        assert kinds.count("service_started") == len(services) and kinds.count("service_killed") == 1, kinds
        links = {r["worker_index"]: r for r in store.rows("network_links", run_id)}
        assert [links[i]["namespace"][-2:] for i in range(3)] == ["-0", "-1", "-2"]
        assert [(links[i]["upload_mbit_per_s"], links[i]["download_mbit_per_s"]) for i in range(3)] == \
            [(50, 50), (50, 50), (20, 50)]
        # the trainer's inputs crossed to the servers and their outputs came back, over the links: all the
        # trainer sent, the servers received (with what the servers sent each other: the DHT)
        trainer, servers = links[0], [links[1], links[2]]
        assert trainer["bytes_sent"] > 1_000_000 and all(s["bytes_sent"] > 100_000 for s in servers), links
        assert sum(s["bytes_received"] for s in servers) >= 0.98 * trainer["bytes_sent"], links
    assert _left_behind(db, launcher.pid) == (set(), set(), [])


def test_two_hosts_as_namespaces_train_one_swarm_through_the_commands_a_user_types(env_data, tmp_path):
    """Host A starts the run with one local peer listening on its address; host B joins with
    `ddlscope peer`, the command host A printed, over the emulated link (not loopback). Peer 0 waits
    for peer 1 before its first step (the swarm's peers at start). Both train for 30 s (a time limit): a
    budget of 375 steps each gave 3 averaging rounds of both in 42 s on a slow day, and on a fast one
    (2026-11-28) peer 0 trained its 375 steps in 5 s, while its progress tracker had not seen peer 1 yet,
    so every round of either peer went alone."""
    from ddlscope.network.emulated import EmulatedNetwork

    config = tmp_path / "run.toml"
    config.write_text("""[run]
strategy = "collaborative"
model = "tiny_cnn"
dataset = "mnist"
peers = 2
batch_size = 16
sample_budget = 10000000
time_limit_s = 30
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


def test_two_torchrun_nodes_as_namespaces_train_one_ddp_run_through_the_commands_a_user_types(env_data, tmp_path):
    """Each "host" runs `ddlscope run CONFIG --nnodes 2 --rdzv-endpoint A:PORT --run-id ID --local-addr ITS_ADDRESS`
    in a namespace of its own: the rendezvous, the agents' store and gloo's pairs go over the emulated link (the
    hosts' addresses are not loopback), and each node stores its own worker in its own database."""
    from ddlscope.network.emulated import EmulatedNetwork

    config = tmp_path / "run.toml"
    config.write_text('[run]\nstrategy = "ddp"\nmodel = "tiny_cnn"\ndataset = "mnist"\npeers = 2\n'
                      'vcpus_per_peer = 1\nbatch_size = 16\nsample_budget = 960\nloader_workers = 0\n')
    with EmulatedNetwork([(100.0, 100.0), (100.0, 100.0)]) as net:
        addresses = [net.address(0), net.address(1)]
        nodes = []
        for i, addr in enumerate(addresses):
            (tmp_path / f"node{i}").mkdir()
            cmd = [sys.executable, "-m", "ddlscope", "run", str(config), "--nnodes", "2",
                   "--rdzv-endpoint", f"{addresses[0]}:29531", "--run-id", "two-hosts", "--local-addr", addr,
                   "--db", str(tmp_path / f"node{i}" / "r.db"), "--no-progress"]
            nodes.append(subprocess.Popen(net.wrap(i, cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True, cwd=tmp_path / f"node{i}"))
        outs = [n.communicate(timeout=240) for n in nodes]
        assert [n.returncode for n in nodes] == [0, 0], [o[1][-2000:] for o in outs]
        counters = net.counters()
    for i in range(2):
        with ResultsStore(tmp_path / f"node{i}" / "r.db") as store:
            run = store.run("two-hosts")
            assert run["status"] == "completed", run["reason"]
            # 960 samples / (2 workers x 16) = 30 steps, each worker on its own node
            assert store.step_counts("two-hosts") == {i: 30}
    # the gradients crossed the emulated link: 30 all-reduces of the tiny CNN's gradients each way
    assert counters[0]["bytes_sent"] > 30 * 10_000 and counters[1]["bytes_sent"] > 30 * 10_000


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
