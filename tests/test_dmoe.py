"""The dmoe distribution model: its config checks, expert placement, server schedule and launcher."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddlscope import distribution
from ddlscope.config import validate_config
from ddlscope.distribution.dmoe import DMoEConfig, expert_servers
from ddlscope.errors import UserError
from ddlscope.launch.local import service_core_sets


def dmoe(**table):
    return validate_config({"strategy": "dmoe", "model": "moe_cnn", "peers": 2, "dmoe": table})


def test_registered_as_a_swarm_model_with_services():
    m = distribution.get("dmoe")
    assert m.launcher == "swarm" and m.services is not None and m.config_table == "dmoe"


def test_grid_experts_are_dealt_to_servers_in_turn():
    d = DMoEConfig(grid_size=[2, 3], servers=4, k_best=2)
    uids = d.expert_uids()
    assert uids[:3] == ["expert.0.0", "expert.0.1", "expert.0.2"] and len(uids) == 6
    hosted = [d.server_uids(s) for s in range(4)]
    assert sorted(u for h in hosted for u in h) == sorted(uids) and all(hosted)
    assert hosted[0] == ["expert.0.0", "expert.1.1"]  # a grid row's experts on different servers
    assert DMoEConfig(servers=2).server_uids(0) == ["expert.0.0", "expert.1.0"]


@pytest.mark.parametrize("table, words", [
    ({"k_best": 5}, "k_best = 5 exceeds the 4 experts"),
    ({"k_best": 2, "k_min": 3}, "k_min = 3 exceeds k_best = 2"),
    ({"servers": 5}, "a server would host nothing"),
    ({"grid_size": [0, 2]}, "each 1..1024"),
    ({"expert": "nope"}, "'package.module:factory'"),
    ({"expert": "transformer", "hidden_dim": 40}, "multiple of 16"),
    ({"server_events": [{"server": 2, "kill_at_s": 5}]}, "server 2 does not exist"),
    ({"server_events": [{"server": 0, "restart_at_s": 5}]}, "restart_at_s needs an earlier kill_at_s"),
    ({"server_events": [{"server": 0, "kill_at_s": 5, "restart_at_s": 4}]}, "restart_at_s > kill_at_s"),
    ({"server_events": [{"server": 0, "start_at_s": 3}, {"server": 1, "start_at_s": 3}]}, "every server starts late"),
    ({"forward_timeout_s": 0}, "greater than 0"),
])
def test_bad_tables_get_one_message_naming_the_field(table, words):
    with pytest.raises(UserError) as err:
        dmoe(**table)
    assert words in str(err.value)
    assert "\n" not in str(err.value)


def test_a_server_event_after_the_time_limit_is_refused():
    with pytest.raises(UserError, match="after the run's time_limit_s = 20"):
        validate_config({"strategy": "dmoe", "model": "moe_cnn", "peers": 2, "time_limit_s": 20,
                         "dmoe": {"server_events": [{"server": 1, "kill_at_s": 25}]}})


def test_servers_and_their_schedule():
    cfg = dmoe(server_events=[{"server": 1, "kill_at_s": 10, "restart_at_s": 20}])
    services = expert_servers(cfg)
    assert [s.index for s in services] == [0, 1]
    assert services[1].kill_at_s == 10 and services[1].restart_at_s == 20 and services[0].kill_at_s is None
    assert expert_servers(dmoe(placement="local")) == []
    assert expert_servers(dmoe(initial_peers=["/ip4/127.0.0.1/tcp/1/p2p/x"])) == []


def test_services_take_free_cores_first_then_share():
    assert service_core_sets([1, 1], [[0]], cores=[0, 1, 2]) == [[1], [2]]
    assert service_core_sets([1, 1], [[0], [1]], cores=[0, 1]) == [[0], [1]]
    assert service_core_sets([2], [[0, 1]], cores=[0, 1]) == [[0, 1]]


def test_a_network_that_does_not_take_the_dataset_is_refused_before_anything_starts():
    with pytest.raises(UserError, match="allowed for 'text': moe_lm"):
        validate_config({"model": "resnet18", "dataset": "python-docs"})
    with pytest.raises(UserError, match="use model = 'moe_lm'"):
        validate_config({"strategy": "dmoe", "model": "moe_cnn", "dataset": "python-docs"})


def test_unreachable_servers_get_one_message_in_bounded_time_and_no_run(tmp_path):
    from typer.testing import CliRunner

    from ddlscope.cli import app

    dead = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWDsfU27XJQS5F2Uf722KP3teQb7vL5CcwwbQbbVr4zkfo"
    sockets = set(Path("/tmp").glob("hivemind-*.sock"))
    result = CliRunner().invoke(app, ["run", "--db", str(tmp_path / "r.db"), "--set", 'strategy="dmoe"', "--set",
                                      'model="moe_cnn"', "--set", f'dmoe.initial_peers=["{dead}"]', "--set",
                                      "dmoe.join_timeout_s=2"])
    assert isinstance(result.exception, UserError), result.output
    assert "could not reach the expert servers" in str(result.exception)
    assert not (tmp_path / "r.db").exists()
    assert set(Path("/tmp").glob("hivemind-*.sock")) <= sockets  # the failed DHT's p2pd socket went with its folder


def test_a_user_expert_with_the_wrong_shape_is_refused_before_anything_starts(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from ddlscope.cli import app

    (tmp_path / "bad_expert.py").write_text("import torch\ndef make(h):\n    return torch.nn.Linear(h, h + 1)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    result = CliRunner().invoke(app, ["run", "--db", str(tmp_path / "r.db"), "--set", 'strategy="dmoe"', "--set",
                                      'model="moe_cnn"', "--set", 'dmoe.expert="bad_expert:make"'])
    assert isinstance(result.exception, UserError), result.output
    assert "dmoe.expert = 'bad_expert:make'" in str(result.exception)
    assert not (tmp_path / "r.db").exists()


def test_a_first_service_that_hangs_is_started_once_more(tmp_path):
    from ddlscope.distribution import Service
    from ddlscope.launch.processes import stop_processes
    from ddlscope.launch.services import ServiceSupervisor
    from ddlscope.store.db import ResultsStore

    db = tmp_path / "r.db"
    with ResultsStore(db) as store:
        run_id = store.create_run("svc", "dmoe", {})
        sup = ServiceSupervisor([Service(kind="fake", index=0, module="tests.fake_service")], db, run_id, tmp_path,
                                [[0]], join_timeout_s=4.0)
        try:
            assert sup.start(store) == ["/ip4/127.0.0.1/tcp/4001"]
            rows = {r["generation"]: r for r in store.services(run_id)}
            assert rows[0]["status"] == "failed" and "started again" in rows[0]["reason"]
            assert rows[1]["status"] == "serving"
        finally:
            stop_processes(sup.popens(), 2.0)


def test_an_expert_server_start_that_never_becomes_ready_is_made_again_then_fails_with_what_hung():
    """Seen once in CI: hivemind's Server logged "Server started" and waited on its connection handler
    forever. A start not ready in time is shut down and made again; every start hanging fails naming the
    handler's process; a stop while starting ends the wait."""
    import threading
    from types import SimpleNamespace

    from ddlscope.moe.server import start_until_ready

    class FakeServer:
        def __init__(self, ready: bool):
            self.ready = threading.Event()
            if ready:
                self.ready.set()
            self.conn_handlers = [SimpleNamespace(pid=4242, ready=SimpleNamespace(done=lambda: ready))]
            self.closed = False

        def is_alive(self):
            return True

        def shutdown(self):
            self.closed = True

    made, said, cleaned = [], [], []

    def make_sequence(*ready):
        plan = list(ready)

        def make():
            made.append(FakeServer(plan.pop(0)))
            return made[-1], None
        return make

    stop = threading.Event()
    server, _ = start_until_ready(make_sequence(False, True), stop, said.append, lambda: cleaned.append(1),
                                  timeout_s=0.3)
    assert server is made[1] and made[0].closed and cleaned == [1]
    assert said == ["hivemind's server was not ready after 0.3 s: its connection handler process (pid 4242) did "
                    "not start serving (start 1 of 2)"]
    made.clear()
    with pytest.raises(RuntimeError, match=r"pid 4242\) did not start serving, in each of 2 starts"):
        start_until_ready(make_sequence(False, False), stop, said.append, lambda: None, timeout_s=0.3)
    assert len(made) == 2
    stop.set()
    server, _ = start_until_ready(make_sequence(False), stop, said.append, lambda: None, timeout_s=60)
    assert not server.ready.is_set()  # stopped while starting: the caller sees the stop and ends
