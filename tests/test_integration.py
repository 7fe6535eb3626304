"""End to end, with real processes: single and collaborative runs, Ctrl-C, a peer that cannot join, bad input.

These start worker processes (and, for collaborative runs, hivemind daemons) on this machine:
seconds each on 2 cores. Every worker gets one thread.
"""

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

from ddlscope.analyze.compare import summarize_run
from ddlscope.config import validate_config
from ddlscope.launch.local import run_local
from ddlscope.store.db import ResultsStore
from tests.conftest import tiny_run

pytestmark = pytest.mark.slow

# Hivemind's progress tracker needs global epochs of a few seconds to gather peers; the tiny CNN
# takes ~10 ms a step, so a global epoch is 2400 samples (~75 steps of each peer).
COLLAB = dict(strategy="collaborative", peers=2, vcpus_per_peer=1,
              collaborative=dict(target_batch_size=2400, matchmaking_time_s=1.0, averaging_timeout_s=20.0,
                                 join_timeout_s=30.0))


def _cli(*args: str, cwd: Path, env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ddlscope", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=env or dict(os.environ))


def _assert_no_leftovers(store: ResultsStore, run_id: str) -> None:
    for w in store.workers(run_id):
        if w["pid"] and psutil.pid_exists(w["pid"]):
            assert psutil.Process(w["pid"]).status() == psutil.STATUS_ZOMBIE, f"worker {w['worker_index']} still runs"
    leftovers = [p for p in psutil.process_iter(["cmdline"]) if run_id in " ".join(p.info["cmdline"] or [])]
    assert not leftovers, leftovers


def test_single_run_records_every_step(env_data, db_path):
    cfg = validate_config(tiny_run(eval_every_steps=5))
    run_id = run_local(cfg, db_path, progress=False)
    with ResultsStore(db_path) as store:
        assert store.run(run_id)["status"] == "completed"
        steps = store.rows("steps", run_id)
        assert [s["step"] for s in steps] == list(range(cfg.max_steps_per_peer()))  # 320 / 16 = 20 steps
        for s in steps:
            parts = s["data_load_s"] + s["forward_s"] + s["backward_s"] + s["optimizer_s"]
            assert parts <= s["step_s"] + 1e-9  # step_s is the step's wall time; the parts are disjoint laps in it
            assert s["step_s"] - parts < 0.01  # only bookkeeping between the laps is left out
            assert s["comm_s"] == 0 and s["comm_wait_s"] == 0 and s["bubble_s"] == 0 and s["comm_bytes"] == 0
            assert s["forward_s"] > 0 and s["backward_s"] > 0 and s["samples"] == 16
        assert sum(s["warmup"] for s in steps) == 1
        evals = store.rows("evals", run_id)
        assert [e["step"] for e in evals] == [4, 9, 14, 19]
        assert len(store.rows("host_samples", run_id)) >= 2
        summary = summarize_run(store, run_id)
        assert summary.runtime_s > 0 and summary.throughput_samples_per_s > 0
        assert summary.verdict is not None
        _assert_no_leftovers(store, run_id)


def shm_segments() -> set[str]:
    """torch's shared-memory segments (``file_system`` strategy, which hivemind sets) in /dev/shm."""
    return {p.name for p in Path("/dev/shm").glob("torch_*")} if Path("/dev/shm").is_dir() else set()


def assert_no_new_shm_segments(before: set[str], timeout_s: float = 20.0) -> None:
    """No segment beyond ``before`` is left in /dev/shm once torch's shm manager, left to end after the
    peers, has unlinked them (within ``timeout_s``; killed with a peer's other children, it left one or
    more per run behind)."""
    deadline = time.monotonic() + timeout_s
    while shm_segments() - before and time.monotonic() < deadline:
        time.sleep(0.5)
    left = sorted(shm_segments() - before)
    assert not left, f"{len(left)} shared-memory segments left in /dev/shm: {left[:5]}"


def test_collaborative_run_averages_with_both_peers(env_data, db_path):
    # 16 global epochs (1,200 steps of each peer), however fast the machine: a budget of 4 (300 steps each) took 3 s on
    # a fast day (2026-11-28), too short for hivemind's progress trackers to see each other (every round went alone);
    # 15 s of training instead (a time limit) held 1-2 epochs on a slow one (CI, 2026-12-05), too few for each peer
    # to reach a parameter round: one that joins an epoch late loads the swarm's state instead. The time limit only
    # keeps a stuck run from holding the suite.
    cfg = validate_config(tiny_run(sample_budget=38_400, time_limit_s=600.0, **COLLAB))
    segments = shm_segments()
    run_id = run_local(cfg, db_path, progress=False)
    with ResultsStore(db_path) as store:
        run = store.run(run_id)
        assert run["status"] == "completed", run["reason"]
        steps = store.rows("steps", run_id)
        assert {s["worker_index"] for s in steps} == {0, 1}
        full_rounds = [s for s in steps if s["averaging_round"] and s["averaging_group_size"] == 2
                       and s["averaging_succeeded"] == 1]
        rounds = [(s["worker_index"], s["step"], s["averaging_group_size"], s["averaging_succeeded"])
                  for s in steps if s["averaging_round"]]
        assert full_rounds, f"no averaging round gathered both peers: {rounds}"
        assert all(s["averaging_s"] > 0 for s in full_rounds)
        assert max(s["global_epoch"] or 0 for s in steps) >= 1
        # hivemind's processes and threads do the averaging: their CPU shows in the round steps
        assert all(s["background_cpu_s"] is not None and s["background_cpu_s"] >= 0 for s in steps), [s["background_cpu_s"] for s in steps]
        assert max(s["background_cpu_s"] for s in full_rounds) > 0
        # hivemind's parameter rounds, run in its state averager's background thread, are timed per epoch
        state = [(e["worker_index"], json.loads(e["detail_json"])) for e in store.rows("events", run_id)
                 if e["kind"] == "state_round"]
        assert {w for w, _ in state} == {0, 1}, state
        assert all(d["seconds"] > 0 and d["ended_at"] >= d["began_at"] and d["epoch"] >= 0 for _, d in state), state
        summary = summarize_run(store, run_id)
        assert all(w.net_sent_bytes > 0 for w in summary.workers)  # peers exchanged tensors over TCP
        _assert_no_leftovers(store, run_id)
    assert_no_new_shm_segments(segments)  # the tensors hivemind shared between a peer and its processes


def test_ctrl_c_keeps_measurements_and_ends_every_process(env_data, tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "ddlscope", "run", "--no-progress", "--set", "model=\"tiny_cnn\"",
                             "--set", "dataset=\"mnist\"", "--set", "sample_budget=1000000", "--set", "loader_workers=1",
                             "--set", "batch_size=16"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    db = tmp_path / "ddlscope-results" / "ddlscope.db"
    deadline = time.monotonic() + 120
    steps = 0
    while time.monotonic() < deadline and steps < 10:
        time.sleep(0.5)
        if db.exists():
            with ResultsStore(db) as store:
                runs = store.runs()
                steps = sum(store.step_counts(runs[0]["run_id"]).values()) if runs else 0
    assert steps >= 10, proc.stderr.read() if proc.poll() is not None else "no progress"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    with ResultsStore(db) as store:
        run_id = store.runs()[0]["run_id"]
        assert store.run(run_id)["status"] == "interrupted"
        assert len(store.rows("steps", run_id)) >= 10
        assert store.workers(run_id)[0]["status"] == "interrupted"
        _assert_no_leftovers(store, run_id)


def test_peer_that_cannot_join_fails_in_bounded_time(env_data, db_path):
    values = tiny_run(**COLLAB)
    values["collaborative"] = dict(values["collaborative"], join_timeout_s=5.0,
                                   initial_peers=["/ip4/127.0.0.1/tcp/9/p2p/12D3KooWRBhwfeP2Y4TCx1SM6s9rUoHhR5STiGwxBhgFRcw3UERE"])
    cfg = validate_config(values)
    t0 = time.monotonic()
    run_id = run_local(cfg, db_path, progress=False)
    assert time.monotonic() - t0 < 60
    with ResultsStore(db_path) as store:
        run = store.run(run_id)
        assert run["status"] == "failed"
        assert "could not join the swarm" in run["reason"] and "127.0.0.1/tcp/9" in run["reason"]
        _assert_no_leftovers(store, run_id)


@pytest.mark.parametrize("args, expected", [
    (["run", "--set", "batch_size=0"], "batch_size"),
    (["run", "--set", "model=\"resnet9000\""], "resnet9000"),
    (["run", "--set", "strategy=\"collaborative\"", "--set", "peers=2", "--set", "vcpus_per_peer=99"], "vcpus_per_peer"),
    (["run", "--set", "dataset=\"/no/such/folder\""], "/no/such/folder"),
    (["report", "--db", "missing.db"], "no results database"),
])
def test_cli_bad_input_is_one_clear_line(tmp_path, env_data, args, expected):
    result = _cli(*args, cwd=tmp_path, timeout=60)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("error: ") and expected in result.stderr


def test_cli_corrupt_dataset_names_the_path(tmp_path, env_data):
    bad = tmp_path / "broken"
    (bad / "train" / "0").mkdir(parents=True)
    (bad / "test" / "0").mkdir(parents=True)
    (bad / "train" / "0" / "a.png").write_bytes(b"not a png")
    (bad / "test" / "0" / "b.png").write_bytes(b"not a png")
    result = _cli("run", "--set", f"dataset=\"{bad}\"", "--set", "model=\"tiny_cnn\"", cwd=tmp_path, timeout=60)
    assert result.returncode in (1, 2), result.stderr
    assert "Traceback" not in result.stderr
    assert str(bad) in result.stderr + result.stdout


def test_report_command_compares_runs(env_data, tmp_path):
    db = tmp_path / "r" / "ddlscope.db"
    ids = [run_local(validate_config(tiny_run(**extra)), db, group_name="g", progress=False)
           for extra in (dict(), dict(batch_size=32))]
    result = _cli("report", "--db", str(db), "--group", "g", cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    out = tmp_path / "r" / "reports" / "g"
    assert (out / "report.html").exists() and (out / "step_breakdown.png").exists()
    data = json.loads((out / "summary.json").read_text())
    assert [r["run_id"] for r in data["runs"]] == ids
    assert data["runs"][0]["speedup"] == pytest.approx(1.0)
