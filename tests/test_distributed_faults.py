"""The torch.distributed distribution models end to end: real torchrun runs, bad input, a worker that dies.

Every run here starts one torchrun agent and 2 worker processes (seconds of start-up each on
2 cores), trains the tiny CNN on the synthetic MNIST with one thread and no loader workers per
worker, and checks what the results store holds. Bad input must be refused before any process
starts; a worker that raises must fail the run naming it. A worker killed mid-run is a case of
tests/test_faults.py's matrix.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from ddlscope.analyze.compare import summarize_run
from ddlscope.config import validate_config
from ddlscope.errors import UserError
from ddlscope.launch.local import run_local
from ddlscope.store.db import ResultsStore
from tests.conftest import tiny_run

slow = pytest.mark.slow  # starts torchrun and workers (seconds each); the input checks below start nothing

TWO = dict(peers=2, vcpus_per_peer=1, final_eval=False)
LAUNCH_PATTERNS = ("ddlscope.train.worker", "torch.distributed.run")


# ---------------------------------------------------------------------- helpers
def _launched_processes(marker: str) -> list[psutil.Process]:
    """Live (non-zombie) worker or torchrun processes whose command line mentions ``marker`` (the run's db path)."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if p.info["status"] != psutil.STATUS_ZOMBIE and marker in cmd and any(s in cmd for s in LAUNCH_PATTERNS):
            found.append(p)
    return found


def _kill_launched(marker: str) -> None:
    """Clean-up after a failed assertion: SIGKILL whatever this test started that is still there."""
    for p in _launched_processes(marker):
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def _assert_nothing_left(store: ResultsStore, run_id: str, marker: str, before: set[int]) -> None:
    for w in store.workers(run_id):
        assert w["status"] not in ("starting", "training"), f"worker {w['worker_index']} left in {w['status']!r}"
        if w["pid"] and psutil.pid_exists(w["pid"]):
            assert psutil.Process(w["pid"]).status() == psutil.STATUS_ZOMBIE, f"worker {w['worker_index']} still runs"
    leftovers = [p for p in _launched_processes(marker) if p.pid not in before]
    assert not leftovers, [" ".join(p.cmdline()) for p in leftovers]


def _non_warmup(steps: list[dict], worker: int) -> list[dict]:
    return [s for s in steps if s["worker_index"] == worker and not s["warmup"]]


def _throughput(steps: list[dict], worker: int) -> float:
    """Samples per second of one worker's non-warm-up steps, computed here from the stored rows."""
    timed = _non_warmup(steps, worker)
    return sum(s["samples"] for s in timed) / sum(s["step_s"] for s in timed)


def _tiny_cnn_param_bytes() -> int:
    from ddlscope.workloads.models import build_model

    return sum(p.numel() * p.element_size() for p in build_model("tiny_cnn", "mnist").parameters())


def _stored_runs(db: Path) -> list:
    """Runs in the results database (none when it was never created)."""
    if not db.exists():
        return []
    with ResultsStore(db) as store:
        return store.runs()


def _cli(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ddlscope", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ))


@pytest.fixture
def spawned(monkeypatch) -> list[list[str]]:
    """Command lines of every process started through ``subprocess.Popen`` during the test."""
    calls: list[list[str]] = []
    real = subprocess.Popen

    class Spy(real):
        def __init__(self, args, *a, **kw):
            calls.append(list(args) if not isinstance(args, (str, bytes)) else [args])
            super().__init__(args, *a, **kw)

    monkeypatch.setattr(subprocess, "Popen", Spy)
    return calls


@pytest.fixture
def busy_port():
    """A port on 127.0.0.1 that another socket holds (bound and listening)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield s.getsockname()[1]


# ---------------------------------------------------------------------- 1. the run path
@slow
def test_ddp_run_stores_every_step_with_communication(env_data, db_path):
    cfg = validate_config(tiny_run(strategy="ddp", **TWO))
    run_id = run_local(cfg, db_path, progress=False)
    with ResultsStore(db_path) as store:
        run = store.run(run_id)
        assert run["status"] == "completed", run["reason"]
        steps = store.rows("steps", run_id)
        n = cfg.max_steps_per_peer()
        assert n == 10  # 320 samples / (2 workers x 16)
        for w in (0, 1):
            assert [s["step"] for s in steps if s["worker_index"] == w] == list(range(n))
        grad_bytes = _tiny_cnn_param_bytes()
        for w in (0, 1):
            timed = _non_warmup(steps, w)
            assert len(timed) == n - cfg.warmup_steps
            for s in timed:
                assert s["comm_s"] > 0, s
                assert s["comm_bytes"] == grad_bytes, s  # one all-reduce of every float32 gradient per step
                assert s["bubble_s"] == 0 and s["loss"] is not None and s["samples"] == 16
        by_step = {(s["worker_index"], s["step"]): s["comm_bytes"] for s in steps}
        assert all(by_step[(0, i)] == by_step[(1, i)] for i in range(n))  # same gradients, same payload
        workers = store.rows("workers", run_id)
        assert [w["worker_index"] for w in workers] == [0, 1]
        assert all(w["status"] == "completed" and w["peak_memory_bytes"] > 0 for w in workers), workers
        assert workers[0]["pid"] != workers[1]["pid"]
        summary = summarize_run(store, run_id)
        assert summary.samples == cfg.sample_budget  # data parallel: the workers' samples add up
        assert summary.throughput_samples_per_s == pytest.approx(_throughput(steps, 0) + _throughput(steps, 1))
        assert all(w.mean_comm_bytes == grad_bytes for w in summary.workers)
        _assert_nothing_left(store, run_id, str(db_path), set())


@slow
def test_gpipe_run_stores_bubbles_loss_on_last_stage_and_counts_samples_once(env_data, db_path):
    cfg = validate_config(tiny_run(strategy="gpipe", distributed=dict(microbatches=2), **TWO))
    run_id = run_local(cfg, db_path, progress=False)
    with ResultsStore(db_path) as store:
        run = store.run(run_id)
        assert run["status"] == "completed", run["reason"]
        steps = store.rows("steps", run_id)
        n = cfg.max_steps_per_peer()
        assert n == 20  # every stage processes every batch: 320 / 16
        for w in (0, 1):
            mine = [s for s in steps if s["worker_index"] == w]
            assert [s["step"] for s in mine] == list(range(n))
            assert all(s["bubble_s"] is not None and s["bubble_s"] >= 0 for s in mine)
            assert all(s["comm_bytes"] > 0 for s in mine)
        first = [s for s in steps if s["worker_index"] == 0]
        last = [s for s in steps if s["worker_index"] == 1]
        assert all(s["loss"] is None and s["accuracy"] is None for s in first)  # stage 0 never sees logits
        assert all(s["loss"] is not None and s["loss"] > 0 for s in last)
        # stage 0 sends activations and receives their gradients; stage 1 the other way round
        assert [s["comm_bytes"] for s in first] == [s["comm_bytes"] for s in last]
        details = [e for e in store.rows("events", run_id) if e["kind"] == "strategy_details"]
        assert {e["worker_index"] for e in details} == {0, 1}
        for e in details:
            bounds = json.loads(e["detail_json"])["stage_bounds"]
            assert len(bounds) == 3 and bounds[0] == 0 and bounds[-1] == 4 and bounds[0] < bounds[1] < bounds[2]
        summary = summarize_run(store, run_id)
        assert summary.samples == cfg.sample_budget == 320  # one stage's samples, not 640
        assert summary.throughput_samples_per_s == pytest.approx(min(_throughput(steps, 0), _throughput(steps, 1)))
        assert all(w["peak_memory_bytes"] > 0 for w in store.workers(run_id))
        _assert_nothing_left(store, run_id, str(db_path), set())


@slow
@pytest.mark.parametrize("strategy, extra", [("fsdp", {}), ("1f1b", dict(distributed=dict(microbatches=2)))])
def test_fsdp_and_1f1b_runs_complete(env_data, db_path, strategy, extra):
    cfg = validate_config(tiny_run(strategy=strategy, sample_budget=160, **extra, **TWO))
    run_id = run_local(cfg, db_path, progress=False)
    with ResultsStore(db_path) as store:
        run = store.run(run_id)
        assert run["status"] == "completed", run["reason"]
        steps = store.rows("steps", run_id)
        for w in (0, 1):
            assert [s["step"] for s in steps if s["worker_index"] == w] == list(range(cfg.max_steps_per_peer()))
            assert all(s["comm_bytes"] > 0 for s in _non_warmup(steps, w))
        if strategy == "fsdp":  # every worker all-gathers and reduce-scatters its own shard: equal payloads
            assert all(s["comm_s"] > 0 for s in _non_warmup(steps, 0) + _non_warmup(steps, 1))
            assert {s["comm_bytes"] for s in steps if s["worker_index"] == 0} == \
                {s["comm_bytes"] for s in steps if s["worker_index"] == 1}
        _assert_nothing_left(store, run_id, str(db_path), set())


# ---------------------------------------------------------------------- 2. bad input, refused before anything starts
@pytest.mark.parametrize("values, expected", [
    (dict(strategy="gpipe", peers=2, distributed=dict(microbatches=3)),
     ["distributed.microbatches = 3", "batch_size = 16", "1, 2, 4, 8, 16"]),
    (dict(strategy="1f1b", peers=3, distributed=dict(microbatches=2)),
     ["distributed.microbatches = 2", "3 stages", "microbatches >= peers"]),
    (dict(strategy="gpipe", peers=1), ["peers = 1", "gpipe", "peers >= 2"]),
    (dict(strategy="1f1b", peers=1), ["peers = 1", "1f1b", "peers >= 2"]),
])
def test_bad_pipeline_config_is_refused_by_validation(values, expected):
    with pytest.raises(UserError) as err:
        validate_config(tiny_run(**values))
    message = str(err.value)
    assert "\n" not in message
    for part in expected:
        assert part in message, message


def test_cli_bad_microbatches_is_one_error_line_and_stores_no_run(env_data, tmp_path):
    result = _cli("run", "--no-progress", "--set", "strategy=\"gpipe\"", "--set", "peers=2", "--set", "vcpus_per_peer=1",
                  "--set", "model=\"tiny_cnn\"", "--set", "dataset=\"mnist\"", "--set", "batch_size=16",
                  "--set", "distributed.microbatches=3", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "distributed.microbatches = 3" in lines[0] and "(1, 2, 4, 8, 16)" in lines[0]
    assert not (tmp_path / "ddlscope-results" / "ddlscope.db").exists()


def test_pipeline_with_more_stages_than_layers_starts_nothing(env_data, db_path, monkeypatch, spawned):
    import ddlscope.config

    monkeypatch.setattr(ddlscope.config, "available_cores", lambda: list(range(8)))  # the core check passes
    cfg = validate_config(tiny_run(strategy="gpipe", peers=5, vcpus_per_peer=1))
    with pytest.raises(UserError) as err:
        run_local(cfg, db_path, progress=False)
    message = str(err.value)
    assert "peers = 5" in message and "'tiny_cnn' has only 4 top-level layers" in message and "peers <= 4" in message
    assert spawned == []
    assert _stored_runs(db_path) == []


def test_busy_rendezvous_port_starts_nothing(env_data, db_path, busy_port, spawned):
    cfg = validate_config(tiny_run(strategy="ddp", distributed=dict(rendezvous_port=busy_port), **TWO))
    with pytest.raises(UserError) as err:
        run_local(cfg, db_path, progress=False)
    message = str(err.value)
    assert "distributed.rendezvous_port" in message and str(busy_port) in message and "already in use" in message
    assert spawned == []
    assert _stored_runs(db_path) == []


@slow
def test_cli_busy_rendezvous_port_is_one_error_line(env_data, tmp_path, busy_port):
    result = _cli("run", "--no-progress", "--set", "strategy=\"ddp\"", "--set", "peers=2", "--set", "vcpus_per_peer=1",
                  "--set", "model=\"tiny_cnn\"", "--set", "dataset=\"mnist\"", "--set", "loader_workers=0",
                  "--set", f"distributed.rendezvous_port={busy_port}", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "distributed.rendezvous_port" in lines[0] and f"{busy_port} is already in use" in lines[0]
    db = tmp_path / "ddlscope-results" / "ddlscope.db"
    assert _stored_runs(db) == []


# ---------------------------------------------------------------------- 3. a worker that dies mid-run: tests/test_faults.py


# ---------------------------------------------------------------------- a worker that raises takes its peer down
FAULTY_MODEL = """
import os

import torch

from ddlscope.workloads.models import build_model


class FailOnRank1(torch.nn.Module):
    calls = 0

    def forward(self, x):
        FailOnRank1.calls += 1
        if self.training and os.environ.get("RANK") == "1" and FailOnRank1.calls > 5:
            raise ValueError("injected failure on rank 1")
        return x


def factory(num_classes, in_channels):
    model = build_model("tiny_cnn", "mnist", num_classes=num_classes)
    model.add_module("fail_on_rank_1", FailOnRank1())
    return model
"""


@slow
def test_failing_worker_is_named_in_the_run_reason_not_the_peer_it_took_down(env_data, db_path, tmp_path, monkeypatch):
    (tmp_path / "faulty_model_mod.py").write_text(FAULTY_MODEL)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    # torchrun stops the surviving worker (SIGTERM, recorded as "interrupted") at its next check after worker 1
    # exits; checking every 3 s instead of 0.2 s lets worker 0 record its own failure first, as it does on a loaded host
    import ddlscope.launch.local as local

    real_command = local.torchrun_command
    monkeypatch.setattr(local, "torchrun_command", lambda *a, **kw: [
        "--monitor-interval=3" if arg.startswith("--monitor-interval=") else arg for arg in real_command(*a, **kw)])
    cfg = validate_config(tiny_run(strategy="ddp", model="faulty_model_mod:factory", sample_budget=2 * 16 * 1000, **TWO))
    try:
        run_id = run_local(cfg, db_path, progress=False)
        with ResultsStore(db_path) as store:
            run = store.run(run_id)
            assert run["status"] == "failed"
            statuses = {w["worker_index"]: (w["status"], w["reason"]) for w in store.workers(run_id)}
            assert statuses[1] == ("failed", "ValueError: injected failure on rank 1"), statuses
            _assert_nothing_left(store, run_id, str(db_path), set())
            if statuses[0][0] != "failed":  # torchrun stopped worker 0 before it saw the lost connection
                pytest.skip(f"worker 0 ended {statuses[0][0]!r}, not 'failed': the scenario did not occur")
            assert run["reason"].startswith("worker 1 failed: ValueError: injected failure on rank 1"), run["reason"]
    finally:
        _kill_launched(str(db_path))



_HOLDER = """
import sys, time, datetime
import torch, torch.distributed as dist
rank, port = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
if rank == 1:  # enters a collective that rank 0 never joins
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4))
        print("joined")
    except Exception as e:
        print(f"failed after {time.monotonic() - start:.1f} s: {type(e).__name__}", flush=True)
