"""The dmoe cost and memory models, the remote-call calibration's fits, the cluster file's
``[cluster.dmoe]`` table and the zoo's mixture-of-experts networks."""

from __future__ import annotations

import math
import os
import random
from pathlib import Path

import pytest

from ddlscope import distribution
from ddlscope.distribution.dmoe import (
    MOE_LAYER,
    STARTUP_CALLS,
    WITHOUT_FIT_NOTE,
    CorePlacement,
    DMoEConfig,
    core_placement,
    gate_flops_per_sample,
    gate_param_bytes,
    memory_dmoe,
    predict_dmoe,
    server_memory_bytes,
    zoo_config,
)
from ddlscope.distribution.single import predict_single
from ddlscope.errors import UserError
from ddlscope.modeling.cluster import (
    ClusterSpec,
    DeviceSpec,
    DMoEFit,
    LinkSpec,
    beam_search_rounds,
    dumps_cluster,
    load_cluster,
    parse_cluster,
    write_cluster,
)
from ddlscope.modeling.memory import setting_memory
from ddlscope.modeling.prediction import Setting, predict
from ddlscope.modeling.profile import DeviceProfile, LayerProfile, StepProfile, WorkloadProfile
from ddlscope.profiling.dmoe_rpc import _tree_cpu_s, fit_beam_search, fit_cpu, fit_dmoe, fit_rounds

MIB = 2**20
BATCHES = [4, 8, 16, 32]


# ------------------------------------------------------------------------------------ fixtures
def make_profile(network="moe_cnn", expert_s_per_sample=1e-4, trunk_s_per_sample=1e-3, hidden_bytes=256,
                 threads=1, moe_name=MOE_LAYER) -> WorkloadProfile:
    """A profile of a trunk -> mixture -> head network, linear in the batch (backward twice the forward).

    The mixture layer's FLOPs are the zoo gate's plus ``k0 = 2`` ffn-sized experts per sample, and
    its time is ``k0 x expert_s_per_sample`` per sample, so one expert costs ``expert_s_per_sample``
    up to the gate's FLOP share.
    """
    zoo = zoo_config("moe_cnn")
    gate_flops = gate_flops_per_sample(zoo.hidden_dim, zoo.grid_size)
    moe_params = gate_param_bytes(zoo.hidden_dim, zoo.grid_size) + zoo.num_experts * 100_000
    per_layer = {"trunk": (trunk_s_per_sample, 400_000, 1e6), moe_name: (2 * expert_s_per_sample, moe_params,
                                                                          gate_flops + 2 * 65_536.0),
                 "head": (1e-5, 2_600, 1e3)}
    layers = [LayerProfile(name=n, param_bytes=p, forward_s=[s * b for b in BATCHES],
                           backward_s=[2 * s * b for b in BATCHES], output_bytes_per_sample=hidden_bytes,
                           saved_bytes_per_sample=4 * hidden_bytes, forward_flops_per_sample=f)
              for n, (s, p, f) in per_layer.items()]
    per_sample = sum(s for s, _, _ in per_layer.values())
    total = sum(p for _, p, _ in per_layer.values())
    steps = [StepProfile(batch_size=b, forward_s=per_sample * b, backward_s=2 * per_sample * b, optimizer_s=0.002,
                         step_s=3 * per_sample * b + 0.002, activation_peak_bytes=b * 10_000) for b in BATCHES]
    return WorkloadProfile(
        network=network, dataset="mnist", input_shape=(1, 28, 28), num_classes=10, optimizer="sgd",
        device=DeviceProfile(type="cpu", name="test", threads=threads, peak_tflops=0.1, memory_bandwidth_gb_per_s=10,
                             memory_bytes=8 * 2**30, runtime_bytes=300 * MIB),
        torch_version="x", batch_sizes=BATCHES, layers=layers, steps=steps, param_count=total // 4, param_bytes=total,
        buffer_bytes=0, optimizer_state_bytes=total, sample_bytes=28 * 28 * 4, profile_s=1.0, created_at=0.0)


