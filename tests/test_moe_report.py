"""The report's mixture-of-experts view (ddlscope.analyze.moe) on runs written by hand into a store.

The remote run: 2 trainers, 2 expert servers (s0 hosts expert.0.*, s1 expert.1.*), 8 samples per
step, each sample sent to 2 experts. Timeline (seconds after the services started):

- 2.0 .. 9.5: a step every 0.5 s (steps 0-15), every call answered;
- 10.0: s1 is killed; steps 16 and 17 start at 10 and 12 and wait 1.5 s for s1's experts, whose
  8 forward calls per step fail, 2 samples per step get no answer;
- 14.0 .. 19.5: a step every 0.5 s (steps 18-29), only s0's experts are chosen.
"""

from __future__ import annotations

import json

import pytest

from ddlscope.analyze.compare import compare, summarize_run
from ddlscope.analyze.moe import summarize_moe, weighted_quantile
from ddlscope.analyze.report import write_report
from ddlscope.store.db import ResultsStore

T0 = 1_700_000_000.0  # Unix time the services started (0 on the timeline)
KIND = "expert server"
PEERS = {0: "12D3KooWserverZero", 1: "12D3KooWserverOne"}
EXPERTS = {0: ["expert.0.0", "expert.0.1"], 1: ["expert.1.0", "expert.1.1"]}
SAMPLES = 8
ANSWER_S = 0.02  # latency of an answered call
TIMEOUT_S = 1.5  # latency of a call to the killed server


@pytest.fixture
def store(tmp_path):
    with ResultsStore(tmp_path / "r.db") as s:
        yield s


def _event(store, run_id, event, at_s, **detail):
    """An event at a chosen time, as the launcher writes it (``add_event`` stamps the current time)."""
    store.conn.execute("INSERT INTO events VALUES (?, ?, ?, ?, ?)",
                       (run_id, None, T0 + at_s, event, json.dumps(dict(detail, at_s=at_s))))


def _phase(step: int) -> str:
    return "before" if step < 16 else "slow" if step < 18 else "after"


def _step_start(step: int) -> float:
    return {"before": 2.0 + 0.5 * step, "slow": 10.0 + 2.0 * (step - 16), "after": 14.0 + 0.5 * (step - 18)}[_phase(step)]


def _remote_run(store, name="remote", server0_compute_s=0.005):
    run_id = store.create_run(name, "dmoe", {"peers": 2})
    for s in (0, 1):
        store.upsert_service(run_id, KIND, s, 0, pid=None, peer_id=PEERS[s], experts=json.dumps(EXPERTS[s]),
                             status="killed" if s else "stopped", reason="killed with SIGKILL at 10.0 s" if s else None,
                             started_at=T0 + 0.2 + s, ended_at=T0 + (10.0 if s else 20.5))
        _event(store, run_id, "service_started", 0.0 + s, service=KIND, index=s, generation=0)
        store.add_rows("moe_server_samples", [
            dict(run_id=run_id, service_index=s, generation=0, wall_time=T0 + 5.0, cpu_s=1.0 + s, pss_bytes=100_000_000),
            dict(run_id=run_id, service_index=s, generation=0, wall_time=T0 + 9.0, cpu_s=2.5 + s, pss_bytes=150_000_000)])
    _event(store, run_id, "service_killed", 10.0, service=KIND, index=1, generation=0)
    for wi in (0, 1):
        store.upsert_worker(run_id, wi, status="completed", train_start_time=T0 + 2.0, train_end_time=T0 + 20.0)
        for step in range(30):
            phase, t = _phase(step), _step_start(step)
            wait_fwd = TIMEOUT_S if phase == "slow" else 0.2
            comm = 0.05 + wait_fwd + 0.1
            store.add_step(run_id, wi, dict(step=step, wall_time=T0 + t, samples=SAMPLES, data_load_s=0.01,
                                            forward_s=0.05, backward_s=0.05, optimizer_s=0.04, averaging_s=0.0,
                                            comm_wait_s=comm, step_s=0.15 + comm, loss=1.0, warmup=int(step == 0),
                                            optimizer_stepped=1))
            calls, batches = [], []
            for s in (0, 1):
                for uid in EXPERTS[s]:
                    if phase == "after" and s == 1:
                        continue
                    n = 8 if phase == "after" else 4  # forward calls (= samples) to this expert
                    failed = n if (phase == "slow" and s == 1) else 0
                    lat = TIMEOUT_S if failed else ANSWER_S
                    calls.append(dict(run_id=run_id, worker_index=wi, step=step, expert=uid, direction="forward",
                                      peer_id=PEERS[s], calls=n, failed=failed, latency_s_sum=n * lat,
                                      latency_s_max=lat, bytes_sent=n * 256, bytes_received=n * 256 if not failed else 0))
                    if not failed:
                        calls.append(dict(run_id=run_id, worker_index=wi, step=step, expert=uid, direction="backward",
                                          peer_id=PEERS[s], calls=n, failed=0, latency_s_sum=n * ANSWER_S,
                                          latency_s_max=ANSWER_S, bytes_sent=n * 256, bytes_received=n * 256))
                answered = sum(c["calls"] for c in calls if c["peer_id"] == PEERS[s] and c["direction"] == "forward"
                               and not c["failed"])
                for direction in ("forward", "backward"):
                    if answered:
                        batches.append(dict(run_id=run_id, service_index=s, generation=0, wall_time=T0 + t + 0.1,
                                            expert=EXPERTS[s][0], direction=direction, batch_size=answered,
                                            queue_wait_s=0.001, compute_s=server0_compute_s if s == 0 else 0.005))
            store.add_rows("moe_calls", calls)
            store.add_rows("moe_server_batches", batches)
            store.add_rows("moe_steps", [dict(
                run_id=run_id, worker_index=wi, step=step, wall_time=T0 + t, samples=SAMPLES, beam_search_s=0.05,
                expert_forward_s=wait_fwd, expert_backward_s=0.1,
                forward_calls=sum(c["calls"] for c in calls if c["direction"] == "forward"),
                backward_calls=sum(c["calls"] for c in calls if c["direction"] == "backward"),
                failed_calls=sum(c["failed"] for c in calls), samples_dropped=2 if phase == "slow" else 0,
                bytes_sent=sum(c["bytes_sent"] for c in calls), bytes_received=sum(c["bytes_received"] for c in calls),
                experts_chosen=2 * SAMPLES)])
        store.add_eval(run_id, wi, 14, 7.5, 0.8, 0.5, 100)  # after step 14: ends at 9.5 s, before the kill
        store.add_eval(run_id, wi, 17, 12.0, 0.7, 0.6, 100)  # after step 17: ends at 13.8 s, after it
    store.finish_run(run_id, "completed")
    return run_id


