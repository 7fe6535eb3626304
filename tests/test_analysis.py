"""Comparison rules, bottleneck verdicts and report output, on runs written by hand into a store."""

from __future__ import annotations

import json

import pytest

from ddlscope.analyze.compare import compare, pick_baseline, summarize_run
from ddlscope.analyze.report import write_report
from ddlscope.store.db import ResultsStore


def _write_run(store, name, strategy, workers, peers=1, config=None, status="completed"):
    """workers: list of dicts with start, runtime, eval_s, phases (per step), steps, final_acc, evals, net.

    ``config``: more settings for the stored config; ``status`` "running" leaves the run unfinished.
    """
    run_id = store.create_run(name, strategy, {"peers": peers, **(config or {})}, group_name="g")
    for i, w in enumerate(workers):
        store.upsert_worker(run_id, i, status="completed", train_start_time=w["start"],
                            train_end_time=w["start"] + w["runtime"] + w.get("eval_s", 0.0), eval_s=w.get("eval_s", 0.0))
        d, f, b, o, a = w["phases"]
        for step in range(w["steps"]):
            store.add_step(run_id, i, dict(step=step, wall_time=w["start"] + step, samples=10, data_load_s=d, forward_s=f,
                                           backward_s=b, optimizer_s=o + a, averaging_s=a, step_s=d + f + b + o + a,
                                           loss=1.0, accuracy=0.5, warmup=int(step == 0), optimizer_stepped=1,
                                           averaging_round=int(a > 0), averaging_group_size=2 if a > 0 else None,
                                           averaging_succeeded=1 if a > 0 else None,
                                           background_cpu_s=w.get("background_cpu_s")))
        for t, acc in w["evals"]:
            store.add_eval(run_id, i, 0, t, acc, 0.5, 100)
        store.add_host_sample(run_id, i, dict(wall_time=w["start"], cpu_percent=50.0, rss_bytes=100, net_sent_bytes=0,
                                              net_recv_bytes=0))
        store.add_host_sample(run_id, i, dict(wall_time=w["start"] + 1, cpu_percent=w.get("cpu", 100.0), rss_bytes=300,
                                              net_sent_bytes=w.get("net", 0), net_recv_bytes=w.get("net", 0)))
    if status != "running":
        store.finish_run(run_id, status)
    return run_id


@pytest.fixture
def store(tmp_path):
    with ResultsStore(tmp_path / "r.db") as s:
        yield s


def test_comparison_rules(store):
    base = _write_run(store, "base", "single", [
        dict(start=0.0, runtime=100.0, eval_s=7.0, steps=5, phases=(0.01, 0.3, 0.6, 0.09, 0.0),
             evals=[(50.0, 0.6), (100.0, 0.9)])])
    collab = _write_run(store, "collab", "collaborative", [
        dict(start=0.0, runtime=150.0, steps=5, phases=(0.01, 0.3, 0.6, 0.09, 2.0), evals=[(140.0, 0.85)], net=4_000_000),
        dict(start=1.0, runtime=180.0, steps=5, phases=(0.01, 0.3, 0.6, 0.09, 2.0), evals=[(170.0, 0.80)], net=2_000_000),
    ], peers=2)
    summaries = [summarize_run(store, r) for r in (collab, base)]
    baseline = pick_baseline(summaries)
    assert baseline.run_id == base
    assert baseline.runtime_s == pytest.approx(100.0)  # evaluation time is not training time
    by_id = {c.run.run_id: c for c in compare(baseline, summaries)}
    c = by_id[collab]
    assert c.run.runtime_s == pytest.approx(180.0)  # max over peers
    assert c.run.accuracy == pytest.approx(0.85)  # max over peers
    assert c.speedup == pytest.approx(100.0 / 180.0)
    assert c.accuracy_decrease == pytest.approx(0.05)
    assert c.time_to_accuracy_s == pytest.approx(140.0)  # threshold 0.9 x 0.9 = 0.81: peer 0 reaches it at 140 s
    assert by_id[base].time_to_accuracy_s == pytest.approx(100.0)
    assert c.run.mean_net_bytes_per_peer == pytest.approx((8_000_000 + 4_000_000) / 2)  # averaged over peers
    assert c.run.workers[0].averaging_rounds == 5  # rounds count in warm-up steps too; only rates exclude them
    assert c.run.verdict.kind == "communication/averaging-bound"
    assert c.run.verdict.shares["communication"] == pytest.approx(2.0 / 3.0)
    assert baseline.verdict.kind == "compute-bound"