def make_fit(per_call_s=1e-3, fixed_s=0.01, server_cpu_s=8e-4, batch_cpu_s=1.5e-3, round_cpu_s=4e-3,
             colocated=1.0) -> DMoEFit:
    return DMoEFit(beam_search_fixed_s=1e-3, beam_search_lookup_s=3e-4, forward_fixed_s=fixed_s,
                   forward_per_call_s=per_call_s, forward_gb_per_s=0.08, backward_fixed_s=fixed_s,
                   backward_per_call_s=1.2 * per_call_s, backward_gb_per_s=0.05, server_forward_batch_cpu_s=batch_cpu_s,
                   server_backward_batch_cpu_s=1.3 * batch_cpu_s, server_forward_cpu_s=server_cpu_s,
                   server_backward_cpu_s=1.2 * server_cpu_s, server_cpu_gb_per_s=0.08,
                   client_forward_round_cpu_s=round_cpu_s,
                   client_backward_round_cpu_s=round_cpu_s, client_forward_cpu_s=3e-4, client_backward_cpu_s=4e-4,
                   client_cpu_gb_per_s=None, colocated_cpu_ratio=colocated, max_abs_residual=0.2, reference="test")


def make_cluster(fit: DMoEFit | None = None, devices=2, kind="local", latency_s=5e-5) -> ClusterSpec:
    return ClusterSpec(name="t", devices_per_node=devices, device=DeviceSpec(kind=kind),
                       intra_node=LinkSpec(bandwidth_gb_per_s=1.0, latency_s=latency_s), dmoe=fit)


def setting(workers=1, batch=32, **options) -> Setting:
    return Setting("dmoe", workers, batch, epoch_samples=60_000, options=options)


# ------------------------------------------------------------------------------------ fits
def test_round_fit_recovers_fixed_per_call_and_payload_rate():
    calls = [4, 8, 16, 32, 64, 128] * 2
    sizes = [64] * 6 + [65_536] * 6
    times = [0.012 + c * (1e-3 + b / 0.05e9) for c, b in zip(calls, sizes)]
    fit = fit_rounds(calls, sizes, times)
    assert fit.fixed_s == pytest.approx(0.012, rel=1e-6)
    assert fit.per_call_s == pytest.approx(1e-3, rel=1e-6)
    assert fit.gb_per_s == pytest.approx(0.05, rel=1e-6)
    assert max(abs(r) for r in fit.residuals) < 1e-9


def test_round_fit_without_a_payload_term_and_through_the_origin():
    calls = [4, 16, 64]
    same = fit_rounds(calls, [64] * 3, [0.01 + c * 1e-3 for c in calls])  # one payload size: no rate
    assert same.gb_per_s is None and same.per_call_s == pytest.approx(1e-3)
    noisy = [0.01 + c * 1e-3 * (1 + 0.05 * (-1) ** i) for i, c in enumerate(calls * 2)]
    bytes_ = [64] * 3 + [65_536] * 3  # the big payload is *not* slower: its term is dropped
    assert fit_rounds(calls * 2, bytes_, [t * (0.9 if b > 64 else 1) for t, b in zip(noisy, bytes_)]).gb_per_s is None
    origin = fit_rounds(calls, [64] * 3, [c * 1e-3 - 1e-4 for c in calls])  # negative intercept: refitted as 0
    assert origin.fixed_s == 0.0 and origin.per_call_s > 0


@pytest.mark.parametrize("calls, sizes, times, words", [
    ([4, 4], [64, 64], [0.01, 0.02], "2 distinct call counts"),
    ([4, 8], [64, 64], [0.01, 0.0], "must be > 0"),
    ([4], [64], [0.01], "at least 2"),
    ([4, 8], [64], [0.01, 0.02], "allowed: equal"),
    ([4, 8, 16], [64] * 3, [0.03, 0.02, 0.01], "does not grow with the calls"),
])
def test_round_fit_refuses_what_cannot_be_fitted(calls, sizes, times, words):
    with pytest.raises(ValueError, match=words):
        fit_rounds(calls, sizes, times)


def test_beam_search_fit_uses_hivemind_rounds():
    assert [beam_search_rounds(d) for d in (1, 2, 3, 4)] == [1, 1, 2, 3]
    batches, dims = [4, 16, 64] * 3, [1] * 3 + [2] * 3 + [3] * 3
    times = [8e-4 + b * beam_search_rounds(d) * 3e-4 for b, d in zip(batches, dims)]
    fixed, lookup, residuals = fit_beam_search(batches, dims, times)
    assert fixed == pytest.approx(8e-4) and lookup == pytest.approx(3e-4) and max(map(abs, residuals)) < 1e-9
    with pytest.raises(ValueError, match="distinct batch x rounds"):
        fit_beam_search([4, 4], [1, 2], [0.01, 0.01])


