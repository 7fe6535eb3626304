"""torch.profiler traces of chosen steps (:mod:`ddlscope.measure.torch_profile`) and their merge into
``ddlscope export --to trace``.

A loop shaped like ddlscope's (``step_started`` before the step's start time is read, ``step_ended``
after its last lap, the step stored afterwards) trains the tiny CNN on CPU for a few steps of at
least 10 ms each, so that a clock shift of one step would show.
"""

from __future__ import annotations

import gzip
import json
import time
from pathlib import Path

import pytest
import torch

from ddlscope.export import export_runs
from ddlscope.measure.timeline import Stopwatch
from ddlscope.measure.torch_profile import (
    EVENT_KIND, StepProfiler, check_profile_steps, profile_dir, record_profile,
)
from ddlscope.store.db import ResultsStore
from ddlscope.workloads.models import build_model

STEP_SLEEP_S = 0.01


def _train(store: ResultsStore, run_id: str, profiler: StepProfiler, steps: int, wi: int = 0) -> None:
    """``steps`` steps of the tiny CNN on random 8x1x28x28 batches, each stored like the training loop does."""
    torch.manual_seed(0)
    model = build_model("tiny_cnn", "mnist")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    watch = Stopwatch("cpu")
    for step in range(steps):
        profiler.step_started(step)
        wall = time.time()
        watch.start()
        x, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
        time.sleep(STEP_SLEEP_S)
        data_load_s = watch.lap()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        forward_s = watch.lap()
        loss.backward()
        backward_s = watch.lap()
        opt.step()
        opt.zero_grad()
        optimizer_s = watch.lap()
        profiler.step_ended(step)
        step_s = data_load_s + forward_s + backward_s + optimizer_s
        store.add_step(run_id, wi, dict(step=step, wall_time=wall, samples=8, data_load_s=data_load_s,
                                        forward_s=forward_s, backward_s=backward_s, optimizer_s=optimizer_s,
                                        averaging_s=0.0, step_s=step_s, loss=loss.item(), warmup=0,
                                        optimizer_stepped=1))


def _profiled_run(db_path: Path, profile_steps, steps: int, workers: int = 1) -> tuple[str, StepProfiler]:
    """A run whose workers (one after the other, in this process) profile ``profile_steps``; the last profiler."""
    with ResultsStore(db_path) as store:
        run_id = store.create_run("profiled", "single", {"model": "tiny_cnn", "profile_steps": profile_steps})
        for wi in range(workers):
            store.upsert_worker(run_id, wi, hostname="node-a", status="training")
            profiler = StepProfiler(profile_steps, profile_dir(db_path, run_id), worker=wi, device="cpu")
            _train(store, run_id, profiler, steps, wi)
            record_profile(store, run_id, wi, profiler)
        store.finish_run(run_id, "completed")
    return run_id, profiler


def _step_marks(events: list[dict]) -> dict[int, dict]:
    return {int(e["name"].split("#")[1]): e for e in events if e.get("ph") == "X"
            and str(e.get("name", "")).startswith("ProfilerStep#")}


def test_trace_has_exactly_the_asked_steps_and_merges_into_the_export_on_the_run_clock(db_path, tmp_path):
    run_id, profiler = _profiled_run(db_path, [1, 3], steps=5, workers=2)
    path = profile_dir(db_path, run_id) / "worker1.pt.trace.json.gz"
    assert profiler.close() == path and path.is_file()
    with gzip.open(path, "rt") as f:
        raw = json.load(f)["traceEvents"]
    assert sorted(_step_marks(raw)) == [1, 2, 3]
    with ResultsStore(db_path) as store:
        recorded = [e for e in store.rows("events", run_id) if e["kind"] == EVENT_KIND]
    assert [e["worker_index"] for e in recorded] == [0, 1]
    detail = json.loads(recorded[0]["detail_json"])
    assert (detail["first_step"], detail["last_step"], sorted(detail["step_start_unix_s"])) == (1, 3, ["1", "2", "3"])
    assert Path(detail["path"]) == path.with_name("worker0.pt.trace.json.gz")

    [out] = export_runs(db_path, [run_id], "trace", tmp_path / "out")
    trace = json.loads(out.read_text())
    events = trace["traceEvents"]
    flows = [(e["cat"], e["id"], e["ph"]) for e in events if e["ph"] in ("s", "f")]
    assert flows and len(set(flows)) == len(flows)  # one start and one end per flow id in the whole trace
    assert {e["pid"] for e in events if e["ph"] == "X" and e.get("name") == "ProfilerStep#1"} == {2, 3}
    for pid, wi in ((2, 0), (3, 1)):
        _check_worker(trace, pid, wi, profiled=[1, 2, 3], steps=5)


