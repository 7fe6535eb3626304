"""Exports (``ddlscope export``), each read back with its own library: TensorBoard's EventAccumulator,
W&B's record protos, MlflowClient, pyarrow, csv, json.

The store is written through ResultsStore's own methods with known values: group ``g1`` holds a
2-worker ddp run (one step of worker 1 recorded as starting 2 us before the previous step's parts
end, as two clocks can) and a 1-worker single run; group ``g2`` a run that no export of ``g1`` may
contain. One test exports a real tiny ``single`` run to a trace.
"""

from __future__ import annotations

import csv
import json
import os
import struct
import time
from pathlib import Path

import psutil
import pytest
from typer.testing import CliRunner

from ddlscope.cli import app
from ddlscope.errors import UserError
from ddlscope.export import REQUIRES, export_runs
from ddlscope.export.rows import flat_config, run_tables, step_parts, table_columns
from ddlscope.measure.parts import STEP_PARTS
from ddlscope.store.db import ResultsStore

CONFIG = {"model": "tiny_cnn", "batch_size": 16, "lr": 0.05, "ddp": {"bucket_mb": 25}, "stage_bounds": [0, 3]}
STEPS = 4


def _step(step: int, start: float, wi: int) -> dict:
    parts = dict(data_load_s=0.002 + 0.001 * wi, forward_s=0.010 + 0.001 * step, backward_s=0.020,
                 comm_wait_s=0.003 * wi, bubble_s=0.0, averaging_s=0.004 if step == 3 else 0.0)
    optimizer_s = 0.005 + parts["averaging_s"]  # the store's optimizer_s includes averaging
    step_s = sum(parts.values()) - parts["averaging_s"] + optimizer_s
    return dict(step=step, wall_time=start, samples=16, optimizer_s=optimizer_s, step_s=step_s, loss=2.0 / (step + 1),
                accuracy=0.25 * step, samples_per_s=16 / step_s, warmup=int(step == 0), optimizer_stepped=1,
                averaging_round=int(step == 3), comm_s=0.01 * wi, comm_bytes=1000 * wi, **parts)


def _ddp_run(store: ResultsStore) -> str:
    run_id = store.create_run("ddp-2", "ddp", CONFIG, group_name="g1")
    t0 = store.run(run_id)["created_at"]
    for wi in (0, 1):
        store.upsert_worker(run_id, wi, hostname="node-a", pid=None, status="completed")
        start = t0 + 1.0
        for step in range(STEPS):
            row = _step(step, start, wi)
            store.add_step(run_id, wi, row)
            # worker 1's step 2 starts 2 us before step 1's parts end (clock skew); the rest 0.1 s apart
            start = start + row["step_s"] - 2e-6 if (wi, step) == (1, 1) else start + 0.1
        store.add_host_sample(run_id, wi, dict(wall_time=t0 + 0.5, cpu_percent=50.0, rss_bytes=10_000_000))
        store.add_host_sample(run_id, wi, dict(wall_time=t0 + 1.12, cpu_percent=95.0 + wi, rss_bytes=20_000_000,
                                               net_sent_bytes=123))
        store.add_eval(run_id, wi, 1, train_time_s=0.2, accuracy=0.5, loss=1.5, samples=64)
        store.add_eval(run_id, wi, 3, train_time_s=0.4, accuracy=0.75 + 0.01 * wi, loss=0.9, samples=64)
    store.add_event(run_id, 0, "averaging_round", step=3, group_size=2, succeeded=True)
    store.add_event(run_id, None, "service_killed", service="expert_server", index=0, at_s=1.2)
    store.upsert_service(run_id, "expert_server", 0, 0, pid=None, status="killed", started_at=t0 + 0.2,
                         ended_at=t0 + 1.2)
    store.add_rows("moe_steps", [dict(run_id=run_id, worker_index=0, step=0, wall_time=t0 + 1.0, samples=16,
                                      beam_search_s=0.001, forward_calls=3)])
    store.finish_run(run_id, "completed")
    return run_id


@pytest.fixture
def store_ids(db_path) -> dict[str, str]:
    """Ids of the runs ``ddp`` and ``single`` (group g1) and ``other`` (group g2) in ``db_path``."""
    with ResultsStore(db_path) as store:
        ddp = _ddp_run(store)
        single = store.create_run("single-1", "single", {"model": "mlp", "batch_size": 8}, group_name="g1")
        store.add_step(single, 0, _step(0, store.run(single)["created_at"] + 0.3, 0))
        store.finish_run(single, "failed", "out of memory")
        other = store.create_run("other", "single", {"model": "mlp"}, group_name="g2")
        store.add_step(other, 0, _step(0, store.run(other)["created_at"] + 0.3, 0))
        store.finish_run(other, "completed")
    return {"ddp": ddp, "single": single, "other": other}


