"""Run management: killed runs marked interrupted on read, ``runs`` filters and JSON, ``rm``, no database made by reading."""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from ddlscope.cli import app
from ddlscope.errors import UserError
from ddlscope.store import db as store_db
from ddlscope.store.db import ResultsStore, process_start_time

LINKED_TABLES = ("workers", "steps", "evals", "host_samples", "events", "predictions")


def _invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen(["sleep", "120"])


def _kill(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()


def _launched_by(store: ResultsStore, run_id: str, proc: subprocess.Popen) -> None:
    """Record ``proc`` as the run's launcher (as if it had called create_run)."""
    store.conn.execute("UPDATE runs SET launcher_pid = ?, launcher_started_at = ? WHERE run_id = ?",
                       (proc.pid, process_start_time(proc.pid), run_id))


# ---------------------------------------------------------------------- killed runs
def test_a_run_whose_processes_were_killed_is_marked_interrupted_on_read_and_a_live_one_is_not(db_path):
    store = ResultsStore(db_path)
    live = store.create_run("live", "single", {})  # launcher: this test's own process
    killed = store.create_run("killed", "ddp", {}, group_name="g")
    launcher, w0, w1 = _sleeper(), _sleeper(), _sleeper()
    try:
        _launched_by(store, killed, launcher)
        store.upsert_worker(killed, 0, hostname=socket.gethostname(), pid=w0.pid, status="training")
        store.upsert_worker(killed, 1, hostname=socket.gethostname(), pid=w1.pid, status="starting")
        store.upsert_worker(killed, 2, hostname=socket.gethostname(), pid=None, status="completed")
        assert store.workers(killed)[0]["pid_started_at"] == pytest.approx(process_start_time(w0.pid))
        _kill(launcher)
        _kill(w0)
        assert store.run_processes_alive(killed) is True  # worker 1 still runs
        assert _invoke("runs", "--db", db_path).exit_code == 0
        assert store.run(killed)["status"] == "running"
        _kill(w1)
    finally:
        for p in (launcher, w0, w1):
            if p.poll() is None:
                _kill(p)
    assert store.run_processes_alive(killed) is False
    result = _invoke("runs", "--db", db_path)
    assert result.exit_code == 0, result.output
    assert f"note: run {killed} marked interrupted: its processes are gone" in result.stderr
    row = store.run(killed)
    assert row["status"] == "interrupted"
    assert row["reason"].startswith(f"its processes are gone (killed?): no worker or launcher alive on host "
                                    f"{socket.gethostname()} at ")
    assert row["ended_at"] >= row["created_at"]
    assert [(w["status"], w["reason"]) for w in store.workers(killed)] == \
        [("interrupted", row["reason"]), ("interrupted", row["reason"]), ("completed", None)]
    assert store.run(live)["status"] == "running"
    again = _invoke("runs", "--db", db_path)
    assert "marked interrupted" not in again.stderr and store.run(live)["status"] == "running"


def test_a_pid_reused_by_a_later_process_does_not_keep_a_run_alive(db_path):
    store = ResultsStore(db_path)
    me = process_start_time(os.getpid())
    # the launcher's pid is ours, but the launcher started an hour before us: another process
    reused = store.create_run("reused", "single", {})
    store.conn.execute("UPDATE runs SET launcher_started_at = ? WHERE run_id = ?", (me - 3600, reused))
    # an older database: no start time recorded; the worker's pid is ours, but the run stopped recording
    # anything an hour before we started
    old = store.create_run("old", "single", {})
    store.upsert_worker(old, 0, hostname=socket.gethostname(), pid=os.getpid(), pid_started_at=None, status="training")
    store.conn.execute("UPDATE runs SET launcher_pid = NULL, launcher_started_at = NULL, created_at = ? "
                       "WHERE run_id = ?", (me - 3600, old))
    mine = store.create_run("mine", "single", {})
    assert store.run_processes_alive(mine) is True
    assert sorted(store.mark_stale_runs()) == sorted([reused, old])
    assert store.run(mine)["status"] == "running"


def test_runs_of_another_host_or_with_no_pid_recorded_are_left_alone(db_path, tmp_path):
    store = ResultsStore(db_path)
    cluster = store.create_run("cluster", "ddp", {})
    store.conn.execute("UPDATE runs SET host = 'node-7', launcher_pid = 999999999 WHERE run_id = ?", (cluster,))
    remote_worker = store.create_run("remote-worker", "ddp", {})
    store.conn.execute("UPDATE runs SET launcher_pid = 999999999 WHERE run_id = ?", (remote_worker,))
    store.upsert_worker(remote_worker, 1, hostname="node-7", pid=999999998, status="training")
    assert store.run_processes_alive(cluster) is None and store.run_processes_alive(remote_worker) is None
    assert store.mark_stale_runs() == []
    # a database written before pids were recorded opens (columns added, rows kept) and is not judged
    old_path = tmp_path / "old.db"
    conn = sqlite3.connect(old_path)
    conn.executescript(store_db.SCHEMA)
    conn.execute("INSERT INTO runs (run_id, name, strategy, config_json, status, created_at, host) "
                 "VALUES ('r1', 'old', 'single', '{}', 'running', 1.0, ?)", (socket.gethostname(),))
    assert "launcher_pid" not in {r[1] for r in conn.execute("PRAGMA table_info(runs)")}
    conn.commit()
    conn.close()
    with ResultsStore(old_path) as old:
        assert old.run("r1")["launcher_pid"] is None and old.mark_stale_runs() == []
        assert old.run("r1")["status"] == "running"


# ---------------------------------------------------------------------- runs --status --group --json
def test_runs_filters_by_status_and_group_prints_json_and_full_reasons(db_path):
    long_reason = " ".join(f"word{i}" for i in range(40)) + " END-OF-REASON"
    with ResultsStore(db_path) as store:
        a = store.create_run("a", "single", {"batch_size": 16}, group_name="g1")
        store.finish_run(a, "completed")
        b = store.create_run("b", "ddp", {"batch_size": 32}, group_name="g1")
        store.upsert_worker(b, 0, hostname="h", pid=None, status="failed", reason="boom")
        store.finish_run(b, "failed", long_reason)
        c = store.create_run("c", "single", {}, group_name="g2")
        store.finish_run(c, "failed", "short")
        d = store.create_run("d", "single", {})  # running, this process alive
        times = {a: 1.0, b: 2.0, c: 3.0, d: 4.0}
        for run_id, t in times.items():
            store.conn.execute("UPDATE runs SET created_at = ? WHERE run_id = ?", (t, run_id))

    def listed(*args):
        result = _invoke("runs", "--db", db_path, "--json", *args)
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    only_b = listed("--status", "failed", "--group", "g1")
    assert [r["run_id"] for r in only_b] == [b]
    assert only_b[0]["reason"] == long_reason and only_b[0]["config"]["batch_size"] == 32
    assert only_b[0]["group_name"] == "g1" and only_b[0]["strategy"] == "ddp"
    assert [(w["worker_index"], w["status"], w["reason"]) for w in only_b[0]["workers"]] == [(0, "failed", "boom")]
    assert [r["run_id"] for r in listed("--status", "failed")] == [c, b]
    assert [r["run_id"] for r in listed("--group", "g1")] == [b, a]
    assert [r["run_id"] for r in listed()] == [d, c, b, a]
    assert listed("--status", "interrupted") == []
    table = _invoke("runs", "--db", db_path, "--group", "g1")
    assert table.exit_code == 0, table.output
    assert all(word in table.stdout for word in long_reason.split()), table.stdout
    bad = _invoke("runs", "--db", db_path, "--status", "done")
    assert isinstance(bad.exception, UserError)
    assert str(bad.exception) == "--status 'done': allowed: running, completed, failed, interrupted"


# ---------------------------------------------------------------------- rm
def _filled_run(store: ResultsStore, name: str, group: str | None = None) -> str:
    """A finished run with rows in every table linked to runs, and a log folder."""
    run_id = store.create_run(name, "single", {}, group_name=group)
    store.upsert_worker(run_id, 0, hostname=socket.gethostname(), pid=None, status="completed")
    store.add_step(run_id, 0, {"step": 0, "wall_time": 1.0, "samples": 16, "warmup": 1, "optimizer_stepped": 1})
    store.add_eval(run_id, 0, 0, 1.0, 0.5, 1.2, 16)
    store.add_host_sample(run_id, 0, {"wall_time": 1.0, "cpu_percent": 50.0})
    store.add_event(run_id, 0, "averaging_round", group_size=2)
    store.add_prediction(f"cell-{name}", "single", 1, 16, group_name=group, run_id=run_id)
    store.finish_run(run_id, "completed")
    log_dir = store.path.parent / "logs" / run_id
    log_dir.mkdir(parents=True)
    (log_dir / "worker-0.log").write_text("log")
    return run_id


def _counts(store: ResultsStore, run_id: str) -> dict[str, int]:
    tables = [name for (name,) in store.conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
              if "run_id" in {r[1] for r in store.conn.execute(f"PRAGMA table_info({name})")}]
    return {t: store.conn.execute(f"SELECT COUNT(*) FROM {t} WHERE run_id = ?", (run_id,)).fetchone()[0] for t in tables}


def test_rm_deletes_every_row_of_a_run_and_its_logs_and_nothing_else(db_path):
    store = ResultsStore(db_path)
    gone, kept = _filled_run(store, "gone"), _filled_run(store, "kept")
    before = _counts(store, gone)
    assert all(before[t] == 1 for t in (*LINKED_TABLES, "runs")), before
    unconfirmed = _invoke("rm", gone, "--db", db_path)  # stdin is not a terminal here
    assert isinstance(unconfirmed.exception, UserError) and "pass --yes" in str(unconfirmed.exception)
    assert _counts(store, gone) == before
    result = _invoke("rm", gone, "--db", db_path, "--yes")
    assert result.exit_code == 0, result.output
    assert f"deleted 1 run(s) from {db_path}: 1 evals rows, 1 events rows, 1 host_samples rows, " \
           f"1 predictions rows, 1 steps rows, 1 workers rows; 1 log folder(s)" in result.stdout
    assert set(_counts(store, gone).values()) == {0}
    assert not (db_path.parent / "logs" / gone).exists()
    assert _counts(store, kept) == before and (db_path.parent / "logs" / kept).is_dir()


def test_rm_refuses_a_live_running_run_unless_forced_and_deletes_a_group(db_path):
    store = ResultsStore(db_path)
    live = store.create_run("live", "single", {}, group_name="g")  # launcher: this test's process, alive
    g1, g2, other = _filled_run(store, "g1", "g"), _filled_run(store, "g2", "g"), _filled_run(store, "other", "h")
    refused = _invoke("rm", live, "--db", db_path, "--yes")
    assert isinstance(refused.exception, UserError)
    assert str(refused.exception).startswith(f"run(s) {live} still running") and "--force" in str(refused.exception)
    refused = _invoke("rm", "--group", "g", "--db", db_path, "--yes")
    assert isinstance(refused.exception, UserError) and store.run(g1) is not None
    forced = _invoke("rm", "--group", "g", "--db", db_path, "--yes", "--force")
    assert forced.exit_code == 0, forced.output
    assert "deleted 3 run(s)" in forced.stdout
    assert [r["run_id"] for r in store.runs()] == [other]
    for args in ((other, "--group", "h"), ()):
        both = _invoke("rm", *args, "--db", db_path, "--yes")
        assert str(both.exception) == "give run id(s) or --group NAME (not both)"
    unknown = _invoke("rm", "nosuchrun", "--db", db_path, "--yes")
    assert str(unknown.exception).startswith("unknown run id(s) nosuchrun in ")
    assert store.run(other) is not None and store.run(g2) is None


# ---------------------------------------------------------------------- reading never creates a database
@pytest.mark.parametrize("command", [["runs"], ["report"], ["sweep-report", "s"], ["matchmaking", "--group", "g"],
                                     ["rm", "abc", "--yes"], ["suite", "local", "--report-only"]])
def test_read_only_commands_on_a_missing_database_create_nothing(tmp_path, monkeypatch, command):
    typo = tmp_path / "typo" / "x.db"
    result = _invoke(*command, "--db", typo)
    assert isinstance(result.exception, UserError), result.output
    assert str(result.exception).startswith(f"no results database at {typo}; one is made by 'ddlscope run'")
    assert not typo.parent.exists()
    monkeypatch.chdir(tmp_path)
    result = _invoke(*command)
    assert isinstance(result.exception, UserError), result.output
    assert list(tmp_path.iterdir()) == []


def test_runs_on_a_missing_database_prints_one_error_line(tmp_path):
    result = subprocess.run([sys.executable, "-m", "ddlscope", "runs", "--db", "typo/x.db"], capture_output=True,
                            text=True, cwd=tmp_path, timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: no results database at typo/x.db; "), result.stderr
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "folder.db").mkdir()
    folder = _invoke("runs", "--db", tmp_path / "folder.db")
    assert str(folder.exception).startswith(f"{tmp_path / 'folder.db'} is a folder, not a results database")


# ---------------------------------------------------------------------- a real run, killed
@pytest.mark.slow
def test_a_real_run_killed_with_sigkill_is_marked_interrupted_by_runs(tmp_path, env_data):
    """The launcher and its worker record their pids as a run starts; kill -9 the launcher (its worker dies
    with it) and the next ``runs`` marks the run interrupted."""
    import signal
    import time

    db = tmp_path / "results" / "ddlscope.db"
    sets = [f"{k}={json.dumps(v)}" for k, v in dict(model="tiny_cnn", dataset="mnist", batch_size=16,
                                                   sample_budget=10_000_000, loader_workers=0, warmup_steps=1,
                                                   vcpus_per_peer=1, final_eval=False).items()]
    launcher = subprocess.Popen([sys.executable, "-m", "ddlscope", "run", "--db", str(db), "--no-progress",
                                 *(a for s in sets for a in ("--set", s))], cwd=tmp_path, env=dict(os.environ),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    workers: list = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and launcher.poll() is None:
            if db.exists():
                with ResultsStore(db) as store:
                    runs = store.runs()
                    workers = store.workers(runs[0]["run_id"]) if runs else []
                    if workers and workers[0]["status"] == "training":
                        break
            time.sleep(0.5)
        assert workers and workers[0]["status"] == "training", launcher.stderr.read().decode()[-2000:]
        with ResultsStore(db) as store:
            run = store.runs()[0]
            assert run["launcher_pid"] == launcher.pid and workers[0]["pid_started_at"] is not None
            assert store.run_processes_alive(run["run_id"]) is True
            assert _invoke("runs", "--db", db).exit_code == 0 and store.run(run["run_id"])["status"] == "running"
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()
        with ResultsStore(db) as store:
            deadline = time.monotonic() + 30
            while store.run_processes_alive(run["run_id"]) and time.monotonic() < deadline:
                time.sleep(0.2)  # the worker dies with its parent
            result = _invoke("runs", "--db", db, "--json", "--status", "interrupted")
            assert result.exit_code == 0, result.output
            [record] = json.loads(result.stdout)
            # the worker saw its launcher die and recorded it; else this read would have marked it
            assert record["run_id"] == run["run_id"] and record["reason"].startswith(
                f"launcher (pid {launcher.pid}) died without stopping the run"), record["reason"]
            assert [w["status"] for w in record["workers"]] == ["interrupted"]
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
        for w in workers:  # a worker still alive (its start time matches the one it recorded) is ended here
            if store_db._process_alive(w["pid"], w["pid_started_at"], None):
                os.kill(w["pid"], signal.SIGKILL)