def test_cpu_fit_separates_units_directions_and_payload():
    directions = ["forward", "backward"] * 6
    calls = [4, 4, 10, 10, 100, 100] * 2
    units = [1, 1, 2, 2, 2, 2] * 2  # batches: experts the round reached
    sizes = [64, 96] * 3 + [65_536, 98_304] * 3
    cpu = [u * (2e-3 if d == "forward" else 2.5e-3) + c * ((8e-4 if d == "forward" else 1.1e-3) + b / 0.08e9)
           for d, c, u, b in zip(directions, calls, units, sizes)]
    fit = fit_cpu(directions, calls, sizes, cpu, units)
    assert fit.forward_unit_s == pytest.approx(2e-3, rel=1e-6)
    assert fit.backward_unit_s == pytest.approx(2.5e-3, rel=1e-6)
    assert fit.forward_per_call_s == pytest.approx(8e-4, rel=1e-6)
    assert fit.backward_per_call_s == pytest.approx(1.1e-3, rel=1e-6)
    assert fit.gb_per_s == pytest.approx(0.08, rel=1e-6) and max(map(abs, fit.residuals)) < 1e-9
    per_round = fit_cpu(directions, calls, sizes, cpu)  # units default to one per round: a worse fit
    assert max(map(abs, per_round.residuals)) > 1e-3
    with pytest.raises(ValueError, match="allowed: forward, backward"):
        fit_cpu(["sideways"], [1], [1], [1.0])
    with pytest.raises(ValueError, match="do not grow with the calls"):
        fit_cpu(["forward", "forward"], [4, 64], [64, 64], [0.01, 0.01], [1, 16])  # all of it per unit


def _raw(rng: random.Random, noise: float = 0.0):
    """Measurements in the shape the calibration's client writes, from known costs."""
    jitter = lambda: 1 + noise * rng.uniform(-1, 1)  # noqa: E731
    beam = [{"dims": d, "batch": b, "k": k, "times_s": [(1e-3 + b * beam_search_rounds(d) * 3e-4) * jitter()
                                                         for _ in range(5)]}
            for d in (1, 2, 3) for b in (4, 16, 64) for k in (1, 2)]
    rounds = []
    for hidden in (16, 16_384):
        for b in (4, 16, 64):
            for k in (1, 2):
                for d, per_call, n in (("forward", 1e-3, 2), ("backward", 1.2e-3, 3)):
                    size = n * 4 * hidden
                    t = 0.012 + b * k * (per_call + size / 0.06e9)
                    experts = k  # batches: one per expert reached
                    rounds.append({"direction": d, "hidden": hidden, "batch": b, "k": k, "calls": b * k,
                                   "experts": experts, "bytes_per_call": size,
                                   "times_s": [t * jitter() for _ in range(5)],
                                   "server_cpu_s": [experts * 2e-3 + b * k * (0.8 * per_call + size / 0.08e9)] * 5,
                                   "client_cpu_s": [4e-3 + b * k * 0.3 * per_call] * 5, "answered": [b * k] * 5})
    return beam, rounds


def test_fit_dmoe_recovers_the_costs_it_was_given():
    fit, residuals = fit_dmoe(*_raw(random.Random(0)))
    assert fit.beam_search_fixed_s == pytest.approx(1e-3, rel=1e-3)
    assert fit.beam_search_lookup_s == pytest.approx(3e-4, rel=1e-3)
    assert fit.forward_fixed_s == pytest.approx(0.012, rel=1e-3)
    assert fit.forward_per_call_s == pytest.approx(1e-3, rel=1e-3)
    assert fit.backward_per_call_s == pytest.approx(1.2e-3, rel=1e-3)
    assert fit.forward_gb_per_s == pytest.approx(0.06, rel=1e-3)
    assert fit.server_forward_cpu_s == pytest.approx(8e-4, rel=1e-3)
    assert fit.server_forward_batch_cpu_s == pytest.approx(2e-3, rel=1e-3)
    assert fit.server_cpu_gb_per_s == pytest.approx(0.08, rel=1e-3)
    assert fit.client_backward_cpu_s == pytest.approx(3.6e-4, rel=1e-3) and fit.client_cpu_gb_per_s is None
    assert fit.client_forward_round_cpu_s == pytest.approx(4e-3, rel=1e-3)
    assert fit.max_abs_residual < 1e-3 and len(residuals["forward"]) == 12 and len(residuals["beam"]) == 18
    assert fit.colocated_cpu_ratio == 1.0  # no shared rounds
    noisy, _ = fit_dmoe(*_raw(random.Random(1), noise=0.2))
    assert noisy.max_abs_residual > fit.max_abs_residual  # residuals report the noise
    shared = {"ratio": 1.0837, "rounds": 25, "batch": 16, "k": 2}
    with_shared, _ = fit_dmoe(*_raw(random.Random(0)), shared)
    assert with_shared.colocated_cpu_ratio == pytest.approx(1.084) and "second client" in with_shared.reference


