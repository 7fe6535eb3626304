"""Partial averaging rounds and join requests that timed out: hivemind's averagers drop a peer's chunks after
next_chunk_timeout, and give up on a potential leader after request_timeout, and say so only in their own
processes' logs; ddlscope catches, stores and reports them."""

from __future__ import annotations

import json
import logging
import multiprocessing

import pytest

from ddlscope.analyze.swarm import analyze_swarm, join_timeouts, partial_rounds, swarm_markdown
from ddlscope.config import validate_config
from ddlscope.launch.local import run_local
from ddlscope.store.db import ResultsStore
from ddlscope.strategies.collaborative import AveragerLog, _RoundLog, forked
from tests.conftest import bare_peer, can_emulate, stored_swarm_run, tiny_run

PARTITION = logging.getLogger(AveragerLog.PARTITION)
MATCHMAKING = logging.getLogger(AveragerLog.MATCHMAKING)
#: hivemind 1.1.12's message (matchmaking.py, ``_request_join_group``) as its f-string renders it
JOIN_TIMEOUT = "Matchmaking(peer_id=A, looking for group) - potential leader B did not respond within 3.0"


def _log_in_child(warnings: list[str], debug: list[str]) -> None:
    for m in warnings:
        PARTITION.warning(m)
    for m in debug:
        MATCHMAKING.debug(m)


def test_averager_messages_reach_the_peer_from_a_forked_averager_process(tmp_path):
    from hivemind.utils.logging import get_logger

    hivemind_log = get_logger("hivemind")  # where hivemind's own log handler sits (in a peer: its stderr)
    seen = _RoundLog()  # keeps the messages that reach it
    hivemind_log.addHandler(seen)
    level, propagate = MATCHMAKING.level, MATCHMAKING.propagate
    catcher = AveragerLog(str(tmp_path / "averagers.jsonl"))
    catcher.install()
    try:
        child = multiprocessing.get_context("fork").Process(target=_log_in_child, args=(
            ["Reducer: received 60.0% of input tensors", "some other warning", "Averaging: received 94.1% results"],
            [JOIN_TIMEOUT, "some other debug message"]))
        child.start()
        child.join(30)
        PARTITION.warning("Reducer: received 99.6% of input tensors")  # the peer's own process counts too
        MATCHMAKING.debug(JOIN_TIMEOUT.replace("3.0", "0.5"))
        MATCHMAKING.info("an info message of the matchmaking")
    finally:
        catcher.remove()
        hivemind_log.removeHandler(seen)
    assert (MATCHMAKING.level, MATCHMAKING.propagate) == (level, propagate)  # as before
    assert forked(child) and not forked(multiprocessing.get_context("spawn").Process(target=print))  # not started
    got = catcher.take()
    me = multiprocessing.current_process().pid
    assert [(w["pid"], w["kind"], w.get("side"), w.get("received_percent"), w.get("timeout_s")) for w in got] == [
        (child.pid, "partial", "inputs", 60.0, None), (child.pid, "partial", "results", 94.1, None),
        (child.pid, "join_timeout", None, None, 3.0), (me, "partial", "inputs", 99.6, None),
        (me, "join_timeout", None, None, 0.5)]
    assert all(w["at"] > 0 for w in got)
    assert catcher.take() == []  # each message once
    # hivemind's own log gets the matchmaking's INFO message, not the DEBUG one caught
    assert "an info message of the matchmaking" in seen.messages, seen.messages
    assert not [m for m in seen.messages if "did not respond" in m], seen.messages
    with open(catcher.path, "a") as f:  # a line still being written waits for the next call
        f.write('{"at": 1.0, "pid": 5, "kind": "partial", "side": "inputs", ')
    assert catcher.take() == []
    with open(catcher.path, "a") as f:
        f.write('"received_percent": 50.0}\n')
    assert [w["received_percent"] for w in catcher.take()] == [50.0]


def test_the_join_timeout_message_is_still_the_one_hivemind_logs():
    """The catcher reads hivemind's DEBUG text; a hivemind that words it otherwise would count nothing."""
    import inspect

    from hivemind.averaging import matchmaking

    source = inspect.getsource(matchmaking.Matchmaking._request_join_group)
    assert 'potential leader {leader} did not respond within {self.request_timeout}' in source
    assert matchmaking.logger.name == AveragerLog.MATCHMAKING


def test_each_partial_round_and_join_timeout_is_stored_with_its_kind_of_round(tmp_path):
    events = []
    peer = bare_peer(1, 4, events)
    peer._averager_log = AveragerLog(str(tmp_path / "p.jsonl"))
    peer._averager_rounds = {101: "parameters", 102: "gradients"}
    lines = [dict(at=1.5, pid=101, kind="partial", side="inputs", received_percent=60.0),
             dict(at=1.6, pid=102, kind="partial", side="results", received_percent=94.1),
             dict(at=1.7, pid=999, kind="partial", side="inputs", received_percent=10.0),
             dict(at=1.8, pid=102, kind="join_timeout", timeout_s=3.0)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    peer._store_averager_log()
    assert [(e[1], e[2], e[3]["round"], e[3].get("side"), e[3].get("received_percent"), e[3].get("timeout_s"),
             e[3]["epoch"]) for e in events] == [
        (1, "partial_average", "parameters", "inputs", 60.0, None, 4),
        (1, "partial_average", "gradients", "results", 94.1, None, 4),
        (1, "partial_average", "unknown", "inputs", 10.0, None, 4),
        (1, "join_timeout", "gradients", None, None, 3.0, 4)]


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


def test_join_timeouts_are_counted_per_round_with_their_seconds_and_shown_only_where_counted(tmp_path):
    with ResultsStore(tmp_path / "r.db") as store:
        run_id = stored_swarm_run(store)
        for peer in (0, 1):  # peer 2: a run from before join timeouts were counted
            store.add_event(run_id, peer, "strategy_details", role="trainer", join_timeouts_counted=True)
        # peer 1: one gradient round that timed out twice (6 s), one parameter round
        for epoch, kind in ((4, "gradients"), (4, "gradients"), (6, "parameters")):
            store.add_event(run_id, 1, "join_timeout", round=kind, timeout_s=3.0, epoch=epoch)
        events = store.rows("events", run_id)
        analysis = analyze_swarm(store, run_id)
    assert [join_timeouts(events, p) for p in (0, 1, 2)] == [{}, {"gradients": 1, "parameters": 1}, None]
    assert [p.join_timeout_s for p in analysis.peers] == [0.0, 9.0, 0.0]
    text = swarm_markdown(analysis)
    rows = {line.split("|")[1].strip(): line.split("|")[7].strip() for line in text.splitlines()
            if line.startswith("| ") and line.split("|")[1].strip().isdigit()}
    assert rows == {"0": "0", "1": "2", "2": "-"}
    assert "Join timeouts: peer 1 1 gradients, 1 parameters (9.0 s)." in text


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
                           next_chunk_timeout_s=0.5, request_timeout_s=0.5)))
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
    # the same handler counts the join requests that timed out (none need have), and hivemind's log gains no DEBUG
    assert all(p.join_timeouts is not None for p in analysis.peers), [p.join_timeouts for p in analysis.peers]
    details = [json.loads(e["detail_json"]) for e in events if e["kind"] == "strategy_details"]
    assert [d["averager_request_timeouts_s"] for d in details] == [[0.5, 0.5]] * 2  # both averagers of both peers
    logs = sorted((db_path.parent / "logs" / run_id).glob("worker-*.log"))
    assert len(logs) == 2 and not [line for log in logs for line in log.read_text(errors="replace").splitlines() if "[DEBUG]" in line]