def test_input_bound_verdict_and_time_to_accuracy_not_reached(store):
    rid = _write_run(store, "slow-input", "single", [
        dict(start=0.0, runtime=10.0, steps=4, phases=(0.5, 0.1, 0.2, 0.0, 0.0), evals=[(10.0, 0.3)])])
    s = summarize_run(store, rid)
    assert s.verdict.kind == "input-bound"
    assert s.verdict.shares["input"] == pytest.approx(0.5 / 0.8)
    assert s.time_to_accuracy_s(0.5) is None


def test_background_cpu_is_averaged_and_named_in_the_verdict(store):
    rid = _write_run(store, "collab", "collaborative", [
        dict(start=0.0, runtime=10.0, steps=4, phases=(0.0, 0.3, 0.5, 0.0, 0.2), evals=[], background_cpu_s=0.25),
        dict(start=0.0, runtime=10.0, steps=4, phases=(0.0, 0.3, 0.5, 0.0, 0.2), evals=[], background_cpu_s=0.35)],
        peers=2)
    s = summarize_run(store, rid)
    assert [w.mean_background_cpu_s for w in s.workers] == pytest.approx([0.25, 0.35])
    assert "300 CPU-ms per step, 30% of the step" in s.verdict.explanation
    plain = summarize_run(store, _write_run(store, "base", "single", [
        dict(start=0.0, runtime=10.0, steps=4, phases=(0.0, 0.3, 0.5, 0.0, 0.0), evals=[])]))
    assert plain.workers[0].mean_background_cpu_s is None and "Background" not in plain.verdict.explanation


def test_report_files(store, tmp_path):
    base = _write_run(store, "base", "single", [
        dict(start=0.0, runtime=10.0, steps=3, phases=(0.01, 0.3, 0.6, 0.09, 0.0), evals=[(10.0, 0.9)])])
    s = summarize_run(store, base)
    out = write_report(compare(s, [s]), tmp_path / "rep", 0.8)
    assert out.name == "report.html" and out.exists()
    for png in ("step_breakdown.png", "accuracy.png", "loss.png", "network.png"):
        assert (tmp_path / "rep" / png).stat().st_size > 1000
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "| base |" in md and "compute-bound" in md
    lines = md.splitlines()
    at = lines.index(next(line for line in lines if line.startswith("| run | id | worker |")))
    header, rule, row = lines[at], lines[at + 1], lines[at + 2]
    assert header.count("|") == rule.count("|") == row.count("|")  # every column has its separator
    data = json.loads((tmp_path / "rep" / "summary.json").read_text())
    assert data["runs"][0]["runtime_s"] == pytest.approx(10.0)


def test_background_cpu_counts_other_threads_and_child_processes():
    import subprocess
    import sys
    import threading
    import time

    import psutil

    from ddlscope.measure.host import background_cpu_s

    def spin(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    before = background_cpu_s()
    spin(0.2)  # the calling thread's own CPU does not count
    assert background_cpu_s() - before < 0.1
    release = threading.Event()
    t = threading.Thread(target=lambda: (spin(0.3), release.wait(30)))
    t.start()
    child = None
    try:
        deadline = time.monotonic() + 20
        thread_cpu_s = 0.0
        while thread_cpu_s < 0.25 and time.monotonic() < deadline:  # what the kernel counts for the thread
            time.sleep(0.05)
            thread_cpu_s = next(x.user_time + x.system_time for x in psutil.Process().threads() if x.id == t.native_id)
        after_thread = background_cpu_s()
        assert after_thread - before >= thread_cpu_s - 0.03  # a live Python thread's CPU counts
        child = subprocess.Popen([sys.executable, "-c", "import time\nend = time.process_time() + 0.6\n"
                                  "while time.process_time() < end: pass\ntime.sleep(30)"])

        def child_cpu_s() -> float:  # what the kernel counts for the child itself
            c = psutil.Process(child.pid).cpu_times()
            return c.user + c.system

        deadline = time.monotonic() + 20
        while child_cpu_s() < 0.2 and time.monotonic() < deadline:
            time.sleep(0.05)
        used = child_cpu_s()
        assert used >= 0.2, f"the child used only {used:.2f} CPU-s (exit code {child.poll()})"
        # a live child's CPU counts, to the kernel's 10 ms tick
        assert background_cpu_s() - after_thread >= used - 0.03
    finally:
        release.set()
        t.join()
        if child is not None:
            child.kill()
            child.wait()
