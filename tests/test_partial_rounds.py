"""Partial averaging rounds: hivemind's averagers drop a peer's chunks after next_chunk_timeout and say so
only in their own processes' warnings; ddlscope catches, stores and reports them."""

from __future__ import annotations

import json
import logging
import multiprocessing

import pytest

from ddlscope.analyze.swarm import analyze_swarm, partial_rounds, swarm_markdown
from ddlscope.config import validate_config
from ddlscope.launch.local import run_local
from ddlscope.store.db import ResultsStore
from ddlscope.strategies.collaborative import PartialRoundLog, forked
from tests.conftest import bare_peer, can_emulate, stored_swarm_run, tiny_run

PARTITION = logging.getLogger(PartialRoundLog.LOGGER)


def _warn_in_child(messages: list[str]) -> None:
    for m in messages:
        PARTITION.warning(m)


def test_partial_round_warnings_reach_the_peer_from_a_forked_averager_process(tmp_path):
    catcher = PartialRoundLog(str(tmp_path / "partial.jsonl"))
    PARTITION.addHandler(catcher)
    try:
        child = multiprocessing.get_context("fork").Process(target=_warn_in_child, args=(
            ["Reducer: received 60.0% of input tensors", "some other warning", "Averaging: received 94.1% results"],))
        child.start()
        child.join(30)
        PARTITION.warning("Reducer: received 99.6% of input tensors")  # the peer's own process counts too
    finally:
        PARTITION.removeHandler(catcher)
    assert forked(child) and not forked(multiprocessing.get_context("spawn").Process(target=print))  # not started
    got = catcher.take()
    assert [(w["pid"], w["side"], w["received_percent"]) for w in got] == [
        (child.pid, "inputs", 60.0), (child.pid, "results", 94.1), (multiprocessing.current_process().pid, "inputs", 99.6)]
    assert all(w["at"] > 0 for w in got)
    assert catcher.take() == []  # each warning once
    with open(catcher.path, "a") as f:  # a line still being written waits for the next call
        f.write('{"at": 1.0, "pid": 5, "side": "inputs", ')
    assert catcher.take() == []
    with open(catcher.path, "a") as f:
        f.write('"received_percent": 50.0}\n')
    assert [w["received_percent"] for w in catcher.take()] == [50.0]


def test_each_partial_round_is_stored_with_its_kind_of_round(tmp_path):
    events = []
    peer = bare_peer(1, 4, events)
    peer._partial = PartialRoundLog(str(tmp_path / "p.jsonl"))
    peer._averager_rounds = {101: "parameters", 102: "gradients"}
    lines = [dict(at=1.5, pid=101, side="inputs", received_percent=60.0),
             dict(at=1.6, pid=102, side="results", received_percent=94.1),
             dict(at=1.7, pid=999, side="inputs", received_percent=10.0)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    peer._store_partial_rounds()
    assert [(e[1], e[2], e[3]["round"], e[3]["side"], e[3]["received_percent"], e[3]["epoch"]) for e in events] == [
        (1, "partial_average", "parameters", "inputs", 60.0, 4), (1, "partial_average", "gradients", "results", 94.1, 4),
        (1, "partial_average", "unknown", "inputs", 10.0, 4)]


def test_partial_rounds_are_counted_per_round_and_shown_only_where_they_were_counted(tmp_path):
    with ResultsStore(tmp_path / "r.db") as store:
        run_id = stored_swarm_run(store)
        for peer in (0, 1):  # peer 2: a run from before partial rounds were counted
            store.add_event(run_id, peer, "strategy_details", role="trainer", partial_rounds_counted=True)
        # peer 0: one parameter round that warned twice (inputs and results), one gradient round
        store.add_event(run_id, 0, "partial_average", round="parameters", side="inputs", received_percent=60.0, epoch=3)
        store.add_event(run_id, 0, "partial_average", round="parameters", side="results", received_percent=94.1, epoch=3)
        store.add_event(run_id, 0, "partial_average", round="gradients", side="inputs", received_percent=99.6, epoch=5)
        events = store.rows("events", run_id)
        analysis = analyze_swarm(store, run_id)
    assert partial_rounds(events, 0) == {"gradients": 1, "parameters": 1}
    assert partial_rounds(events, 1) == {}  # counted, none: 0, not unknown
    assert partial_rounds(events, 2) is None
    assert analysis.next_chunk_timeout_s == 1.0  # hivemind's default: the matchmaking time
    text = swarm_markdown(analysis)
    rows = {line.split("|")[1].strip(): line.split("|")[6].strip() for line in text.splitlines()
            if line.startswith("| ") and line.split("|")[1].strip().isdigit()}
    assert rows == {"0": "2", "1": "0", "2": "-"}
    assert "Partial rounds: peer 0 1 gradients, 1 parameters." in text and "within next_chunk_timeout (1 s)" in text


@pytest.mark.slow
@pytest.mark.skipif(not can_emulate, reason="needs root and iproute2 for the emulated links")
def test_a_real_swarm_over_a_slow_link_stores_its_partial_rounds(env_data, db_path):
    """hivemind's own warnings, from its forked averagers, reach the store. Peer 1's link (2 Mbit/s) carries
    a 512 KiB chunk of moe_cnn's 0.7 MB of gradients in about 2 s, four times the 0.5 s chunk timeout, so a round
    with both peers drops chunks whatever the machine's load. (A tiny model on loopback with a tiny timeout
    did not: its chunks sometimes came in time, and the timeout also broke its state downloads.)"""
    cfg = validate_config(tiny_run(
        model="moe_cnn", strategy="collaborative", peers=2, share_cores=True, sample_budget=None, time_limit_s=15,
        network=dict(emulate=True, bandwidth_mbit_per_s=200, links=[dict(peer=1, bandwidth_mbit_per_s=2)]),
        collaborative=dict(target_batch_size=64, matchmaking_time_s=1.0, averaging_timeout_s=10.0,
                           next_chunk_timeout_s=0.5)))
    run_id = run_local(cfg, db_path, progress=False)
    with ResultsStore(db_path) as store:
        assert store.run(run_id)["status"] == "completed", store.run(run_id)["reason"]
        events = store.rows("events", run_id)
        analysis = analyze_swarm(store, run_id)
    stored = [json.loads(e["detail_json"]) for e in events if e["kind"] == "partial_average"]
    assert stored, [(e["kind"], e["detail_json"]) for e in events][:40]
    assert {w["round"] for w in stored} <= {"gradients", "parameters"}  # every warning traced to its averager
    assert all(0 <= w["received_percent"] < 100 for w in stored)
    assert any(p.partial_rounds for p in analysis.peers)
