"""Any death, any moment: the fault matrix of a run (issue 18).

Each case starts ``ddlscope run`` (or ``sweep``) as a user does, in a session of its own, on the
tiny CNN and the bundled digits with one thread per process, waits until every worker trains, then
hurts it: a signal (SIGKILL, SIGTERM, SIGINT, SIGHUP) to the launcher, to a worker or peer, or to a
daemon (a peer's p2pd, the torchrun agent); a full disk under the store; the store file removed; a
second run on the same store. Every case asserts:

- the run's final status and a reason a person understands ("launcher (pid N) died ...", "peer 1
  killed by SIGKILL", "disk full writing <db>: ...");
- every step stored before the fault is still there;
- no process of the run is left: every descendant of the launcher seen while it trained (workers,
  torchrun's agent and workers, hivemind's processes and p2pd) and every process whose command line
  names the run's database is gone;
- nothing is left in the temporary folder: the launcher is given a private ``TMPDIR``, the run's own
  folder under it (``ddlscope-run-*``: pymp, torchelastic, hivemind's sockets) is gone and the
  private folder is empty, after the next read of the store (``ddlscope runs``).

No timing is asserted: "gone" waits up to :data:`GONE_WAIT_S`, generous for a loaded machine.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from ddlscope.launch.processes import SHM_MANAGER, is_shm_manager, remove_run_temp_dir, sigterm_as_interrupt, stop_signals_held
from ddlscope.launch.reaper import hivemind_socket_files
from ddlscope.store.db import ResultsStore

slow = pytest.mark.slow  # each case starts a real run (seconds of start-up on 2 cores)

GONE_WAIT_S = 60.0
"""Seconds a case waits for the run's processes to end before it fails."""
START_WAIT_S = 180.0
"""Seconds a case waits for every worker to train."""
BASE = dict(model="tiny_cnn", dataset="digits", batch_size=16, sample_budget=50_000_000, loader_workers=0,
            warmup_steps=1, vcpus_per_peer=1, final_eval=False, host_sample_interval_s=0.5)
STRATEGY = {
    "single": dict(strategy="single", peers=1),
    "ddp": dict(strategy="ddp", peers=2),
    "collaborative": dict(strategy="collaborative", peers=2,
                          collaborative=dict(target_batch_size=64, matchmaking_time_s=1.0, averaging_timeout_s=10.0,
                                             join_timeout_s=60.0)),
}


# ---------------------------------------------------------------------- helpers
def _sets(values: dict) -> list[str]:
    args = []
    for key, value in values.items():
        pairs = value.items() if isinstance(value, dict) else [(None, value)]
        for sub, v in pairs:
            args += ["--set", f"{key}.{sub}={json.dumps(v)}" if sub else f"{key}={json.dumps(v)}"]
    return args


@dataclass
class Launched:
    """A ``ddlscope`` command started for a case, and what the case saw of it."""

    popen: subprocess.Popen
    db: Path
    tmp: Path
    seen: dict[int, psutil.Process] = field(default_factory=dict)
    run_id: str = ""
    steps_before: int = 0

    def remember_tree(self) -> None:
        """Add every current descendant of the launcher to :attr:`seen`."""
        try:
            for p in psutil.Process(self.popen.pid).children(recursive=True):
                self.seen.setdefault(p.pid, p)
        except psutil.NoSuchProcess:
            pass

    def workers(self) -> list:
        with ResultsStore(self.db) as store:
            return store.workers(self.run_id)

    def output(self) -> str:
        if self.popen.poll() is None:
            return ""
        return self.popen.stdout.read().decode(errors="replace") if self.popen.stdout else ""


