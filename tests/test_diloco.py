"""DiLoCo (``diloco``): its config table, its cost and memory models, and — with 2 gloo workers on
tiny_cnn — that it trains like ddp where the maths says it must, and sends H times fewer bytes."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import dist_check  # noqa: E402
from conftest import tiny_run  # noqa: E402
from test_costs import make_cluster, make_profile  # noqa: E402

from ddlscope import distribution  # noqa: E402
from ddlscope.config import validate_config  # noqa: E402
from ddlscope.errors import UserError  # noqa: E402

MIB = 1024 * 1024


# ----------------------------------------------------------------------------- config and registry
@pytest.mark.parametrize("table, message", [
    ({"inner_steps": 0}, "diloco.inner_steps: Input should be greater than or equal to 1 (got 0)"),
    ({"outer_learning_rate": 0}, "diloco.outer_learning_rate: Input should be greater than 0 (got 0)"),
    ({"outer_momentum": 1.0}, "diloco.outer_momentum: Input should be less than 1 (got 1.0)"),
    ({"outer_momentum": 0.0}, "diloco: nesterov = true needs outer_momentum > 0 (torch.optim.SGD); allowed: "),
    ({"inner_step": 5}, "diloco.inner_step: unknown field"),
    ({"inner_steps": 11}, "diloco.inner_steps = 11 but sample_budget = 320 gives each worker only 10 optimizer "
                          "step(s) (budget / (peers x batch_size x gradient_accumulation_steps)), so no outer step "
                          "would run; allowed: inner_steps <= 10 or sample_budget >= 352"),
])
def test_bad_diloco_tables_get_one_clear_message(table, message):
    with pytest.raises(UserError) as err:
        validate_config(tiny_run(strategy="diloco", peers=2, vcpus_per_peer=1, diloco=table))
    assert message in str(err.value) and str(err.value).count(";") <= 2  # one problem, one message


def test_the_registry_lists_diloco_with_its_table_and_the_ddp_batch_rule():
    model = distribution.get("diloco")
    assert "diloco" in distribution.names() and model.launcher == "torchrun"
    assert distribution.config_tables()["diloco"] is model.config_class
    cfg = validate_config(tiny_run(strategy="diloco", peers=2, vcpus_per_peer=1,
                                   diloco={"inner_steps": 5, "nesterov": False, "outer_momentum": 0}))
    assert cfg.global_batch_size == 2 * 16 and cfg.data_parallel_size == 2
    assert cfg.model_options() == {"inner_steps": 5, "outer_learning_rate": 0.7, "outer_momentum": 0.0,
                                   "nesterov": False}
    defaults = model.config_class()
    assert (defaults.outer_learning_rate, defaults.outer_momentum, defaults.nesterov) == (0.7, 0.9, True)


# ----------------------------------------------------------------------------- cost and memory models
def _setting(strategy: str, workers: int = 4, batch: int = 8, **options):
    from ddlscope.modeling.prediction import Setting

    return Setting(strategy, workers, batch, epoch_samples=3200, options=options)


def test_cost_model_amortises_one_parameter_all_reduce_over_h_steps():
    from ddlscope.measure.parts import STEP_PARTS
    from ddlscope.modeling.collectives import ring_allreduce_s
    from ddlscope.modeling.prediction import predict

    prof = make_profile(layer_params_bytes=(100 * MIB,) * 4)  # many parameters, little compute: a slow network hurts
    slow = make_cluster(bw=0.5)
    ddp = predict(prof, slow, _setting("ddp"))
    h = 8
    diloco = predict(prof, slow, _setting("diloco", inner_steps=h))

    assert list(diloco.breakdown_s) == list(STEP_PARTS)
    round_comm_s = ring_allreduce_s(prof.param_bytes, 4, slow.ring_link(4), slow.collective_fixed_s)
    assert diloco.inputs["round_comm_s"] == pytest.approx(round_comm_s)
    # ddp all-reduces all gradients every step; diloco the same bytes once per H steps: H times less per step
    assert diloco.inputs["comm_bytes_per_step"] * h == prof.param_bytes
    assert round_comm_s / h == pytest.approx(ddp.inputs["comm_s"] / h, rel=0.01)  # ddp: the same bytes, in buckets
    assert diloco.breakdown_s["averaging_s"] == pytest.approx((round_comm_s + diloco.inputs["round_local_s"]) / h)
    assert diloco.step_s < ddp.step_s / 2 and diloco.breakdown_s["comm_wait_s"] == 0.0
    one_step = predict(prof, slow, _setting("diloco", inner_steps=1))
    assert one_step.breakdown_s["averaging_s"] == pytest.approx(h * diloco.breakdown_s["averaging_s"])
    assert diloco.epoch_s == pytest.approx(diloco.step_s * 3200 / (4 * 8))  # 4 workers x 8 samples per step
    # ranked by time, but local steps are not synchronous steps: the prediction says so, H = 1 does not need to
    assert any("accuracy per sample" in n for n in diloco.notes) and not one_step.notes


def test_bad_options_of_a_predicted_setting_get_one_clear_message():
    from ddlscope.modeling.memory import setting_memory
    from ddlscope.modeling.prediction import predict

    prof = make_profile()
    with pytest.raises(UserError, match=r"^invalid setting: diloco.inner_steps: Input should be greater than or "
                                        r"equal to 1 \(got 0\)$"):
        predict(prof, make_cluster(), _setting("diloco", inner_steps=0))
    with pytest.raises(UserError, match="invalid setting: diloco: nesterov = true needs outer_momentum > 0"):
        setting_memory(prof, _setting("diloco", outer_momentum=0.0))


def test_memory_model_is_ddps_replica_without_buckets_plus_the_outer_state():
    from ddlscope.modeling.memory import setting_memory

    prof = make_profile()
    P = prof.param_bytes
    ddp = setting_memory(prof, _setting("ddp"))
    diloco = setting_memory(prof, _setting("diloco"))
    plain = setting_memory(prof, _setting("diloco", outer_momentum=0.0, nesterov=False))
    assert len(diloco) == 4
    # ddp: + G of flat buckets; diloco: + θ_start + outer momentum + the flat pseudo-gradient buffer
    assert diloco[0].total_bytes - ddp[0].total_bytes == 3 * P - P
    assert diloco[0].optimizer_bytes == prof.optimizer_state_bytes + 2 * P
    assert diloco[0].total_bytes - plain[0].total_bytes == P  # no outer momentum buffer


# ----------------------------------------------------------------------------- 2 workers
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, strategy_name: str, diloco: dict, out: str) -> None:
    """One of 2 workers: dist_check's batches (each worker half of each), plain SGD, rank 0 saves
    the trained state and the step outcomes. Joins the process group the way torchrun's env does."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from ddlscope.config import RunConfig
    from ddlscope.strategies import WorkerContext, strategy_class
    from ddlscope.workloads.step import build_optimizer, loss_function

    half = dist_check.BATCH // 2
    cfg = RunConfig(strategy=strategy_name, model="tiny_cnn", dataset="mnist", peers=2, batch_size=half,
                    sample_budget=dist_check.BATCH * dist_check.STEPS, optimizer="sgd", momentum=0.0,
                    learning_rate=dist_check.LR, **({"diloco": diloco} if diloco else {}))
    model = dist_check.initial_model()
    strategy = strategy_class(strategy_name)(cfg, WorkerContext(run_id="check", worker_index=rank, num_workers=2,
                                                                cores=[0], initial_peers=[]))
    model = strategy.setup(model, build_optimizer(model.parameters(), "sgd", dist_check.LR, momentum=0.0))
    outcomes = []
    for x, y in dist_check.batches():
        result = strategy.forward_backward(model, x[rank * half:(rank + 1) * half], y[rank * half:(rank + 1) * half],
                                           loss_function())
        outcome = strategy.step(result.samples)
        strategy.zero_grad()
        outcomes.append(dict(result_bytes=result.comm_bytes, bytes=outcome.comm_bytes, round=outcome.averaging_round,
                             group=outcome.group_size, averaging_s=outcome.averaging_s))
    if rank == 0:
        module = getattr(model, "module", model)
        torch.save(dict(state={k: v.detach().clone() for k, v in module.state_dict().items()}, outcomes=outcomes,
                        details=strategy.details()), out)
    # like dist_check.py: skip interpreter teardown (a gloo group destroyed there can deadlock)
    os._exit(0)