def _invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def _stored(db_path: Path, table: str, run_ids: list[str]) -> list[dict]:
    with ResultsStore(db_path) as store:
        marks = ", ".join("?" * len(run_ids))
        return [dict(r) for r in store.conn.execute(f"SELECT * FROM {table} WHERE run_id IN ({marks}) ORDER BY rowid",
                                                    run_ids)]


# ---------------------------------------------------------------------- trace
def _check_trace(trace: dict, db_path: Path, run_id: str) -> list[dict]:
    """Tracks sorted, no overlaps, one span per nonzero part of every step with its stored duration; returns spans."""
    events = trace["traceEvents"]
    steps = _stored(db_path, "steps", [run_id])
    workers = sorted({s["worker_index"] for s in steps})
    names = [(e["pid"], e["args"]["name"]) for e in events if e["ph"] == "M" and e["name"] == "process_name"]
    pids = {int(n.split()[1]): pid for pid, n in names if n.startswith("worker ")}  # "worker 1 (host, pid 42)"
    assert sorted(pids) == workers and len(set(pids.values())) == len(workers)
    assert all(e["pid"] != 0 for e in events)  # Perfetto's idle process
    spans = [e for e in events if e["ph"] == "X" and e["cat"] == "step"]
    for track in {(e["pid"], e["tid"]) for e in spans}:
        mine = [e for e in spans if (e["pid"], e["tid"]) == track]
        assert [e["ts"] for e in mine] == sorted(e["ts"] for e in mine)
        for a, b in zip(mine, mine[1:]):
            assert a["ts"] + a["dur"] <= b["ts"], (a, b)
    assert len({e["pid"] for e in spans}) == len(workers)  # one track per worker
    by_key = {(e["pid"], e["args"]["step"], e["name"]): e for e in spans}
    expected = 0
    for s in steps:
        pid = pids[s["worker_index"]]
        for part, seconds in step_parts(s).items():
            if round(seconds * 1e6) > 0:
                expected += 1
                assert by_key[(pid, s["step"], part.removesuffix("_s"))]["dur"] == round(seconds * 1e6)
    assert len(spans) == expected
    return spans


def test_trace_has_a_track_per_worker_a_span_per_part_and_step_and_the_run_events(db_path, store_ids, tmp_path):
    [path] = export_runs(db_path, [store_ids["ddp"]], "trace", tmp_path / "out")
    trace = json.loads(path.read_text())
    spans = _check_trace(trace, db_path, store_ids["ddp"])
    step0 = sorted((e for e in spans if e["args"]["step"] == 0 and e["pid"] == spans[0]["pid"]), key=lambda e: e["ts"])
    assert [e["name"] for e in step0] == ["data_load", "forward", "backward", "optimizer"]  # the loop's order
    assert step0[0]["ts"] == round(1.0 * 1e6)  # the step's stored start, from the run's creation
    averaging = [e for e in spans if e["name"] == "averaging"]
    assert len(averaging) == 2 and all(e["dur"] == 4000 for e in averaging)
    instants = {e["name"]: e for e in trace["traceEvents"] if e["ph"] == "i"}
    assert set(instants) == {"averaging_round", "service_killed"}
    assert instants["averaging_round"]["args"]["group_size"] == 2
    services = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "service"]
    assert len(services) == 1 and services[0]["ts"] == 200_000 and services[0]["dur"] == 1_000_000
    assert trace["otherData"]["ddlscope_run_id"] == store_ids["ddp"]


def test_trace_of_a_real_tiny_single_run(env_data, db_path, tmp_path):
    from ddlscope.config import validate_config
    from ddlscope.launch.local import run_local
    from tests.conftest import tiny_run

    run_id = run_local(validate_config(tiny_run(sample_budget=160)), db_path, progress=False)
    [path] = export_runs(db_path, [run_id], "trace", tmp_path / "out")
    spans = _check_trace(json.loads(path.read_text()), db_path, run_id)
    assert {e["args"]["step"] for e in spans} == set(range(10))