def _check_worker(trace: dict, pid: int, wi: int, profiled: list[int], steps: int) -> None:
    """Worker ``wi``'s ddlscope spans (``steps`` steps) and profiler events on process ``pid``: exactly the
    ``profiled`` steps' ProfilerStep marks, each on its step's spans, with the step's convolutions inside."""
    events = trace["traceEvents"]
    spans = [e for e in events if e["ph"] == "X" and e.get("cat") == "step" and e["pid"] == pid]
    assert sorted({e["args"]["step"] for e in spans}) == list(range(steps))  # ddlscope's spans, all steps
    assert {e["tid"] for e in spans} == {1}
    profiler_events = [e for e in events if e["pid"] == pid and e["tid"] >= 100 and e["ph"] != "M"]
    marks = _step_marks(profiler_events)
    assert sorted(marks) == profiled
    assert any(e["name"] == "aten::conv2d" for e in profiler_events)
    track_names = [e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"
                   and e["pid"] == pid and e["tid"] >= 100]
    assert track_names and all(n.startswith("torch.profiler ") for n in track_names)
    assert not [e for e in events if e.get("cat") == "Trace" or e["ph"] == "i" and e.get("s") == "g"]
    for step, mark in marks.items():
        mine = [e for e in spans if e["args"]["step"] == step]
        start_us, end_us = min(e["ts"] for e in mine), max(e["ts"] + e["dur"] for e in mine)
        # the mark opens right before the step's start time is read and closes right after its last lap: on the
        # run's clock it lies on its own step, nearer to the step's start and end than to any other step's (a
        # bound in microseconds fails on a loaded machine, where a preempted thread can take milliseconds)
        starts = {k: min(e["ts"] for e in spans if e["args"]["step"] == k) for k in range(steps)}
        ends = {k: max(e["ts"] + e["dur"] for e in spans if e["args"]["step"] == k) for k in range(steps)}
        assert min(starts, key=lambda k: abs(starts[k] - mark["ts"])) == step, (step, mark["ts"], starts)
        assert min(ends, key=lambda k: abs(ends[k] - mark["ts"] - mark["dur"])) == step, (step, mark, ends)
        convs = [e for e in profiler_events if e["name"] == "aten::conv2d" and start_us <= e["ts"] <= end_us]
        assert convs  # the step's forward pass lies within the step's ddlscope spans
    info = trace["otherData"]["torch_profiles"][wi]
    assert info["worker"] == wi and info["steps"] == [profiled[0], profiled[-1]]
    assert info["events"] == len(profiler_events)
    # the profiled steps' clock shifts agree to well within a step (the merged events land on their own step)
    shortest_us = min(max(e["ts"] + e["dur"] for e in spans if e["args"]["step"] == k)
                      - min(e["ts"] for e in spans if e["args"]["step"] == k) for k in profiled)
    assert 0 <= info["alignment_spread_us"] < shortest_us / 2


def test_a_run_that_stops_between_a_and_b_keeps_its_steps_and_one_before_a_writes_nothing(tmp_path):
    with ResultsStore(tmp_path / "r.db") as store:
        run_id = store.create_run("short", "single", {})
        cut = StepProfiler((1, 10), tmp_path / "cut", worker=3, device="cpu")
        _train(store, run_id, cut, steps=3)
        cut.step_started(3)  # the worker stops inside step 3
        path = cut.close()
        assert path == tmp_path / "cut" / "worker3.pt.trace.json.gz"
        with gzip.open(path, "rt") as f:
            assert sorted(_step_marks(json.load(f)["traceEvents"])) == [1, 2, 3]
        assert cut.profiled_steps == (1, 3)

        early = StepProfiler((5, 6), tmp_path / "early", worker=0, device="cpu")
        _train(store, run_id, early, steps=3)
        assert early.close() is None and not (tmp_path / "early").exists()
        assert record_profile(store, run_id, 0, early) is False

        off = StepProfiler(None, tmp_path / "off", worker=0, device="cpu")
        _train(store, run_id, off, steps=2)
        assert off.close() is None and not (tmp_path / "off").exists()
        assert not [e for e in store.rows("events", run_id) if e["kind"] == EVENT_KIND]


@pytest.mark.parametrize("bad", [[3, 1], [-1, 2], [1], [1, 2, 3], "ab", 5, [1.0, 2], [True, 2], ["0", "1"]])
def test_bad_profile_steps_are_refused(bad, tmp_path):
    with pytest.raises(ValueError, match="profile_steps"):
        StepProfiler(bad, tmp_path, worker=0, device="cpu")


def test_profile_steps_checked_against_the_steps_a_worker_trains():
    assert check_profile_steps([0, 0]) == (0, 0)
    assert check_profile_steps((2, 4), steps=5) == (2, 4)
    assert check_profile_steps(None, steps=5) is None
    with pytest.raises(ValueError, match="at most 4"):
        check_profile_steps([2, 5], steps=5)


def test_an_unreadable_profile_is_named_in_the_export_and_the_rest_is_exported(db_path, tmp_path):
    run_id, profiler = _profiled_run(db_path, [0, 0], steps=2)
    profiler.close().write_bytes(b"not gzip")
    [out] = export_runs(db_path, [run_id], "trace", tmp_path / "out")
    trace = json.loads(out.read_text())
    [info] = trace["otherData"]["torch_profiles"]
    assert info["problem"].startswith("not merged: cannot read the trace")
    assert not [e for e in trace["traceEvents"] if e["pid"] == 2 and e["tid"] >= 100]
    assert {e["args"]["step"] for e in trace["traceEvents"] if e.get("cat") == "step"} == {0, 1}


def test_a_real_run_with_profile_steps_is_exported_with_its_profile(env_data, db_path, tmp_path):
    from ddlscope.config import RunConfig, validate_config
    from ddlscope.launch.local import run_local
    from tests.conftest import tiny_run

    if "profile_steps" not in RunConfig.model_fields:
        pytest.skip("profile_steps is not in the run config yet")
    run_id = run_local(validate_config(tiny_run(sample_budget=160, profile_steps=[2, 4])), db_path, progress=False)
    [out] = export_runs(db_path, [run_id], "trace", tmp_path / "out")
    trace = json.loads(out.read_text())
    [info] = trace["otherData"]["torch_profiles"]
    assert Path(info["path"]) == profile_dir(db_path, run_id).resolve() / "worker0.pt.trace.json.gz"
    _check_worker(trace, pid=2, wi=0, profiled=[2, 3, 4], steps=10)