@pytest.fixture
def private_tmp():
    """A private, short ``TMPDIR`` for the launcher (Unix socket paths must stay short)."""
    path = Path(tempfile.mkdtemp(prefix="t18-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def launched(env_data, private_tmp):
    """Starts ``ddlscope`` commands; whatever a failed case left is killed at the end."""
    started: list[Launched] = []

    def start(db: Path, strategy: str, command: str = "run", extra: dict | None = None, args: list[str] = ()) -> Launched:
        values = dict(BASE, **STRATEGY[strategy], **(extra or {}))
        cmd = [sys.executable, "-m", "ddlscope", command, *args, "--db", str(db), "--no-progress"]
        if command == "run":
            cmd += _sets(values)
        env = dict(os.environ, TMPDIR=str(private_tmp), PYTHONUNBUFFERED="1")
        popen = subprocess.Popen(cmd, cwd=private_tmp.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        launched = Launched(popen, db, private_tmp)
        started.append(launched)
        return launched

    yield start
    for one in started:
        one.remember_tree()
        for p in [psutil.Process(one.popen.pid)] if one.popen.poll() is None else []:
            p.kill()
        for p in list(one.seen.values()) + _processes_naming(str(one.db)):
            try:
                p.kill()
            except psutil.Error:
                pass
        one.popen.wait()
        if one.popen.stdout:
            one.popen.stdout.close()


def _processes_naming(marker: str) -> list[psutil.Process]:
    """Live (non-zombie) processes whose command line contains ``marker``."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        if p.info["status"] != psutil.STATUS_ZOMBIE and marker in " ".join(p.info["cmdline"] or []):
            found.append(p)
    return found


def _wait_training(run: Launched, workers: int, min_steps: int = 3) -> None:
    """Wait until the run has ``workers`` workers, each training with ``min_steps`` steps stored."""
    deadline = time.monotonic() + START_WAIT_S
    while time.monotonic() < deadline and run.popen.poll() is None:
        run.remember_tree()
        if run.db.exists():
            with ResultsStore(run.db) as store:
                runs = [r for r in store.runs() if r["launcher_pid"] == run.popen.pid]
                if runs:
                    run.run_id = runs[0]["run_id"]
                    counts = store.step_counts(run.run_id)
                    rows = store.workers(run.run_id)
                    if (len(rows) == workers and all(r["status"] == "training" for r in rows)
                            and all(counts.get(i, 0) >= min_steps for i in range(workers))):
                        run.remember_tree()
                        run.steps_before = sum(counts.values())
                        return
        time.sleep(0.3)
    raise AssertionError(f"the run never trained with {workers} workers: {run.output()[-3000:]}")


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _wait_gone(run: Launched) -> None:
    """Wait for the launcher to exit and every process of the run to end; fail naming what is left."""
    try:
        run.popen.wait(timeout=GONE_WAIT_S)
    except subprocess.TimeoutExpired:
        raise AssertionError("the launcher did not exit") from None
    deadline = time.monotonic() + GONE_WAIT_S
    left = []
    while time.monotonic() < deadline:
        left = [p for p in run.seen.values() if _alive(p)] + _processes_naming(str(run.db))
        if not left:
            return
        time.sleep(0.2)
    raise AssertionError(f"processes of the run left: {[p.pid for p in left]}")


def _read(run: Launched) -> dict:
    """The run as the next ``ddlscope runs --json`` reads it (a stale run is marked then)."""
    result = subprocess.run([sys.executable, "-m", "ddlscope", "runs", "--db", str(run.db), "--json"],
                            capture_output=True, text=True, timeout=120, cwd=run.tmp.parent)
    assert result.returncode == 0, result.stderr
    [record] = [r for r in json.loads(result.stdout) if r["run_id"] == run.run_id]
    return record


def _assert_clean(run: Launched, record: dict) -> None:
    """Every step seen before the fault is kept; nothing of the run is left in the temporary folder."""
    with ResultsStore(run.db) as store:
        assert sum(store.step_counts(run.run_id).values()) >= run.steps_before
    assert record["tmp_dir"] and Path(record["tmp_dir"]).parent == run.tmp, record["tmp_dir"]
    assert not Path(record["tmp_dir"]).exists(), sorted(os.listdir(record["tmp_dir"]))
    assert sorted(os.listdir(run.tmp)) == []


def _log_tails(run: Launched, lines: int = 15) -> dict[str, str]:
    """The last ``lines`` lines of each log of the run (what a failed case shows)."""
    logs = sorted((run.db.parent / "logs" / run.run_id).glob("*.log"))
    return {p.name: "\n".join(p.read_text(errors="replace").splitlines()[-lines:]) for p in logs}


def _socket_files(run: Launched) -> list[str]:
    """Paths of the Unix sockets (files, not abstract names) that the launcher's descendants listen on."""
    paths = []
    for proc in list(run.seen.values()):
        try:
            paths += [c.laddr for c in proc.net_connections(kind="unix") if c.laddr and c.laddr.startswith("/")]
        except psutil.Error:
            continue
    return paths


def _target_pid(run: Launched, target: str) -> int:
    rows = run.workers()
    if target == "launcher":
        return run.popen.pid
    if target.startswith("worker"):
        return next(r["pid"] for r in rows if r["worker_index"] == int(target[-1]))
    if target == "p2pd":
        peer = next(r["pid"] for r in rows if r["worker_index"] == 1)
        [daemon] = [p for p in psutil.Process(peer).children(recursive=True) if p.name() == "p2pd"]
        return daemon.pid
    if target == "agent":
        [agent] = [p for p in psutil.Process(run.popen.pid).children() if "--nproc-per-node" in " ".join(p.cmdline())]
        return agent.pid
    raise ValueError(target)


def _hurt(run: Launched, strategy: str, target: str, sig: signal.Signals) -> tuple[int, str]:
    """Check that every socket file of the training run lies in its folder, then send ``sig`` to
    ``target``; return the pid hurt and the run's folder."""
    with ResultsStore(run.db) as store:
        tmp_dir = store.run(run.run_id)["tmp_dir"]
    paths = _socket_files(run)  # every socket file of the run (hivemind's, pymp's, torch's) is in the run's folder
    assert all(p.startswith(tmp_dir + os.sep) for p in paths), (tmp_dir, paths)
    if strategy == "collaborative":
        assert glob.glob(os.path.join(tmp_dir, "hivemind-*.sock")) and paths, os.listdir(tmp_dir)
    pid = _target_pid(run, target)
    os.kill(pid, sig)
    return pid, tmp_dir


def _check_outcome(run: Launched, target: str, pid: int, tmp_dir: str, status: str, fragments: list[str]) -> dict:
    """After :func:`_hurt`: the run ends with ``status`` and a reason holding every fragment, its
    workers are all stopped (the one killed ``failed`` when the run failed), nothing is left."""
    _wait_gone(run)
    if target == "launcher":  # the workers of a killed launcher removed the run's folder themselves, before any read
        assert not Path(tmp_dir).exists(), sorted(os.listdir(tmp_dir))
    output = run.output()
    assert "Traceback" not in output, output[-3000:]
    record = _read(run)
    assert record["status"] == status, (record["reason"], record["workers"], _log_tails(run))
    for fragment in fragments:
        assert fragment.format(pid=pid) in record["reason"], record["reason"]
    assert all(w["status"] not in ("starting", "training") for w in record["workers"]), record["workers"]
    if target.startswith("worker") and status == "failed":
        [hurt] = [w for w in record["workers"] if w["worker_index"] == int(target[-1])]
        assert hurt["status"] == "failed", record["workers"]
    _assert_clean(run, record)
    return record


# ---------------------------------------------------------------------- the matrix
LAUNCHER_DIED = "launcher (pid {pid}) died without stopping the run"

MATRIX = [
    # (strategy, target, signal, status, reason fragments); a single run's launcher killed by SIGKILL is in
    # test_two_runs_on_one_store_one_launcher_killed, a collaborative launcher stopped by SIGINT (the handler
    # of SIGTERM and SIGHUP too) in test_ctrl_c_stops_every_peer_at_its_next_step
    ("single", "launcher", "SIGTERM", "interrupted", ["interrupted: the launcher received SIGTERM"]),
    ("single", "launcher", "SIGHUP", "interrupted", ["interrupted: the launcher received SIGHUP"]),
    ("single", "worker0", "SIGKILL", "failed", ["worker 0 killed by SIGKILL"]),
    # a crash in native code: the worker's log has every thread's Python stack (faulthandler)
    ("single", "worker0", "SIGSEGV", "failed", ["worker 0 killed by SIGSEGV"]),
    ("single", "worker0", "SIGTERM", "interrupted", ["worker 0 stopped by SIGTERM"]),
    ("ddp", "launcher", "SIGKILL", "interrupted", [LAUNCHER_DIED]),
    ("ddp", "launcher", "SIGTERM", "interrupted", ["interrupted: the launcher received SIGTERM"]),
    ("ddp", "worker1", "SIGKILL", "failed", ["worker 1 died", "killed by SIGKILL"]),
    ("ddp", "worker1", "SIGTERM", "interrupted", ["worker 1 stopped by SIGTERM (not sent by the launcher)"]),
    ("ddp", "agent", "SIGKILL", "failed", ["torchrun agent", "killed by SIGKILL"]),
    ("ddp", "agent", "SIGTERM", "interrupted", ["torchrun agent (pid {pid}) was stopped", "stopped by SIGTERM"]),
    ("collaborative", "launcher", "SIGKILL", "interrupted", [LAUNCHER_DIED]),
    ("collaborative", "worker1", "SIGKILL", "failed", ["peer 1 killed by SIGKILL"]),
    # (a peer whose unwinding outlasts its grace period is then ended by its own backstop: "peer 1 stopped by
    # SIGTERM (forced after grace period) (not sent by the launcher; then killed by SIGKILL ...)"; once in CI)
    ("collaborative", "worker1", "SIGTERM", "interrupted", ["peer 1 stopped by SIGTERM", "(not sent by the launcher"]),
    ("collaborative", "p2pd", "SIGKILL", "failed", ["peer 1's p2pd daemon", "ended during training"]),
]


@slow
@pytest.mark.parametrize("strategy, target, sig, status, fragments", MATRIX,
                         ids=[f"{s}-{t}-{g}" for s, t, g, *_ in MATRIX])
def test_a_signal_to_any_process_ends_the_run_with_its_reason_and_leaves_nothing(
        launched, tmp_path, strategy, target, sig, status, fragments):
    run = launched(tmp_path / "r" / "ddlscope.db", strategy)
    _wait_training(run, STRATEGY[strategy]["peers"])
    pid, tmp_dir = _hurt(run, strategy, target, getattr(signal, sig))
    _check_outcome(run, target, pid, tmp_dir, status, fragments)
    if sig == "SIGSEGV":
        log = _log_tails(run, 200)[f"{target.replace('worker', 'worker-')}.log"]
        assert "Fatal Python error: Segmentation fault" in log and "most recent call first" in log, log[-3000:]


@slow
def test_ctrl_c_stops_every_peer_at_its_next_step(launched, tmp_path):
    """Ctrl-C: the peers stop at the step they are in (hivemind swallows the stop inside its step; the
    strategy stops at the step's end), not after the forced kill: no peer records a forced stop."""
    run = launched(tmp_path / "r" / "ddlscope.db", "collaborative")
    _wait_training(run, 2)
    pid, tmp_dir = _hurt(run, "collaborative", "launcher", signal.SIGINT)
    record = _check_outcome(run, "launcher", pid, tmp_dir, "interrupted", ["interrupted by the user (Ctrl-C)"])
    assert run.popen.returncode == 130
    assert record["reason"] == "interrupted by the user (Ctrl-C)"
    reasons = [w["reason"] for w in record["workers"]]
    # not "... (forced after grace period)"; a forced peer's log says where its main thread was
    logs = "\n".join(f"--- {name}\n{tail}" for name, tail in _log_tails(run, 40).items())
    assert reasons == ["stopped by SIGTERM", "stopped by SIGTERM"], f"{reasons}\n{logs}"  # a string: shown whole


def test_a_stop_ends_hivemind_s_state_download_instead_of_being_retried():
    """hivemind 1.1.12's ``Optimizer.load_state_from_peers`` retries on every exception but ``KeyboardInterrupt``:
    the worker's stop must be one, or a peer stopped while it downloads the swarm's state waits out its grace
    period (in CI: "stopped by SIGTERM (forced after grace period)"). Runs hivemind's own method on stand-ins."""
    import contextlib
    import logging
    from types import SimpleNamespace

    from hivemind.optim.optimizer import Optimizer

    from ddlscope.train.worker import Interrupted

    calls = []

    def load_state_from_peers(**kwargs):
        calls.append(kwargs)
        if len(calls) == 1:
            raise Interrupted("SIGTERM")  # what the worker's handler raises in the main thread, waiting here

    opt = SimpleNamespace(scheduled_grads=None, grad_averager=None, load_state_timeout=1.0, local_epoch=0,
                          client_mode=True, use_gradient_averaging=False, status_loglevel=logging.DEBUG,
                          state_averager=SimpleNamespace(step=lambda **kwargs: None,
                                                         load_state_from_peers=load_state_from_peers),
                          tracker=SimpleNamespace(pause_updates=contextlib.nullcontext, global_epoch=0,
                                                  report_local_progress=lambda **kwargs: None))
    with pytest.raises(Interrupted):
        Optimizer.load_state_from_peers(opt)
    assert len(calls) == 1  # not retried


STUCK_WORKER = """
import os, signal, sys, time
import ddlscope.train.worker as worker

worker.GRACE_S = 0.5
signal.signal(signal.SIGTERM, worker._stop_handler(lambda: print("recorded", flush=True)))

def a_library_that_swallows_every_exception():
    ready = False
    while True:
        try:
            if not ready:  # said inside the try: a SIGTERM right after "ready" must meet the swallowing library
                ready = True  # (said before it, the stop once landed between the print and the call: exit 1, CI)
                print("ready", flush=True)
            time.sleep(10)
        except BaseException:
            continue

a_library_that_swallows_every_exception()
"""


def _sigterm_once_ready(script: str, *args: str) -> tuple[subprocess.Popen, str, str]:
    """Run ``script`` (Python) in its own session (the backstop SIGKILLs its own process group), SIGTERM it once
    it prints "ready", and return it ended with its stdout and stderr."""
    proc = subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    return proc, out, err


def test_a_worker_that_ignores_its_stop_says_where_it_was_and_is_killed():
    proc, out, err = _sigterm_once_ready(STUCK_WORKER)
    assert proc.returncode == -signal.SIGKILL
    assert out.strip() == "recorded"  # the status is recorded before the kill
    assert "did not stop within 0.5 s of SIGTERM; its main thread was at:" in err, err
    assert err.rstrip().splitlines()[-1].endswith("in a_library_that_swallows_every_exception"), err  # innermost last


SLOW_EXIT_WORKER = """
import sys, time
import ddlscope.train.worker as worker

worker.GRACE_S = 0.5

def train(store, run_id, worker_index, *args):  # stops at the signal and records it, as a strategy would
    print("ready", flush=True)
    try:
        time.sleep(30)
    except worker.Interrupted:
        return worker._record(store, store.path, run_id, worker_index, "interrupted", "stopped by SIGTERM", 130,
                              worker.LauncherWatch(None, None))

worker._train = train
code = worker.serve_worker(sys.argv[1], "r1", 0, 1, [0], [])
print("returned", code, flush=True)
time.sleep(30)  # an exit that outlasts the grace period (children, threads that will not end)
"""


def test_a_worker_that_recorded_its_stop_keeps_its_reason_when_its_exit_overruns(tmp_path):
    """The grace period's backstop kills a worker whose exit overruns, but the stop it recorded in time stays:
    not rewritten as "(forced after grace period)"."""
    db = tmp_path / "ddlscope.db"
    ResultsStore(db).close()
    proc, out, err = _sigterm_once_ready(SLOW_EXIT_WORKER, str(db))
    assert proc.returncode == -signal.SIGKILL, (out, err)
    assert out.splitlines()[-1] == "returned 130", out
    assert "status recorded" in err and "s after SIGTERM" in err, err
    assert "recorded its stop within 0.5 s; its exit did not end in time" in err, err
    with ResultsStore(db) as store:
        (row,) = store.workers("r1")
    assert (row["status"], row["reason"]) == ("interrupted", "stopped by SIGTERM")


@slow
def test_sigterm_to_a_sweep_interrupts_the_cell_that_runs(launched, tmp_path):
    grid = tmp_path / "grid.toml"
    grid.write_text('[base]\nmodel = "tiny_cnn"\ndataset = "digits"\nsample_budget = 50000000\nloader_workers = 0\n'
                    'final_eval = false\nvcpus_per_peer = 1\n[axes]\nbatch_size = [16, 32]\n')
    run = launched(tmp_path / "r" / "ddlscope.db", "single", command="sweep", args=[str(grid)])
    _wait_training(run, 1)
    run.popen.send_signal(signal.SIGTERM)
    _wait_gone(run)
    assert run.popen.returncode == 130, run.output()[-3000:]
    record = _read(run)
    assert record["status"] == "interrupted" and "the launcher received SIGTERM" in record["reason"], record
    with ResultsStore(run.db) as store:
        assert len(store.runs()) == 1  # the sweep stopped: the second cell never started
    _assert_clean(run, record)


@slow
def test_two_runs_on_one_store_one_launcher_killed(launched, tmp_path):
    """Two runs write to one store at once; killing one's launcher ends that run alone, the other completes."""
    db = tmp_path / "r" / "ddlscope.db"
    killed = launched(db, "single")
    _wait_training(killed, 1)
    # a short run: commits every 0.1 s so that its steps are seen while it trains
    other = launched(db, "single", extra=dict(sample_budget=16 * 200, store_flush_interval_s=0.1))
    _wait_training(other, 1, min_steps=1)
    pid, tmp_dir = _hurt(killed, "single", "launcher", signal.SIGKILL)
    _wait_gone(other)  # first: the private temporary folder the two runs share is empty only then
    assert other.popen.returncode == 0, other.output()[-3000:]
    _check_outcome(killed, "launcher", pid, tmp_dir, "interrupted", [LAUNCHER_DIED, "SIGKILL"])
    second = _read(other)
    assert second["status"] == "completed", second
    with ResultsStore(db) as store:
        assert store.step_counts(other.run_id) == {0: 200}
        assert store.run(killed.run_id)["status"] == "interrupted"  # the other run's launcher did not touch it
    _assert_clean(other, second)


@slow
def test_a_removed_store_stops_the_run_with_one_error_line(launched, tmp_path):
    run = launched(tmp_path / "r" / "ddlscope.db", "single")
    _wait_training(run, 1)
    with ResultsStore(run.db) as store:
        tmp_dir = store.run(run.run_id)["tmp_dir"]
    for path in glob.glob(str(run.db) + "*"):
        os.remove(path)
    _wait_gone(run)
    output = run.output().strip().splitlines()
    assert run.popen.returncode == 2 and output[-1].startswith("error: the results store ") and \
        "was removed or replaced" in output[-1], output
    assert not any("Traceback" in line for line in output), output
    assert not Path(tmp_dir).exists() and os.listdir(run.tmp) == []
    assert not run.db.exists()  # nothing made a new, empty store in its place


@pytest.fixture
def full_disk(tmp_path):
    """A 4 MiB tmpfs (needs root); filled by the test with :func:`_fill`."""
    mount = tmp_path / "small"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (root needed): {made.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def _fill(folder: Path) -> None:
    """Write zeros to ``folder/filler`` until its filesystem is full."""
    fd = os.open(folder / "filler", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        while True:
            os.write(fd, bytes(64 * 1024))
    except OSError:
        pass
    finally:
        os.close(fd)
    assert shutil.disk_usage(folder).free < 64 * 1024


@slow
@pytest.mark.parametrize("strategy", ["single", "collaborative"])
def test_a_full_disk_fails_the_run_with_disk_full_and_one_error_line(launched, full_disk, strategy):
    run = launched(full_disk / "r" / "ddlscope.db", strategy)
    _wait_training(run, STRATEGY[strategy]["peers"])
    _fill(full_disk)
    _wait_gone(run)
    lines = run.output().strip().splitlines()
    assert run.popen.returncode == 2, lines
    assert lines[-1].startswith(f"error: disk full writing {run.db}"), lines
    assert not any("Traceback" in line for line in lines), lines
    (full_disk / "filler").unlink()
    record = _read(run)
    assert record["status"] == "failed" and record["reason"].startswith(f"disk full writing {run.db}: "), record
    assert all(w["status"] == "failed" for w in record["workers"]), record["workers"]
    _assert_clean(run, record)


# ---------------------------------------------------------------------- without processes
def test_a_stale_run_on_a_store_that_cannot_be_written_is_still_recognised(db_path, tmp_path):
    """The next read tells a run whose processes are gone even when it cannot write that down; its temporary
    folder goes."""
    folder = Path(tempfile.mkdtemp(prefix="ddlscope-run-", dir=tmp_path))
    (folder / "hivemind-p2pclient-x.sock").write_text("")
    with ResultsStore(db_path) as store:
        run_id = store.create_run("x", "single", {})
        store.set_tmp_dir(run_id, folder)
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        store.conn.execute("UPDATE runs SET launcher_pid = ?, launcher_started_at = NULL WHERE run_id = ?",
                           (dead.pid, run_id))
    with ResultsStore(db_path) as store:
        store.conn.execute("PRAGMA query_only = ON")  # every write fails, as on a full disk or a read-only file
        assert store.mark_stale_runs() == [run_id]
        assert store.run(run_id)["status"] == "running"
    assert not folder.exists()
    with ResultsStore(db_path) as store:
        assert store.mark_stale_runs() == [run_id] and store.run(run_id)["status"] == "interrupted"


def test_remove_run_temp_dir_removes_only_run_folders(tmp_path):
    other = tmp_path / "not-a-run"
    other.mkdir()
    remove_run_temp_dir(other)
    remove_run_temp_dir(None)
    assert other.exists()
    run_dir = Path(tempfile.mkdtemp(prefix="ddlscope-run-", dir=tmp_path))
    (run_dir / "pymp-x").mkdir()
    remove_run_temp_dir(run_dir)
    assert not run_dir.exists()


def test_a_peer_that_failed_and_then_aborted_on_its_way_out_keeps_its_reason(tmp_path):
    """Seen once in CI: after its p2pd was killed, peer 1 recorded why it failed, and then hivemind's shutdown
    aborted the process (``std::system_error: Broken pipe``, SIGABRT). The run's reason names the failure, not
    only the signal; a peer killed without a recorded reason is still "killed by SIGKILL"."""
    from types import SimpleNamespace

    from ddlscope.launch.local import LocalLauncher, WorkerProcess

    launcher = object.__new__(LocalLauncher)
    launcher.cfg = SimpleNamespace(distribution_model=SimpleNamespace(launcher="swarm"))
    rows = {1: {"worker_index": 1, "status": "failed", "reason": "peer 1's p2pd daemon (pid 7) ended during training"},
            0: {"worker_index": 0, "status": "running", "reason": None}}
    store = SimpleNamespace(workers=lambda run_id: list(rows.values()))
    launcher.workers = [WorkerProcess(i, [i], SimpleNamespace(returncode=code, pid=100 + i), tmp_path / f"w{i}.log")
                        for i, code in ((0, -signal.SIGKILL), (1, -signal.SIGABRT))]
    status, reason = launcher._failure(store, "r", 1)
    assert status == "failed" and reason.startswith("peer 1 failed: peer 1's p2pd daemon (pid 7) ended during training")
    assert "then killed by SIGABRT on its way out" in reason
    assert launcher._failure(store, "r", 0) == ("failed", f"peer 0 killed by SIGKILL (log: {tmp_path / 'w0.log'})")
    # one that recorded a stop by a signal not from the launcher, then was ended by its own backstop, was interrupted
    rows[0] = {"worker_index": 0, "status": "interrupted", "reason": "stopped by SIGTERM (forced after grace period)"}
    status, reason = launcher._failure(store, "r", 0)
    assert status == "interrupted", reason
    assert reason.startswith("peer 0 stopped by SIGTERM (forced after grace period) (not sent by the launcher; "
                             "then killed by SIGKILL on its way out"), reason



def test_a_stop_while_a_process_starts_waits_until_it_is_recorded_and_the_child_does_not_hold_stops():
    """Seen once in CI: SIGTERM reached ``ddlscope validate`` while its launcher started torchrun's agent, and
    the agent was still running after the command had exited. A stop that comes while a process starts is
    held until the process is recorded, then acts as the handler before it would have; the child is started
    with the default handlers, not the holding one."""
    started = []
    # what was in place before: Python's Ctrl-C handler, or SIG_IGN where the suite was started in the background
    # by a shell without job control (which ignores SIGINT for it)
    sigint_before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        with sigterm_as_interrupt():
            with stop_signals_held():
                os.kill(os.getpid(), signal.SIGTERM)  # as if it came inside Popen
                time.sleep(0.05)  # handlers run between bytecodes: it would have raised by now
                child = subprocess.Popen([sys.executable, "-c", "import signal; print(signal.getsignal(signal.SIGTERM) "
                                          "== signal.SIG_DFL, signal.getsignal(signal.SIGINT) is "
                                          "signal.default_int_handler)"], stdout=subprocess.PIPE, text=True)
                started.append(child)
    assert len(started) == 1  # recorded: whoever stops the processes knows it
    assert started[0].communicate(timeout=60)[0].split() == ["True", "True"]
    assert signal.getsignal(signal.SIGINT) is sigint_before  # the handlers before are back
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    with stop_signals_held():  # no stop: nothing happens after the block
        pass


class _StoppedInDel:
    """An object whose ``__del__`` sends this process SIGTERM and runs on, so the handler raises inside
    ``__del__``, where Python swallows the exception (as it did once in an import's weakref callback)."""

    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(100_000):  # the handler runs between these bytecodes
            pass


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_stop_that_python_swallowed_is_raised_again():
    """Seen once: SIGTERM reached ``ddlscope validate`` inside an import's module-lock callback; the stop was
    "ignored" and the validation ran to its end. A swallowed stop is raised again at the next line, by
    ``sigterm_as_interrupt`` and by the launcher's handlers (there as a :class:`LauncherSignal`)."""
    from ddlscope.launch.local import LauncherSignal, LocalLauncher

    launcher = object.__new__(LocalLauncher)
    launcher._stopping = False
    for stops, raised in ((sigterm_as_interrupt, KeyboardInterrupt), (launcher._stop_signals, LauncherSignal)):
        reached = []  # (the launcher ignores stops once it raised one: it raises the one sent again all the same)
        with pytest.raises(raised) as caught:
            with stops():
                _StoppedInDel()  # dropped at once: its __del__ runs here and the stop is swallowed
                reached.append("after the swallowed stop")
                t0 = time.monotonic()
                time.sleep(2)
                reached.append("the stop was lost")
        assert reached == ["after the swallowed stop"]
        assert time.monotonic() - t0 < 2  # a real signal again: the blocking call was cut short
        assert caught.value.args == ("SIGTERM",)
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    # nested (a launcher inside ``validate``'s sigterm_as_interrupt): the stop is sent again once, not twice
    launcher._stopping = False
    try:
        with sigterm_as_interrupt():
            with pytest.raises(LauncherSignal):
                with launcher._stop_signals():
                    _StoppedInDel()
                    time.sleep(2)
            time.sleep(0.5)  # a second stop sent would raise here
    except KeyboardInterrupt:
        pytest.fail("the swallowed stop was sent again twice")


def test_a_worker_stopped_before_torchrun_stopped_the_others_is_named_not_the_agent(tmp_path):
    """Seen once in CI: worker 1 was sent SIGTERM, and torchrun's agent stopped worker 0 with SIGTERM before
    worker 0's next collective failed, so both recorded "stopped by SIGTERM". The run names the worker stopped
    first; only an agent whose log says it received a stop signal is named as the one stopped."""
    from types import SimpleNamespace

    from ddlscope.launch.local import _first_failure

    rows = [{"worker_index": 0, "status": "interrupted", "reason": "stopped by SIGTERM", "failed_at": 102.5},
            {"worker_index": 1, "status": "interrupted", "reason": "stopped by SIGTERM", "failed_at": 102.1}]
    log = tmp_path / "agent.log"
    log.write_text("WARNING:torch.distributed.elastic.multiprocessing.api:Sending process 11 closing signal SIGTERM\n")
    agent = SimpleNamespace(popen=SimpleNamespace(returncode=1, pid=10), log_path=log)
    assert _first_failure(rows, 2, agent) == (
        "interrupted", "worker 1 stopped by SIGTERM (not sent by the launcher); the others stopped with it")
    log.write_text("WARNING:torch.distributed.elastic.agent.server.api:Received Signals.SIGTERM death signal, "
                   "shutting down workers\n")
    assert _first_failure(rows, 2, agent) == (
        "interrupted", "torchrun agent (pid 10) was stopped (exit code 1, not by the launcher); its workers: "
                       "stopped by SIGTERM")


def test_a_worker_that_failed_before_torchrun_stopped_the_other_is_named_as_the_runs_failure(tmp_path):
    """Seen in CI (2026-12-06): worker 1 raised, and torchrun's agent stopped worker 0 with SIGTERM before worker
    0's next collective failed. The run failed with worker 1's reason; a worker stopped first still wins."""
    from types import SimpleNamespace

    from ddlscope.launch.local import _first_failure

    rows = [{"worker_index": 0, "status": "interrupted", "reason": "stopped by SIGTERM", "failed_at": 102.5},
            {"worker_index": 1, "status": "failed", "reason": "ValueError: injected failure on rank 1",
             "failed_at": 102.1}]
    log = tmp_path / "agent.log"
    log.write_text("WARNING:torch.distributed.elastic.multiprocessing.api:Sending process 11 closing signal SIGTERM\n")
    agent = SimpleNamespace(popen=SimpleNamespace(returncode=1, pid=10), log_path=log)
    assert _first_failure(rows, 2, agent) == ("failed", "worker 1 failed: ValueError: injected failure on rank 1")
    rows[1]["failed_at"] = 102.9  # the stop came first: the failure was the lost peer's
    assert _first_failure(rows, 2, agent) == (
        "interrupted", "worker 0 stopped by SIGTERM (not sent by the launcher); the others stopped with it")

_SHARER = """
import subprocess, psutil, torch, torch.multiprocessing as mp
from ddlscope.launch.processes import SHM_MANAGER, end_children
mp.set_sharing_strategy("file_system")  # as hivemind sets it
shared = torch.zeros(1000).share_memory_()  # starts torch's shm manager
other = subprocess.Popen(["sleep", "60"])
manager = next(c for c in psutil.Process().children(recursive=True) if c.name() == SHM_MANAGER)
end_children()
other.wait(10)
del shared  # a shared tensor freed after end_children: the manager must still be there
print(manager.pid, other.returncode, manager.is_running(), flush=True)
"""


def test_end_children_kills_every_child_but_torchs_shm_manager_which_ends_after_the_process():
    done = subprocess.run([sys.executable, "-c", _SHARER], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    manager_pid, other_code, alive = done.stdout.split()
    assert other_code == str(-signal.SIGKILL) and alive == "True"
    deadline = time.monotonic() + 20
    while psutil.pid_exists(int(manager_pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    manager = psutil.Process(int(manager_pid)) if psutil.pid_exists(int(manager_pid)) else None
    assert manager is None or manager.status() == psutil.STATUS_ZOMBIE or manager.name() != SHM_MANAGER


_OWNER = """
import subprocess, sys, time
orphan = subprocess.run(["sh", "-c", "sleep 60 > /dev/null 2>&1 & echo $!"], capture_output=True, text=True).stdout.strip()
child = subprocess.Popen(["sleep", "61"])
print(orphan, child.pid, flush=True)
time.sleep(60)
"""


def test_the_reaper_ends_a_dead_commands_descendants_and_its_groups_orphans_but_not_a_pipeline_neighbour():
    """`leftovers` after a SIGKILL: the noted child, the orphan born in the command's process group (a
    grandchild whose parent exited, never a descendant when noted), but not a process of the same group whose
    parent is the command's parent (``tee`` in ``ddlscope peer | tee log``)."""
    from ddlscope.launch.reaper import end, leftovers, note_descendants

    owner = subprocess.Popen([sys.executable, "-c", _OWNER], stdout=subprocess.PIPE, text=True, process_group=0)
    neighbour = subprocess.Popen(["sleep", "62"], process_group=owner.pid)
    try:
        orphan_pid, child_pid = (int(p) for p in owner.stdout.readline().split())
        started_at = psutil.Process(owner.pid).create_time()
        noted: dict[int, float] = {}
        note_descendants(owner.pid, noted)
        assert child_pid in noted and orphan_pid not in noted
        owner.kill()
        owner.wait(10)
        left = leftovers(owner.pid, started_at, owner.pid, os.getpid(), noted)
        assert {p.pid for p in left} == {orphan_pid, child_pid}
        assert end(left, grace_s=5) == 2
        assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in left)
        assert neighbour.poll() is None
    finally:
        neighbour.kill()
        owner.kill()
        for pid in (orphan_pid, child_pid) if "child_pid" in locals() else ():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        neighbour.wait(10)


def test_the_reaper_finds_p2pds_socket_files_and_removes_only_sockets(tmp_path):
    import socket

    from ddlscope.launch.reaper import remove_sockets

    class Proc:
        def __init__(self, args):
            self.args = args

        def cmdline(self):
            if self.args is None:
                raise psutil.NoSuchProcess(1)
            return self.args

    daemon = tmp_path / "hivemind-p2pd-abc.sock"
    files = hivemind_socket_files([Proc(["p2pd", "-hostAddrs=/ip4/127.0.0.1/tcp/0", f"-listen=/unix{daemon}"]),
                                   Proc(["python", "-m", "ddlscope.cli", "bootstrap"]), Proc(None)])
    assert files == [daemon, tmp_path / "hivemind-p2pclient-abc.sock"]
    for f in files:
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(str(f))
    plain = tmp_path / "hivemind-p2pd-plain.sock"
    plain.write_text("not a socket")
    assert remove_sockets([*files, plain, tmp_path / "missing.sock"]) == 2
    assert not any(f.exists() for f in files) and plain.exists()


def test_a_standalone_bootstrap_killed_by_sigkill_leaves_no_dht_process_or_p2pd(tmp_path):
    """`ddlscope bootstrap` typed in a shell (its own process group) and killed by SIGKILL: its reaper ends
    hivemind's DHT process and p2pd, which would otherwise run on under init (``peer`` and ``serve-experts``
    start the same reaper)."""
    log = tmp_path / "bootstrap.log"
    with open(log, "w") as out:
        cmd = subprocess.Popen([sys.executable, "-m", "ddlscope.cli", "bootstrap"], stdout=out, stderr=subprocess.STDOUT,
                               start_new_session=True)
    seen: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 60
        while "/p2p/" not in log.read_text() and cmd.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "/p2p/" in log.read_text(), log.read_text()[-2000:]
        seen = psutil.Process(cmd.pid).children(recursive=True)  # the DHT process, p2pd and the reaper
        assert {"p2pd"} <= {p.name() for p in seen}
        sockets = [f for f in hivemind_socket_files(seen) if f.exists()]
        assert sockets  # p2pd's own socket file at least
        cmd.kill()
        cmd.wait(10)
        _, alive = psutil.wait_procs(seen, timeout=GONE_WAIT_S)
        assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], [p.cmdline() for p in alive]
        assert "ending the" in log.read_text()
        assert not [f for f in sockets if f.exists()]  # a killed p2pd leaves its socket file: the reaper removes it
    finally:
        cmd.kill()
        for p in seen:  # a failed test leaves nothing behind; torch's shm manager unlinks its segments and ends
            try:
                if not is_shm_manager(p.pid):
                    p.kill()
            except psutil.Error:
                pass
