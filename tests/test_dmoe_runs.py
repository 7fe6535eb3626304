"""dmoe runs for real on this machine: the local and dense baselines, and trainers and expert servers
started on "other hosts" by the commands users type. A server killed and restarted during a run is in
tests/test_emulated_runs.py (each process in a namespace of its own)."""

from __future__ import annotations

import json

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
