"""The batched writer of the training loop's rows: committed by a thread of its own every flush
interval, on flush/close and on SIGTERM; a SIGKILL loses at most the rows since the last commit."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time

import pytest

from ddlscope.config import validate_config
from ddlscope.errors import UserError
from ddlscope.store.db import BatchedWriter, ResultsStore
from tests.conftest import tiny_run


def _step(i: int) -> dict:
    return dict(step=i, wall_time=1000.0 + i, samples=8, step_s=0.1, warmup=0, optimizer_stepped=1)


def _committed_steps(db) -> list[int]:
    """Steps another connection sees (only committed rows)."""
    with ResultsStore(db) as reader:
        return [r["step"] for r in reader.rows("steps", "r")]


def test_rows_wait_for_the_flush_and_are_all_committed_by_it(db_path):
    with ResultsStore(db_path) as store:
        writer = store.batched_writer(flush_interval_s=3600)
        for i in range(5):
            writer.add_step("r", 0, _step(i))
        writer.add_event("r", 0, "averaging_round", step=4, group_size=2)
        assert _committed_steps(db_path) == []  # queued, not committed (the interval is an hour)
        writer.flush()
        assert _committed_steps(db_path) == [0, 1, 2, 3, 4]
        (event,) = store.rows("events", "r")
        assert event["kind"] == "averaging_round" and json.loads(event["detail_json"]) == dict(step=4, group_size=2)
        writer.add_step("r", 0, _step(5))
        writer.close()
        writer.close()  # again: nothing more to do
        assert _committed_steps(db_path) == list(range(6))
        with pytest.raises(ValueError, match="closed"):
            writer.add_step("r", 0, _step(6))


def test_measurement_rows_go_with_the_steps_and_a_wrong_table_is_refused_at_once(db_path):
    with ResultsStore(db_path) as store:
        writer = store.batched_writer(flush_interval_s=3600)
        with pytest.raises(ValueError, match="unknown table 'moe_nope'"):
            writer.add_rows("moe_nope", [dict(run_id="r")])
        writer.add_step("r", 0, _step(0))
        writer.add_rows("moe_steps", [dict(run_id="r", worker_index=0, step=0, wall_time=1000.0, samples=8)])
        with ResultsStore(db_path) as reader:
            assert reader.rows("moe_steps", "r") == []  # queued with the step, not committed yet
        writer.close()
        with ResultsStore(db_path) as reader:
            assert [r["step"] for r in reader.rows("moe_steps", "r")] == [0] and _committed_steps(db_path) == [0]


def test_rows_are_committed_every_interval_without_a_flush(db_path):
    with ResultsStore(db_path), BatchedWriter(db_path, flush_interval_s=0.05) as writer:
        writer.add_step("r", 0, _step(0))
        deadline = time.monotonic() + 30  # generous: only that it happens is checked, not how fast
        while not _committed_steps(db_path) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _committed_steps(db_path) == [0]


def test_a_failed_write_is_raised_in_the_training_thread_and_stays(db_path):
    with ResultsStore(db_path):
        writer = BatchedWriter(db_path, flush_interval_s=3600)
        writer.add_step("r", 0, dict(step=0))  # wall_time and samples are NOT NULL
        with pytest.raises(sqlite3.IntegrityError):
            writer.flush()
        with pytest.raises(sqlite3.IntegrityError):
            writer.add_step("r", 0, _step(1))
        with pytest.raises(sqlite3.IntegrityError):
            writer.close()
    assert _committed_steps(db_path) == []  # the batch was rolled back as one


@pytest.mark.parametrize("interval", [0.0, -1.0, float("nan")])
def test_the_interval_must_be_positive(db_path, interval):
    with pytest.raises(ValueError, match="flush_interval_s = .*allowed: a number of seconds > 0"):
        BatchedWriter(db_path, interval)


def test_the_run_config_field_is_checked():
    assert validate_config(tiny_run()).store_flush_interval_s == 1.0
    assert validate_config(tiny_run(store_flush_interval_s=0.25)).store_flush_interval_s == 0.25
    with pytest.raises(UserError, match="store_flush_interval_s"):
        validate_config(tiny_run(store_flush_interval_s=0))


WRITER_SCRIPT = textwrap.dedent("""
    import signal, sys, time
    from ddlscope.store.db import ResultsStore
    from ddlscope.train.worker import Interrupted, _stop_handler

    signal.signal(signal.SIGTERM, _stop_handler(lambda: None))
    store = ResultsStore(sys.argv[1])
    writer = store.batched_writer(3600)
    try:
        for i in range(10):
            writer.add_step("r", 0, dict(step=i, wall_time=1.0, samples=8, warmup=0, optimizer_stepped=1))
            if i == 4:
                writer.flush()
        print("ready", flush=True)
        time.sleep(120)
    except Interrupted:
        writer.close()  # what the training loop does when SIGTERM/SIGINT stops it
        sys.exit(130)
""")


@pytest.mark.parametrize("sig, kept", [(signal.SIGTERM, list(range(10))), (signal.SIGKILL, list(range(5)))])
def test_sigterm_commits_everything_and_sigkill_loses_only_the_last_interval(db_path, sig, kept):
    ResultsStore(db_path).close()
    proc = subprocess.Popen([sys.executable, "-c", WRITER_SCRIPT, str(db_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(sig)
        proc.wait(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == (130 if sig == signal.SIGTERM else -signal.SIGKILL)
    assert _committed_steps(db_path) == kept


@pytest.mark.parametrize("loss, accuracy", [(float("nan"), 0.1), (float("inf"), 0.1), (2.3, float("nan"))])
def test_a_diverged_evaluation_is_named_not_a_constraint_error(db_path, loss, accuracy):
    """SQLite stores NaN as NULL, which evals refuses: a diverged run fails saying so (seen in CI: a churned
    swarm's parameters became NaN after an averaging round and the worker died of an IntegrityError)."""
    from ddlscope.store.db import TrainingDiverged

    with ResultsStore(db_path) as store:
        rid = store.create_run("r", "single", tiny_run())
        with pytest.raises(TrainingDiverged, match=r"worker 0: the held-out loss is .* after step 7: training diverged"):
            store.add_eval(rid, 0, 7, 1.0, accuracy, loss, 32)
        store.add_eval(rid, 0, 8, 1.0, 0.5, 2.3, 32)  # a finite one is stored
        assert [e["step"] for e in store.rows("evals", rid)] == [8]