def test_fit_methods_follow_the_formulas():
    fit = make_fit()
    assert fit.round_s("forward", 0, 512) == 0.0
    assert fit.round_s("forward", 10, 512) == pytest.approx(0.01 + 10 * (1e-3 + 512 / 0.08e9))
    assert fit.beam_search_s(32, 3) == pytest.approx(1e-3 + 32 * 2 * 3e-4)
    assert fit.cpu_s("client", "backward", 10, 768) == pytest.approx(10 * 4e-4)  # no client payload term
    assert fit.cpu_s("client", "backward", 10, 768, 1) == pytest.approx(4e-3 + 10 * 4e-4)  # one round
    assert fit.cpu_s("server", "forward", 10, 512, 3) == pytest.approx(3 * 1.5e-3 + 10 * (8e-4 + 512 / 0.08e9))
    with pytest.raises(ValueError, match="allowed: forward, backward"):
        fit.round_s("sideways", 1, 1)


# ------------------------------------------------------------------------------------ cluster file
def test_a_dmoe_fit_round_trips_through_the_cluster_toml(tmp_path):
    spec = make_cluster(make_fit())
    path = write_cluster(spec, tmp_path / "cluster.toml", header="test")
    assert "[cluster.dmoe]" in path.read_text() and "client_cpu_gb_per_s" not in path.read_text()  # None: left out
    assert load_cluster(path) == spec
    assert load_cluster(write_cluster(make_cluster(None), tmp_path / "none.toml")).dmoe is None


def test_a_bad_dmoe_table_names_the_field():
    data = make_cluster(make_fit()).model_dump(exclude_none=True)
    data["dmoe"]["per_call"] = 1.0
    with pytest.raises(UserError, match=r"cluster\.dmoe\.per_call: unknown field; allowed: beam_search_fixed_s"):
        parse_cluster(data)
    data["dmoe"].pop("per_call")
    data["dmoe"]["forward_per_call_s"] = -1.0
    with pytest.raises(UserError, match=r"cluster\.dmoe\.forward_per_call_s"):
        parse_cluster(data)
    assert "[cluster.dmoe]" in dumps_cluster(make_cluster(make_fit()))


# ------------------------------------------------------------------------------------ cost model
def test_registered_cost_and_memory_models():
    m = distribution.get("dmoe")
    assert m.cost_model is predict_dmoe and m.memory_model is memory_dmoe and m.check_setting is not None


def test_parts_add_up_and_comm_wait_carries_the_remote_part():
    p = predict(make_profile(), make_cluster(make_fit()), setting())
    assert p.step_s == pytest.approx(sum(p.breakdown_s.values()))
    i = p.inputs
    assert p.breakdown_s["comm_wait_s"] == pytest.approx(i["beam_search_s"] + i["remote_forward_s"]
                                                         + i["remote_backward_s"])
    assert i["remote_forward_s"] == max(i["client_forward_s"], i["server_forward_s"])
    assert i["calls_per_step"] == 32 * 2 and i["forward_bytes_per_call"] == 2 * 256
    assert p.epoch_s == pytest.approx(p.step_s * 60_000 / 32)
    assert not p.notes and p.breakdown_s["bubble_s"] == 0 and p.breakdown_s["averaging_s"] == 0
    # the trunk: the whole forward less the local experts, plus the gate
    assert 0 < p.breakdown_s["forward_s"] < make_profile().step_at(32).forward_s


def test_more_calls_take_longer():
    profile, cluster = make_profile(), make_cluster(make_fit())
    one, two = (predict(profile, cluster, setting(k_best=k)) for k in (1, 2))
    assert two.inputs["calls_per_step"] == 2 * one.inputs["calls_per_step"]
    assert two.breakdown_s["comm_wait_s"] > one.breakdown_s["comm_wait_s"] and two.step_s > one.step_s
    small, big = (predict(profile, cluster, setting(batch=b)) for b in (8, 32))
    assert big.breakdown_s["comm_wait_s"] > small.breakdown_s["comm_wait_s"]
    three_dims = predict(profile, cluster, setting(grid_size=[2, 2, 2]))
    assert three_dims.inputs["beam_search_s"] > predict(profile, cluster, setting()).inputs["beam_search_s"]