def _local_run(store):
    """One trainer, in-process experts: only forward_calls and per-expert forward load."""
    run_id = store.create_run("local", "dmoe", {"peers": 1})
    store.upsert_worker(run_id, 0, status="completed", train_start_time=T0, train_end_time=T0 + 5.0)
    for step in range(10):
        store.add_step(run_id, 0, dict(step=step, wall_time=T0 + 0.5 * step, samples=SAMPLES, data_load_s=0.01,
                                       forward_s=0.2, backward_s=0.2, optimizer_s=0.05, step_s=0.46, loss=1.0,
                                       warmup=int(step == 0), optimizer_stepped=1))
        load = {"expert.0.0": 5, "expert.0.1": 3, "expert.1.0": 6, "expert.1.1": 2}
        store.add_rows("moe_steps", [dict(run_id=run_id, worker_index=0, step=step, wall_time=T0 + 0.5 * step,
                                          samples=SAMPLES, forward_calls=sum(load.values()))])
        store.add_rows("moe_calls", [dict(run_id=run_id, worker_index=0, step=step, expert=uid, direction="forward",
                                          peer_id=None, calls=n, failed=0) for uid, n in load.items()])
    store.finish_run(run_id, "completed")
    return run_id


def _plain_run(store):
    run_id = store.create_run("base", "single", {"peers": 1})
    store.upsert_worker(run_id, 0, status="completed", train_start_time=T0, train_end_time=T0 + 3.0)
    for step in range(3):
        store.add_step(run_id, 0, dict(step=step, wall_time=T0 + step, samples=SAMPLES, data_load_s=0.01, forward_s=0.3,
                                       backward_s=0.6, optimizer_s=0.09, step_s=1.0, loss=1.0, warmup=int(step == 0),
                                       optimizer_stepped=1))
    store.add_eval(run_id, 0, 2, 3.0, 0.9, 0.3, 100)
    store.finish_run(run_id, "completed")
    return run_id