else:  # stopped between steps: never joins, keeps its process group, and waits (as a worker cleaning up)
    time.sleep(1.0)
    from ddlscope.launch.processes import shut_tcp_connections
    print(f"shut {shut_tcp_connections()}", flush=True)
    time.sleep(8.0)
    print("held", flush=True)
"""


@slow
def test_a_stopped_worker_that_shuts_its_connections_frees_a_peer_blocked_in_a_collective():
    """Why a worker shuts its TCP connections before it waits for the others on its way out: a peer blocked
    in a collective with it waits as long as the process group's sockets are open (the group lives on while
    a DDP model refers to it), here 8 s. Found as a SIGKILLed launcher whose 2nd ddp worker outlived it by
    10 s: the 1st waited for it to end (the last one out cleans up). Only the sending side is shut: shutting
    both made gloo's own thread abort the process that shut them."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", _HOLDER, str(rank), str(port)], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True, env=env) for rank in (0, 1)]
    try:
        blocked = procs[1].communicate(timeout=30)[0]
        holder = procs[0].communicate(timeout=30)[0]
        assert "failed after" in blocked, blocked
        assert float(blocked.split("failed after ")[1].split(" s")[0]) < 5, blocked  # not at rank 0's exit
        assert procs[0].returncode == 0 and "held" in holder and int(holder.split("shut ")[1].split()[0]) >= 1, holder
    finally:
        for p in procs:
            p.kill()
            p.wait()