def test_more_servers_wait_less():
    # expensive experts and cheap calls: the busiest server decides
    profile = make_profile(expert_s_per_sample=2e-3)
    cluster = make_cluster(make_fit(per_call_s=1e-5, fixed_s=1e-3, server_cpu_s=1e-5), kind="a100-40gb")
    preds = [predict(profile, cluster, setting(workers=4, grid_size=[2, 2], servers=s)) for s in (1, 2, 4)]
    waits = [p.inputs["server_forward_s"] for p in preds]
    assert waits[0] > waits[1] > waits[2]
    assert [p.inputs["busiest_server_share"] for p in preds] == [1.0, 0.5, 0.25]
    assert preds[0].breakdown_s["comm_wait_s"] > preds[2].breakdown_s["comm_wait_s"]
    # and more trainers load the servers more
    assert predict(profile, cluster, setting(workers=8, servers=2)).inputs["server_forward_s"] > waits[1]


def test_local_and_dense_are_singles_prediction():
    profile, cluster = make_profile(), make_cluster(make_fit())
    single = predict_single(profile, cluster, Setting("single", 1, 32, 60_000))
    for placement in ("local", "dense"):
        p = predict(profile, cluster, setting(placement=placement))
        assert p.breakdown_s == pytest.approx(single.breakdown_s) and p.step_s == pytest.approx(single.step_s)
        assert p.epoch_s == pytest.approx(single.epoch_s)
    assert any("dense" in n for n in predict(profile, cluster, setting(placement="dense")).notes)
    two = predict(profile, cluster, setting(workers=2, placement="local"))  # two trainers: twice the samples
    assert two.epoch_s == pytest.approx(two.step_s * 60_000 / 64)


def test_without_a_fit_remote_calls_are_costed_from_the_link_with_a_note():
    p = predict(make_profile(), make_cluster(None, latency_s=1e-3), setting())
    assert WITHOUT_FIT_NOTE in p.notes and p.breakdown_s["comm_wait_s"] > 0
    assert p.inputs["dmoe_fit"] is False and p.inputs["beam_search_s"] == pytest.approx(2e-3)
    with_fit = predict(make_profile(), make_cluster(make_fit(), latency_s=1e-3), setting())
    assert with_fit.breakdown_s["comm_wait_s"] > p.breakdown_s["comm_wait_s"]


def test_over_listed_links_the_rounds_wait_for_their_payload_and_no_core_stretches_that_wait():
    from ddlscope.modeling.cluster import PeerSpec

    profile, fit = make_profile(expert_s_per_sample=1e-4), make_fit()

    def over(mbit_per_s: float):
        peers = [PeerSpec(compute_share=1.0, bandwidth_gb_per_s=mbit_per_s / 8e3, latency_s=5e-5)] * 2
        return predict(profile, make_cluster(fit).model_copy(update={"peers": peers}), setting(workers=2))

    fast, slow = over(50.0), over(5.0)
    h, calls = 256, 64
    gap = (1 / (5.0 / 8e3) - 1 / (50.0 / 8e3)) / 1e9  # seconds per byte, 5 against 50 Mbit/s
    # forward: input out, output back (2 h); backward: input and output gradient out, input gradient back (3 h)
    assert slow.inputs["client_forward_s"] - fast.inputs["client_forward_s"] == pytest.approx(calls * 2 * h * gap)
    assert slow.inputs["client_backward_s"] - fast.inputs["client_backward_s"] == pytest.approx(calls * 3 * h * gap)
    for p, mbit_per_s in ((fast, 50.0), (slow, 5.0)):
        i = p.inputs
        assert i["core_stretch"] > 1.0 and p.step_s == pytest.approx(sum(p.breakdown_s.values()))
        # the client's side decides, and the wire time is on the path (what the server's work does not
        # cover); it is not stretched
        assert i["remote_forward_s"] == i["client_forward_s"] and i["remote_backward_s"] == i["client_backward_s"]
        whole = 4 * 5e-5 + calls * 5 * h / (mbit_per_s * 1e6 / 8)
        assert 0 < i["wire_s"] <= whole + 1e-12
        unstretched = i["beam_search_s"] + i["remote_forward_s"] + i["remote_backward_s"]
        assert p.breakdown_s["comm_wait_s"] == pytest.approx((unstretched - i["wire_s"]) * i["core_stretch"]
                                                             + i["wire_s"])
    assert slow.inputs["wire_s"] > fast.inputs["wire_s"]
    # a longer wait on the wire leaves the cores to the others: the step grows by less than the wire time
    assert 0 < slow.step_s - fast.step_s < slow.inputs["wire_s"] - fast.inputs["wire_s"]