def test_remote_run_per_trainer_server_and_expert_figures(store):
    s = summarize_moe(store, _remote_run(store))
    assert s.remote and [t.worker_index for t in s.trainers] == [0, 1]
    t = s.trainers[0]
    assert t.steps == 30 and t.timed_steps == 29  # step 0 is warm-up
    assert t.mean_beam_search_s == pytest.approx(0.05)
    assert t.mean_expert_forward_s == pytest.approx((27 * 0.2 + 2 * TIMEOUT_S) / 29)
    assert t.mean_trunk_s == pytest.approx(0.14)
    # per trainer: 16 steps x 32 calls, 2 x (16 forward + 8 backward), 12 x 32; 2 x 8 failed
    assert t.calls == 16 * 32 + 2 * 24 + 12 * 32 and t.failed_calls == 16
    assert t.failure_rate == pytest.approx(16 / 944)
    assert t.samples == 240 and t.samples_dropped == 4 and t.dropped_share == pytest.approx(4 / 240)
    assert t.mean_call_latency_s == pytest.approx((928 * ANSWER_S + 16 * TIMEOUT_S) / 944)
    assert t.mean_answered_latency_s == pytest.approx(ANSWER_S)
    assert t.p95_call_latency_s == pytest.approx(ANSWER_S)  # 16 of 944 calls (1.7 %) are slow
    assert t.max_call_latency_s == pytest.approx(TIMEOUT_S)
    assert s.overall.calls == 2 * 944 and s.overall.samples_dropped == 8
    assert s.overall.dropped_share == pytest.approx(8 / 480)

    by_label = {x.label: x for x in s.servers}
    s0, s1 = by_label["expert server 0"], by_label["expert server 1"]
    assert s0.calls == 2 * (16 * 16 + 2 * 16 + 12 * 32) and s0.failed == 0
    assert s0.payload_bytes == s0.calls * 512  # 256 B each way per answered call
    assert s1.calls == 2 * (16 * 16 + 2 * 8) and s1.failed == 2 * 2 * 8 and s1.answered == 2 * 16 * 16
    assert s1.status == "killed" and "SIGKILL" in s1.reason
    assert s0.batches == 2 * 30 * 2 and s1.batches == 2 * 16 * 2
    assert s0.mean_batch_size == pytest.approx((2 * 2 * (16 * 8 + 2 * 8 + 12 * 16)) / s0.batches)
    assert s1.lifetime_s == pytest.approx(10.0 - 1.2)
    assert s1.compute_s == pytest.approx(64 * 0.005) and s1.busy_fraction == pytest.approx(64 * 0.005 / 8.8)
    assert s1.mean_queue_wait_s == pytest.approx(0.001) and s1.p95_queue_wait_s == pytest.approx(0.001)
    assert s1.cpu_s == pytest.approx(3.5) and s1.peak_pss_bytes == 150_000_000
    assert s1.started_at_s == pytest.approx(1.2) and s1.ended_at_s == pytest.approx(10.0)

    load = {e.expert: e for e in s.experts}
    assert load["expert.0.0"].forward_calls == 2 * (16 * 4 + 2 * 4 + 12 * 8)
    assert load["expert.1.0"].forward_calls == 2 * (16 * 4 + 2 * 4) and load["expert.1.0"].failed == 2 * 2 * 4
    assert load["expert.1.0"].servers == ["expert server 1"] and load["expert.0.1"].servers == ["expert server 0"]
    assert sum(e.share for e in s.experts) == pytest.approx(1.0)
    assert s.load_imbalance == pytest.approx(168 / ((168 + 72) / 2))


def test_remote_run_timeline_dips_after_the_kill(store):
    s = summarize_moe(store, _remote_run(store))
    assert [(e.what, e.service_index, e.at_s) for e in s.events] == [("started", 0, 0.0), ("started", 1, 1.0),
                                                                      ("killed", 1, 10.0)]
    points = dict(s.timeline[0].points)  # window middle -> samples/s of trainer 0
    assert points[3.0] == pytest.approx(16.0)  # 4 steps of 8 samples in [2, 4)
    assert points[11.0] == pytest.approx(4.0) and points[13.0] == pytest.approx(4.0)  # one step per window
    assert points[15.0] == pytest.approx(16.0)  # recovered on s0's experts
    (fault,) = s.faults
    assert fault.event.what == "killed" and fault.event.service_index == 1
    assert fault.samples_per_s_before == pytest.approx(2 * 16 * SAMPLES / 8.0)  # [2, 10)
    assert fault.samples_per_s_after == pytest.approx(2 * 14 * SAMPLES / 10.0)  # [10, 20)
    assert fault.lowest_window_samples_per_s_after == pytest.approx(8.0)
    assert fault.dropped_share_before == 0.0 and fault.dropped_share_after == pytest.approx(8 / (2 * 14 * SAMPLES))
    assert fault.failed_calls_after == 32
    assert fault.accuracy_before == pytest.approx(0.8) and fault.accuracy_after == pytest.approx(0.7)