def _train_two_workers(strategy_name: str, out: Path, diloco: dict | None = None) -> dict:
    ctx = multiprocessing.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, strategy_name, diloco, str(out))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    for p in procs:  # a hung worker fails the test, and is not left behind
        if p.is_alive():
            p.kill()
            p.join()
    assert [p.exitcode for p in procs] == [0, 0]
    return torch.load(out)


@pytest.fixture(scope="module")
def ddp_trained(tmp_path_factory) -> dict:
    """The two workers' ddp training that the diloco runs are compared with (deterministic: one for the module)."""
    return _train_two_workers("ddp", tmp_path_factory.mktemp("ddp") / "ddp.pt")


@pytest.mark.slow
def test_one_inner_step_plain_sgd_and_a_unit_outer_step_train_exactly_like_ddp(tmp_path, ddp_trained):
    """H = 1, inner plain SGD, outer lr 1, no momentum: θ - mean(θ - (θ - lr g_i)) = θ - lr mean(g_i)."""
    ddp = ddp_trained
    diloco = _train_two_workers("diloco", tmp_path / "diloco.pt",
                                dict(inner_steps=1, outer_learning_rate=1.0, outer_momentum=0.0, nesterov=False))
    initial = dist_check.initial_model().state_dict()
    assert set(diloco["state"]) == set(ddp["state"])
    for name, tensor in ddp["state"].items():
        torch.testing.assert_close(diloco["state"][name], tensor, rtol=1e-5, atol=1e-6, msg=f"{name} differs")
        assert (tensor - initial[name]).abs().max() > 1e-4, f"{name} did not train"
    assert all(o["round"] and o["group"] == 2 and o["bytes"] > 0 and o["result_bytes"] == 0
               for o in diloco["outcomes"])
    assert diloco["details"]["outer_rounds"] == dist_check.STEPS