def test_trainers_and_servers_sharing_the_cores_stretch_the_step():
    profile, fit = make_profile(expert_s_per_sample=5e-4), make_fit()
    alone = predict(profile, make_cluster(fit, devices=16), setting(workers=1))
    assert alone.inputs["core_stretch"] == 1.0  # one trainer, its servers on cores of their own: its path
    assert alone.inputs["contended_step_s"] == pytest.approx(alone.step_s)
    crowded = predict(profile, make_cluster(fit, devices=2), setting(workers=8))
    i = crowded.inputs
    assert i["core_stretch"] > 1.0 and any("stretched" in n for n in crowded.notes)
    assert crowded.step_s == pytest.approx(max(i["busiest_core_s"], i["contended_step_s"]))
    assert i["cpu_s_per_step"] == pytest.approx(8 * i["trainer_cpu_s"] + sum(i["server_cpu_s"]))
    assert i["busiest_core_s"] >= i["cpu_s_per_step"] / i["cores"] - 1e-12  # the busiest core, not the average
    gpu = predict(profile, make_cluster(fit, devices=2, kind="a100-40gb"), setting(workers=8))
    assert gpu.inputs["core_stretch"] == 1.0  # other devices: no shared cores


def test_one_server_on_a_trainers_core_makes_that_core_the_bottleneck():
    profile, fit = make_profile(expert_s_per_sample=5e-4), make_fit()
    cluster = make_cluster(fit, devices=2)
    one = predict(profile, cluster, setting(workers=2, servers=1))
    two = predict(profile, cluster, setting(workers=2, servers=2))
    placement = core_placement(cluster, 1, 2, DMoEConfig(servers=1))
    loads = placement.loads(one.inputs["trainer_cpu_s"], one.inputs["server_cpu_s"])
    assert placement.server_cores == ((0,),) and loads[0] > loads[1]
    assert one.inputs["busiest_core_s"] == pytest.approx(loads[0])
    assert one.step_s > two.step_s  # the pooled CPU is alike; one core carries all the servers' share


@pytest.mark.parametrize("devices, threads, trainers, servers, vcpus", [
    (2, 1, 2, 2, 1), (2, 1, 2, 1, 1), (4, 1, 2, 2, 1), (4, 1, 2, 3, 1), (4, 2, 2, 2, 2), (8, 1, 3, 4, 2)])
def test_core_placement_mirrors_the_launcher(devices, threads, trainers, servers, vcpus):
    from ddlscope.launch.local import service_core_sets

    cluster = make_cluster(make_fit(), devices=devices)
    grid = [2, 2] if servers <= 4 else [2, 4]
    placement = core_placement(cluster, threads, trainers, DMoEConfig(servers=servers, vcpus_per_server=vcpus,
                                                                      grid_size=grid))
    workers = [list(range(i * threads, (i + 1) * threads)) for i in range(trainers)]
    cores = list(range(devices * threads))
    assert [list(c) for c in placement.trainer_cores] == workers
    assert [list(c) for c in placement.server_cores] == service_core_sets([vcpus] * servers, workers, cores)
    assert placement.shared == any(c in {x for w in workers for x in w} for s in placement.server_cores for c in s)


def test_contended_step_follows_mean_value_analysis():
    placement = CorePlacement(cores=2, trainer_cores=((0,), (1,)), server_cores=((0,), (1,)), shared=True)
    critical, trainer, servers = 0.09, 0.034, [0.074, 0.074]
    mine = [trainer + 0.037, 0.037]  # its own work, and half of each server's (2 trainers)
    load = placement.loads(trainer, servers)
    assert load == pytest.approx([0.108, 0.108])
    a = sum(w * (x - w) for w, x in zip(mine, load)) / sum(mine)
    assert placement.contended_step_s(critical, trainer, servers, 2) == pytest.approx(
        (critical + math.sqrt(critical ** 2 + 4 * critical * a)) / 2)
    lone = CorePlacement(cores=2, trainer_cores=((0,),), server_cores=((1,),), shared=False)
    assert lone.contended_step_s(critical, trainer, [0.037], 1) == pytest.approx(critical)  # nobody else
    # a second trainer on another node shares no core: the harmonic mean of the two
    here = lone.contended_step_s(critical, trainer, [0.074], 2)
    two = CorePlacement(cores=1, trainer_cores=((0,),), server_cores=((0,),), shared=True)
    r = two.contended_step_s(critical, trainer, [0.074], 2)
    assert here > critical and r > critical
    mine0 = trainer + 0.037
    r0 = (critical + math.sqrt(critical ** 2 + 4 * critical * mine0 * (trainer + 0.074 - mine0) / mine0)) / 2
    assert r == pytest.approx(2 / (1 / r0 + 1 / critical))
    # seconds waiting for a link are not stretched: all of the path on the wire takes its time
    assert placement.contended_step_s(critical, trainer, servers, 2, wire_s=critical) == pytest.approx(critical)
    wire = 0.03
    assert placement.contended_step_s(critical, trainer, servers, 2, wire_s=wire) == pytest.approx(
        (critical + math.sqrt(critical ** 2 + 4 * (critical - wire) * a)) / 2)