# ---------------------------------------------------------------------- csv / parquet
def test_csv_has_every_table_with_the_group_runs_rows_only(db_path, store_ids, tmp_path):
    out = tmp_path / "csv"
    result = _invoke("export", "--group", "g1", "--to", "csv", "--db", db_path, "--out", out)
    assert result.exit_code == 0, result.output
    chosen = [store_ids["ddp"], store_ids["single"]]
    with ResultsStore(db_path) as store:
        tables = run_tables(store.conn)
        kinds = {t: dict(table_columns(store.conn, t)) for t in tables}
    assert {p.stem for p in out.glob("*.csv")} == set(tables) >= {"runs", "steps", "host_samples", "moe_steps"}
    for table in tables:
        with (out / f"{table}.csv").open(newline="") as f:
            rows = list(csv.DictReader(f))
        stored = _stored(db_path, table, chosen)
        assert len(rows) == len(stored), table
        for got, want in zip(rows, stored):
            assert list(got) == list(want)
            for col, value in want.items():
                if value is None:
                    assert got[col] == ""
                elif kinds[table][col] == "REAL":
                    assert float(got[col]) == value  # exact: floats written as repr
                else:
                    assert got[col] == str(value)
    assert store_ids["other"] not in (out / "runs.csv").read_text()
    assert f"wrote {out / 'steps.csv'}" in result.output