@pytest.mark.slow
def test_more_inner_steps_train_differently_and_communicate_once_per_round(tmp_path, ddp_trained):
    """The same data with H = 3 and the paper's outer step: one round, at the last step, and other weights."""
    ddp = ddp_trained
    diloco = _train_two_workers("diloco", tmp_path / "diloco.pt", dict(inner_steps=3))
    assert [o["round"] for o in diloco["outcomes"]] == [False, False, True]
    assert [o["bytes"] for o in diloco["outcomes"]][:2] == [0, 0]
    differs = max((diloco["state"][k] - v).abs().max().item() for k, v in ddp["state"].items())
    assert differs > 1e-3


def _run_and_read(strategy: str, db: Path, **overrides) -> tuple[dict[int, int], list[dict], dict]:
    from ddlscope.launch.local import run_local
    from ddlscope.store.db import ResultsStore

    cfg = validate_config(tiny_run(strategy=strategy, peers=2, vcpus_per_peer=1, **overrides))
    run_id = run_local(cfg, db, progress=False)
    with ResultsStore(db) as store:
        assert store.run(run_id)["status"] == "completed"
        steps = store.rows("steps", run_id)
        events = [e for e in store.rows("events", run_id) if e["kind"] == "strategy_details"]
    sent = {w: sum(r["comm_bytes"] for r in steps if r["worker_index"] == w) for w in (0, 1)}
    return sent, steps, events


@pytest.mark.slow
def test_h_inner_steps_send_h_times_fewer_bytes_than_ddp(env_data, tmp_path):
    """Two real runs (torchrun, the training loop, the store): ddp and diloco over the same 10 steps."""
    h = 5
    ddp_sent, ddp_steps, _ = _run_and_read("ddp", tmp_path / "d.db")
    sent, steps, events = _run_and_read("diloco", tmp_path / "d.db", optimizer="adamw", learning_rate=0.001,
                                        diloco={"inner_steps": h})
    assert len(steps) == len(ddp_steps) == 2 * 10
    assert all(b > 0 for b in ddp_sent.values())
    assert {w: ddp_sent[w] / sent[w] for w in sent} == {0: h, 1: h}
    rounds = [r for r in steps if r["averaging_round"]]
    assert sorted((r["worker_index"], r["step"]) for r in rounds) == [(0, 4), (0, 9), (1, 4), (1, 9)]
    assert all(r["averaging_group_size"] == 2 and r["averaging_succeeded"] == 1 and r["averaging_s"] > 0
               and r["comm_bytes"] > 0 and r["optimizer_s"] >= r["averaging_s"] for r in rounds)
    assert all(r["comm_bytes"] == 0 for r in steps if not r["averaging_round"])
    details = [json.loads(e["detail_json"]) for e in events]
    assert len(details) == 2
    for d in details:
        assert d["inner_steps"] == h and d["outer_rounds"] == 2 and d["comm_saved_ratio"] == h
