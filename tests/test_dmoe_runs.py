"""dmoe runs for real on this machine: 2 trainers, 2 expert servers (one killed and restarted), and
the local and dense baselines. Each run takes 20-60 s on 2 cores."""

from __future__ import annotations

import json

import psutil
import pytest

from ddlscope.config import validate_config
from ddlscope.launch.local import run_local
from ddlscope.store.db import ResultsStore

pytestmark = pytest.mark.slow


def _cfg(**over):
    values = dict(strategy="dmoe", model="moe_cnn", dataset="digits", peers=2, batch_size=16, sample_budget=1600,
                  eval_every_steps=10, loader_workers=0, warmup_steps=2)
    values.update(over)
    return validate_config(values)


def test_two_trainers_survive_a_killed_server_and_use_its_restart(tmp_path):
    db = tmp_path / "r.db"
    # trainers train for 40 s (a time limit: with a budget of 75 steps they trained 25 s on a slow day and 14 s on a
    # fast one, when the restarted server came up 1 s before they ended and was never called); the schedule counts
    # from their first step (as the launcher sees it in the store: 3 s late here). The restart is asked for 1 s after
    # the kill, so the server's start (imports, DHT join: 2-6 s quiet, much longer beside the rest of CI, where a
    # restart at 10 s of 30 was once never called) has most of the run. Evaluation (every 100 steps) is left until
    # after the restart: its expert calls are not training steps' calls, and a kill during an evaluation at step 10
    # left no failed call in moe_calls (CI).
    # Run as a user runs it, in a process of its own: started from this test process after the rest of the suite,
    # hivemind's server start hung at its connection handler (twice in CI; cause not found, see docs/validation.md)
    import subprocess
    import sys

    config = tmp_path / "run.toml"
    config.write_text("""[run]
strategy = "dmoe"
model = "moe_cnn"
dataset = "digits"
peers = 2
batch_size = 16
sample_budget = 1000000
time_limit_s = 40
eval_every_steps = 100
loader_workers = 0
[dmoe]
update_period_s = 2.0
server_events = [{ server = 1, kill_at_s = 3.0, restart_at_s = 4.0 }]
""")
    done = subprocess.run([sys.executable, "-m", "ddlscope.cli", "run", str(config), "--db", str(db), "--no-progress"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    with ResultsStore(db) as store:
        run_id = store.runs()[0]["run_id"]
        run = store.run(run_id)
        assert run["status"] == "completed", run["reason"]
        counts = store.step_counts(run_id)
        assert set(counts) == {0, 1} and min(counts.values()) >= 30, counts
        services = {(s["service_index"], s["generation"]): s for s in store.services(run_id)}
        status = {k: (s["status"], s["reason"]) for k, s in services.items()}
        assert services[(1, 0)]["status"] == "killed" and "SIGKILL" in services[(1, 0)]["reason"], status
        # server 0 bootstraps the swarm; the launcher starts it once more if its first start hangs silent
        restarts_0 = [g for (i, g) in services if i == 0 and g > 0]
        assert len(restarts_0) <= 1, status
        assert all(services[(0, g)]["status"] == "failed" and "started again" in services[(0, g)]["reason"]
                   for g in range(len(restarts_0))), status
        assert services[(1, 1)]["status"] == "stopped" and services[(0, len(restarts_0))]["status"] == "stopped", status
        calls = store.rows("moe_calls", run_id)
        killed_peer, restarted_peer = services[(1, 0)]["peer_id"], services[(1, 1)]["peer_id"]
        assert killed_peer != restarted_peer
        # calls to the killed server failed; the restarted one, found through the DHT, answered
        assert sum(c["failed"] for c in calls if c["peer_id"] == killed_peer) > 0
        answered_by_restart = sum(c["calls"] - c["failed"] for c in calls if c["peer_id"] == restarted_peer)
        last_step_at = max(s["wall_time"] for s in store.rows("steps", run_id))
        assert answered_by_restart > 0, (f"the restarted server began {last_step_at - services[(1, 1)]['started_at']:.1f} s "
                                         f"before training ended and was never called")
        moe_steps = store.rows("moe_steps", run_id)
        assert len(moe_steps) == sum(counts.values())
        # every step called experts, or its beam search found none and it stored all its samples as dropped: on a
        # 2-core EPYC in CI one step of 99, 10 s after the kill, found no expert while the restart joined
        assert all(m["forward_calls"] > 0 or (m["experts_chosen"] == 0 and m["samples_dropped"] == m["samples"])
                   for m in moe_steps), [m for m in moe_steps if m["forward_calls"] == 0]
        assert sum(m["forward_calls"] > 0 for m in moe_steps) >= 0.9 * len(moe_steps)
        assert store.rows("moe_server_batches", run_id) and store.rows("moe_server_samples", run_id)
        kinds = [e["kind"] for e in store.rows("events", run_id)]
        assert kinds.count("service_started") == 3 + len(restarts_0) and kinds.count("service_killed") == 1
        pids = [s["pid"] for s in store.services(run_id)] + [w["pid"] for w in store.workers(run_id)]
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    # nor anything they forked (hivemind's task pools, connection handlers, DHT processes carry the command line)
    assert not [p.pid for p in psutil.process_iter(["cmdline"]) if str(db) in " ".join(p.info["cmdline"] or [])]


@pytest.mark.parametrize("placement", ["local", "dense"])
def test_baselines_train_in_process(tmp_path, placement):
    db = tmp_path / "r.db"
    run_id = run_local(_cfg(peers=1, sample_budget=320, dmoe={"placement": placement}), db, progress=False)
    with ResultsStore(db) as store:
        assert store.run(run_id)["status"] == "completed"
        assert store.services(run_id) == []
        loads = store.rows("moe_calls", run_id)
        per_step = {}
        for c in loads:
            per_step[c["step"]] = per_step.get(c["step"], 0) + c["calls"]
        # local: every sample goes to k_best = 2 in-process experts; dense: to the one expert
        assert set(per_step.values()) == {16 * (2 if placement == "local" else 1)}
        assert len(per_step) == 20 and all(c["peer_id"] is None and c["failed"] == 0 for c in loads)
        details = [json.loads(e["detail_json"]) for e in store.rows("events", run_id) if e["kind"] == "strategy_details"]
        assert details[0]["placement"] == placement


def _start_server(tmp_path, index, initial_peers=()):
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "ddlscope.cli", "serve-experts", "--index", str(index), "--set", "dmoe.servers=2",
           "--db", str(tmp_path / f"server{index}.db"), "--cores", "0"]
    for p in initial_peers:
        cmd += ["--initial-peers", p]
    log = open(tmp_path / f"server{index}.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    proc.log_path = tmp_path / f"server{index}.log"
    return proc


def _wait_or_kill(proc, timeout_s: float) -> int | None:
    """The exit code of ``proc`` within ``timeout_s``; else None, after killing it and what it started (torch's
    shm manager excepted: it unlinks its segments and ends after its clients), so a failed test leaves no server."""
    import subprocess

    from ddlscope.launch.processes import end_children

    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        end_children(proc.pid)
        proc.kill()
        proc.wait(10)
        return None


def _maddrs(proc, timeout_s: float = 60.0) -> list[str]:
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in proc.log_path.read_text().splitlines():
            if " serves " in line:
                return line.strip().split(" at ", 1)[1].split()
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    raise AssertionError(f"server did not serve (code {proc.poll()}): {proc.log_path.read_text()[-2000:]}")


def test_servers_and_trainers_on_other_hosts_through_the_commands_users_type(tmp_path):
    """`ddlscope serve-experts` on two "hosts", trainers joining them with dmoe.initial_peers (the recipe
    for real hosts, on loopback)."""
    import signal
    import subprocess
    import sys

    first = _start_server(tmp_path, 0)
    second = None
    try:
        maddrs = _maddrs(first)
        second = _start_server(tmp_path, 1, maddrs)
        _maddrs(second)
        peers = "[" + ", ".join(f'"{m}"' for m in maddrs) + "]"
        done = subprocess.run([sys.executable, "-m", "ddlscope.cli", "run", "--db", str(tmp_path / "trainer.db"),
                               "--set", 'strategy="dmoe"', "--set", 'model="moe_cnn"', "--set", "sample_budget=320",
                               "--set", "batch_size=16", "--set", "loader_workers=0", "--set", f"dmoe.initial_peers={peers}"],
                              capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stderr[-2000:]
        with ResultsStore(tmp_path / "trainer.db") as store:
            run = store.runs()[0]
            assert run["status"] == "completed" and store.services(run["run_id"]) == []  # started no servers
            answered = {c["peer_id"] for c in store.rows("moe_calls", run["run_id"]) if c["calls"] > c["failed"]}
        server_peers = set()
        for i in (0, 1):
            with ResultsStore(tmp_path / f"server{i}.db") as store:
                server_peers |= {s["peer_id"] for s in store.services(store.runs()[0]["run_id"])}
        assert answered == server_peers and len(server_peers) == 2
    finally:
        servers = [proc for proc in (first, second) if proc is not None]
        for proc in servers:
            proc.send_signal(signal.SIGINT)
        codes = [_wait_or_kill(proc, 30) for proc in servers]
        assert codes == [0] * len(servers), f"servers' exit codes after SIGINT (None: killed after 30 s): {codes}"
    for i in (0, 1):
        with ResultsStore(tmp_path / f"server{i}.db") as store:
            run = store.runs()[0]
            assert run["status"] == "completed"
            assert [s["status"] for s in store.services(run["run_id"])] == ["stopped"]
            assert store.rows("moe_server_batches", run["run_id"])