def test_parquet_has_every_table_typed_and_equal_to_the_store(db_path, store_ids, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    written = export_runs(db_path, [store_ids["ddp"]], "parquet", tmp_path / "pq")
    for path in written:
        table = pq.read_table(path)
        assert table.to_pylist() == _stored(db_path, path.stem, [store_ids["ddp"]]), path.stem
    steps = pq.read_table(tmp_path / "pq" / "steps.parquet")
    assert steps.schema.field("forward_s").type == pa.float64() and steps.schema.field("step").type == pa.int64()
    assert steps.num_rows == 2 * STEPS
    assert pq.read_table(tmp_path / "pq" / "predictions.parquet").num_rows == 0  # table kept, with its columns
    assert "cell_key" in pq.read_table(tmp_path / "pq" / "runs.parquet").column_names


# ---------------------------------------------------------------------- tensorboard
def test_tensorboard_event_files_per_worker_read_back(db_path, store_ids, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_id = store_ids["ddp"]
    written = export_runs(db_path, [run_id], "tensorboard", tmp_path / "tb")
    assert written == [tmp_path / "tb" / run_id / "worker0", tmp_path / "tb" / run_id / "worker1"]
    steps = _stored(db_path, "steps", [run_id])
    for wi, log_dir in enumerate(written):
        acc = EventAccumulator(str(log_dir))
        acc.Reload()
        tags = set(acc.Tags()["scalars"])
        assert {f"phase/{p}" for p in STEP_PARTS} | {"step/loss", "step/samples_per_s", "host/cpu_percent",
                                                     "host/rss_bytes", "eval/accuracy"} <= tags
        mine = [s for s in steps if s["worker_index"] == wi]
        forward = acc.Scalars("phase/forward_s")
        assert [e.step for e in forward] == [s["step"] for s in mine]
        assert [e.value for e in forward] == pytest.approx([s["forward_s"] for s in mine], rel=1e-6)
        assert [e.wall_time for e in forward] == pytest.approx([s["wall_time"] for s in mine])
        optimizer = acc.Scalars("phase/optimizer_s")
        assert [e.value for e in optimizer] == pytest.approx([0.005] * STEPS, rel=1e-6)  # averaging taken out
        cpu = acc.Scalars("host/cpu_percent")  # the sample before the first step -> step 0; at +1.12 s -> step 1
        assert [(e.step, e.value) for e in cpu] == [(0, 50.0), (1, 95.0 + wi)]
        accuracy = acc.Scalars("eval/accuracy")
        assert [e.step for e in accuracy] == [1, 3]
        assert [e.value for e in accuracy] == pytest.approx([0.5, 0.75 + 0.01 * wi])
    again = export_runs(db_path, [run_id], "tensorboard", tmp_path / "tb")  # replaces, does not add
    assert len(list(again[0].glob("events.out.tfevents.*"))) == 1


# ---------------------------------------------------------------------- wandb
def _wandb_records(path: Path):
    """The records of a ``.wandb`` file: W&B's LevelDB-style log (7-byte file header ':W&B' + magic + version;
    32 KiB blocks of chunks: crc32c, length, type FULL/FIRST/MIDDLE/LAST) of ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, pending = 32768, 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block tail too short for a chunk header: zero padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record
            pending = b""


def test_wandb_offline_runs_read_back_and_its_service_process_ends(db_path, store_ids, tmp_path):
    run_id = store_ids["ddp"]
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    written = export_runs(db_path, [run_id], "wandb", tmp_path / "wb")
    deadline = time.monotonic() + 10
    while {p.pid for p in me.children(recursive=True)} - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not {p.pid for p in me.children(recursive=True)} - before, "wandb's service process still runs"
    assert [p.name.endswith(f"-{run_id}-w{wi}") for wi, p in enumerate(written)] == [True, True]
    steps = _stored(db_path, "steps", [run_id])
    for wi, folder in enumerate(written):
        [log] = folder.glob("*.wandb")
        records = list(_wandb_records(log))
        [run] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
        assert run.run_id == f"{run_id}-w{wi}" and run.run_group == run_id
        config = {item.key: json.loads(item.value_json) for item in run.config.update}
        assert config["batch_size"] == 16 and config["ddp"] == {"bucket_mb": 25}
        assert config["ddlscope"]["worker_index"] == wi
        history = {}
        for r in records:
            if r.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
                history[items["_step"]] = items
        mine = [s for s in steps if s["worker_index"] == wi]
        assert sorted(history) == [s["step"] for s in mine]
        assert [history[s["step"]]["phase/forward_s"] for s in mine] == [s["forward_s"] for s in mine]
        assert history[3]["eval/accuracy"] == pytest.approx(0.75 + 0.01 * wi)
        assert history[1]["host/cpu_percent"] == 95.0 + wi
    assert "WANDB_MODE" not in os.environ  # the offline settings were for the export only


# ---------------------------------------------------------------------- mlflow
def test_mlflow_sqlite_store_read_back_with_mlflow_client(db_path, store_ids, tmp_path):
    from mlflow.tracking import MlflowClient

    from ddlscope.export.mlflow_store import tracking_uri

    run_id, out = store_ids["ddp"], tmp_path / "ml"
    assert export_runs(db_path, [run_id, store_ids["single"]], "mlflow", out) == [out / "mlflow.db"]
    export_runs(db_path, [run_id], "mlflow", out)  # again: replaces the run's earlier MLflow runs
    client = MlflowClient(tracking_uri=tracking_uri(out))
    experiment = client.get_experiment_by_name("ddlscope")
    mine = client.search_runs([experiment.experiment_id], f"tags.`ddlscope.run_id` = '{run_id}'")
    [parent] = [r for r in mine if "mlflow.parentRunId" not in r.data.tags]
    children = sorted((r for r in mine if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id),
                      key=lambda r: r.data.tags["ddlscope.worker_index"])
    assert len(mine) == 3 and len(children) == 2
    assert parent.data.params == flat_config(CONFIG) and parent.data.params["ddp.bucket_mb"] == "25"
    assert parent.info.status == "FINISHED" and parent.data.tags["ddlscope.strategy"] == "ddp"
    steps = _stored(db_path, "steps", [run_id])
    for wi, child in enumerate(children):
        history = client.get_metric_history(child.info.run_id, "phase/forward_s")
        expected = [(s["step"], s["forward_s"], int(s["wall_time"] * 1000)) for s in steps if s["worker_index"] == wi]
        assert sorted((m.step, m.value, m.timestamp) for m in history) == expected
        assert [m.value for m in client.get_metric_history(child.info.run_id, "eval/accuracy")] == pytest.approx(
            [0.5, 0.75 + 0.01 * wi])
    single = client.search_runs([experiment.experiment_id], f"tags.`ddlscope.run_id` = '{store_ids['single']}'")
    assert sorted(r.info.status for r in single) == ["FAILED", "FAILED"]  # the run and its worker


# ---------------------------------------------------------------------- errors
def test_bad_requests_give_one_error_and_write_nothing(db_path, store_ids, tmp_path, monkeypatch):
    out = tmp_path / "never"
    for args, words in [(["nope123", "--to", "trace"], "unknown run id(s) nope123"),
                        (["--group", "nogroup", "--to", "csv"], "no runs in group 'nogroup'"),
                        ([store_ids["ddp"], "--to", "excel"], "allowed: tensorboard, wandb, mlflow, csv, parquet"),
                        ([store_ids["ddp"], "--group", "g1", "--to", "csv"], "not both")]:
        result = _invoke("export", *args, "--db", db_path, "--out", out)
        assert isinstance(result.exception, UserError) and words in str(result.exception), (args, result.output)
    monkeypatch.setitem(REQUIRES, "parquet", ("pyarrow_is_not_installed",))
    result = _invoke("export", store_ids["ddp"], "--to", "parquet", "--db", db_path, "--out", out)
    assert "pip install 'ddlscope[export]'" in str(result.exception)
    with pytest.raises(UserError, match="no results database"):
        export_runs(tmp_path / "missing.db", [store_ids["ddp"]], "csv", out)
    assert not out.exists() and not (tmp_path / "missing.db").exists()