def test_colocation_ratio_applies_where_servers_share_a_trainers_core():
    profile = make_profile()
    ratio = 1.5
    shared = predict(profile, make_cluster(make_fit(colocated=ratio), devices=2), setting(workers=2))
    plain = predict(profile, make_cluster(make_fit(), devices=2), setting(workers=2))
    assert shared.inputs["colocated"] and shared.inputs["colocated_cpu_ratio"] == ratio
    assert shared.inputs["server_cpu_s"][0] > plain.inputs["server_cpu_s"][0]
    assert shared.inputs["trainer_cpu_s"] > plain.inputs["trainer_cpu_s"]
    apart = predict(profile, make_cluster(make_fit(colocated=ratio), devices=4), setting(workers=2))
    assert not apart.inputs["colocated"] and apart.inputs["colocated_cpu_ratio"] == 1.0


def test_measurements_leave_out_the_start_up_calls():
    model = distribution.get("dmoe")
    assert model.startup_steps_of(16, 2, {}) == math.ceil(STARTUP_CALLS / 32)
    assert model.startup_steps_of(16, 2, {"k_best": 1}) == math.ceil(STARTUP_CALLS / 16)
    assert model.startup_steps_of(16, 2, {"placement": "local"}) == 0
    assert model.measured_steps and model.measured_steps >= 20


def test_process_tree_cpu_uses_the_schedulers_nanosecond_counters():
    import psutil

    me = psutil.Process()
    before = _tree_cpu_s(me)
    total = 0
    for i in range(20_000):  # a millisecond or so of CPU: below one clock tick of cpu_times
        total += i * i
    assert _tree_cpu_s(me) > before and total > 0


@pytest.mark.parametrize("options, profile_kw, words", [
    ({"hidden_dim": 128}, {}, "dmoe.hidden_dim = 128, but the profile of 'moe_cnn' measured hidden_dim = 64"),
    ({"expert": "transformer"}, {}, "dmoe.expert = 'transformer'"),
    ({"k_best": 5}, {}, "dmoe: k_best = 5 exceeds the 4 experts of grid_size"),
    ({}, {"network": "resnet18"}, "has no mixture-of-experts layer of the zoo; allowed: moe_cnn, moe_lm"),
    ({}, {"moe_name": "mixture"}, "has no layer named 'moe'"),
])
def test_impossible_settings_are_refused_naming_the_field(options, profile_kw, words):
    with pytest.raises(UserError, match=words.replace("(", r"\(").replace(")", r"\)")):
        predict(make_profile(**profile_kw), make_cluster(make_fit()), setting(**options))


def test_moe_lm_profiles_default_to_transformer_experts():
    p = predict(make_profile(network="moe_lm", hidden_bytes=128 * 64 * 4), make_cluster(make_fit()), setting())
    assert p.inputs["forward_bytes_per_call"] == 2 * 128 * 64 * 4


def test_memory_keeps_the_experts_off_the_trainers():
    profile = make_profile()
    remote = setting_memory(profile, setting(workers=3))
    local = setting_memory(profile, setting(workers=3, placement="local"))
    assert len(remote) == 3 and len(local) == 3
    experts = [x for x in profile.layers if x.name == MOE_LAYER][0].param_bytes - gate_param_bytes(64, [2, 2])
    assert local[0].params_bytes - remote[0].params_bytes == experts
    assert remote[0].total_bytes < local[0].total_bytes
    assert remote[0].comm_buffers_bytes == 3 * 32 * 2 * 256 and "busiest server" in remote[0].notes
    one_server = server_memory_bytes(profile, setting(servers=1))
    assert one_server > server_memory_bytes(profile, setting(servers=2)) > profile.device.runtime_bytes
    assert server_memory_bytes(profile, setting(placement="local")) == 0
    assert predict(profile, make_cluster(make_fit()), setting(servers=1)).inputs["server_memory_bytes"] == one_server
    # trainers and servers import hivemind: their runtime holds what the profile measured that import adds
    profile.device.hivemind_runtime_bytes = 53 * MIB
    assert setting_memory(profile, setting(workers=3))[0].runtime_bytes == profile.device.runtime_bytes + 53 * MIB
    assert server_memory_bytes(profile, setting(servers=1)) == one_server + 53 * MIB