def test_verdict_names_the_largest_share_and_who_makes_it(store):
    s = summarize_moe(store, _remote_run(store))
    shares = s.verdict.shares
    assert max(shares, key=shares.get) == "remote expert wait"
    step = (27 * 0.5 + 2 * 1.8) / 29  # steps outside warm-up: 0.15 s of own work + the remote wait
    assert shares["remote expert wait"] == pytest.approx(((27 * 0.2 + 2 * TIMEOUT_S) / 29 + 0.1) / step)
    assert shares["beam search"] == pytest.approx(0.05 / step)
    assert s.verdict.kind == "remote-expert-bound (per-call RPC overhead)"  # servers 3 % busy, 6 of 20 ms per call
    assert "32 of 1888 expert calls failed (1.7%); 8 of 480 samples (1.7%)" in s.verdict.explanation
    busy = summarize_moe(store, _remote_run(store, "busy", server0_compute_s=0.1))
    assert busy.verdict.kind == "remote-expert-bound (expert compute)"
    assert "the busiest, expert server 0, computed 59% of its lifetime" in busy.verdict.explanation


def test_local_placement_shows_load_per_expert_without_servers(store):
    s = summarize_moe(store, _local_run(store))
    assert not s.remote and s.servers == [] and s.events == [] and s.faults == []
    assert {e.expert: e.forward_calls for e in s.experts} == {"expert.0.0": 50, "expert.0.1": 30, "expert.1.0": 60,
                                                              "expert.1.1": 20}
    assert all(e.servers == [] for e in s.experts)
    assert s.load_imbalance == pytest.approx(60 / 40)
    assert s.overall.failed_calls is None and s.overall.mean_call_latency_s is None
    assert s.verdict.kind == "trunk-compute-bound (in-process experts)"
    assert s.timeline[0].points[0] == (1.0, pytest.approx(4 * SAMPLES / 2.0))  # timeline from the first step
    # the last window [4, 6) has steps at 4.0 and 4.5; the trainer trained until 4.96 s: 16 samples / 0.96 s
    assert s.timeline[0].points[-1] == (5.0, pytest.approx(2 * SAMPLES / 0.96))


def test_run_without_moe_rows_has_no_summary(store):
    assert summarize_moe(store, _plain_run(store)) is None
    with pytest.raises(KeyError):
        summarize_moe(store, "nope")
    with pytest.raises(ValueError, match="window_s"):
        summarize_moe(store, _plain_run(store), window_s=0)


def test_weighted_quantile_is_nearest_rank():
    assert weighted_quantile([(1.0, 94), (9.0, 6)], 0.95) == 9.0
    assert weighted_quantile([(1.0, 96), (9.0, 4)], 0.95) == 1.0
    assert weighted_quantile([], 0.95) is None


def test_report_has_the_section_plots_and_json(store, tmp_path):
    base = summarize_run(store, _plain_run(store))
    remote = summarize_run(store, _remote_run(store))
    local = summarize_run(store, _local_run(store))
    assert base.moe is None and remote.moe is not None
    write_report(compare(base, [base, remote, local]), tmp_path / "rep")
    for png in ("moe_expert_load.png", "moe_servers.png", "moe_timeline.png"):
        assert (tmp_path / "rep" / png).stat().st_size > 5000
    md = (tmp_path / "rep" / "report.md").read_text()
    section = md[md.index("## Mixture of experts"):md.index("## Plots")]
    assert "### Expert servers" in section and "| remote (" in section and "| local (" in section
    assert "| expert server 1 | killed |" in section
    assert "s1 killed" in section and "32.0 -> 22.4" in section and "0.800 -> 0.700" in section
    assert "remote-expert-bound (per-call RPC overhead)" in section
    assert "base (" not in section  # the run without moe rows is not in the section
    assert "![moe_timeline.png](moe_timeline.png)" in md
    lines = section.splitlines()
    for i, line in enumerate(lines):  # every row of a table has its header's columns
        if line.startswith("|") and i and lines[i - 1].startswith("|"):
            assert line.count("|") == lines[i - 1].count("|"), line
    data = json.loads((tmp_path / "rep" / "summary.json").read_text())
    moe = {r["name"]: r["moe"] for r in data["runs"]}
    assert moe["base"] is None and moe["remote"]["overall"]["failed_calls"] == 32
    assert moe["local"]["servers"] == []


def test_report_without_moe_rows_has_no_section(store, tmp_path):
    base = summarize_run(store, _plain_run(store))
    write_report(compare(base, [base]), tmp_path / "rep")
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "Mixture of experts" not in md
    assert not list((tmp_path / "rep").glob("moe_*.png"))