# ------------------------------------------------------------------------------------ zoo networks
def test_zoo_moe_networks_are_sequential_with_one_mixture_child():
    torch = pytest.importorskip("torch")
    from ddlscope.workloads.models import MOE_NETWORKS, NETWORKS, SequentialNet, build_model

    assert set(MOE_NETWORKS) <= set(NETWORKS)
    torch.manual_seed(0)
    cnn = build_model("moe_cnn", "mnist")
    assert isinstance(cnn, SequentialNet) and [n for n, _ in cnn.named_children()] == ["trunk", "moe", "head"]
    x = torch.randn(3, 1, 28, 28)
    with torch.no_grad():
        y = x
        for child in cnn.children():
            y = child(y)
        torch.testing.assert_close(y, cnn(x), rtol=0, atol=0)
    assert y.shape == (3, 10)
    assert type(cnn.moe).__name__ == "LocalMixtureOfExperts" and len(cnn.moe.uids) == zoo_config("moe_cnn").num_experts
    lm = build_model("moe_lm", "text")
    assert [n for n, _ in lm.named_children()] == ["embed", "moe", "norm", "head"]
    with torch.no_grad():
        assert lm(torch.randint(0, 256, (2, 128))).shape == (2, 128, 256)
    with pytest.raises(UserError, match="does not take a dataset of family 'imagenet'"):
        build_model("moe_cnn", "imagenet")
    with pytest.raises(UserError, match="num_classes must be a positive integer"):
        build_model("moe_cnn", "cifar10", 0)
    assert math.prod(zoo_config("moe_lm").grid_size) == zoo_config("moe_lm").num_experts
    assert zoo_config("moe_lm").expert == "transformer" and zoo_config("moe_cnn").placement == "local"


# ------------------------------------------------------------------------------------ real calibration
def _calibration_processes() -> set[int]:
    """The dmoe calibration's children, their forked task pools and DHTs: they carry the module in their command line."""
    import psutil

    found = set()
    for p in psutil.process_iter(["pid", "cmdline"]):
        if "ddlscope.profiling.dmoe_rpc" in " ".join(p.info["cmdline"] or []):
            found.add(p.info["pid"])
    return found


@pytest.mark.slow
def test_a_calibration_without_progress_fails_naming_what_it_waited_for_and_leaves_nothing_running():
    from ddlscope.profiling.calibrate import CalibrationError
    from ddlscope.profiling.dmoe_rpc import calibrate_dmoe

    before = _calibration_processes()
    with pytest.raises(CalibrationError, match=r"made no progress for 0.5 s \(waiting for it served its experts; serve: "):
        calibrate_dmoe(timeout_s=0.5)  # a fresh interpreter alone takes longer than that to import hivemind
    assert _calibration_processes() <= before


@pytest.mark.slow
def test_real_calibration_fits_positive_costs_and_leaves_nothing_running():
    from ddlscope.profiling.dmoe_rpc import calibrate_dmoe

    ours = _calibration_processes
    before, sockets = ours(), set(Path("/tmp").glob("hivemind-*.sock"))
    children_tmp = Path(os.environ["TMPDIR"])  # the suite's folder for its children (conftest)
    folders = set(children_tmp.glob("pymp-*"))
    lines: list[str] = []
    cal = calibrate_dmoe(lines.append)
    fit = cal.fit
    assert fit.forward_per_call_s > 0 and fit.backward_per_call_s > 0 and fit.beam_search_lookup_s > 0
    assert all(a == r["calls"] for r in cal.rounds for a in r["answered"])  # every call answered
    assert all(1 <= r["experts"] <= 2 for r in cal.rounds)
    assert fit.server_forward_cpu_s > 0 and fit.client_backward_cpu_s > 0
    assert len(cal.forward_residuals) == len(cal.backward_residuals) == 12
    assert any("beam search" in line for line in lines)
    if cal.server_core != cal.client_core:  # the second client ran on the server's core
        assert cal.shared is not None and cal.shared["together_cpu_s"]["second"] > 0
        assert fit.colocated_cpu_ratio == pytest.approx(cal.shared["ratio"], rel=1e-3)
    assert ours() <= before  # every process group of the calibration is gone
    assert set(Path("/tmp").glob("hivemind-*.sock")) <= sockets  # and hivemind's socket files with its folder
    # the children's multiprocessing folders went with the calibration's (killed children cannot remove them)
    assert set(children_tmp.glob("pymp-*")) <= folders
