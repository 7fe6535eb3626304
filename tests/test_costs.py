"""Cost models on hand-made profiles: formulas, limits, and the orderings they must respect."""

from __future__ import annotations

import dataclasses
import math

import pytest

from ddlscope.errors import UserError
from ddlscope.distribution.collaborative import lone_peer_samples
from ddlscope.distribution.ddp import ddp_buckets, eq_5_1_epoch_s
from ddlscope.distribution.pipeline import pipeline_ops, simulate_pipeline, stage_program
from ddlscope.modeling.cluster import ClusterSpec, CollectiveFit, DeviceSpec, HivemindFit, LinkSpec, PeerSpec
from ddlscope.modeling.collectives import butterfly_allreduce_s, ring_allgather_s, ring_allreduce_s, tree_broadcast_s
from ddlscope.modeling.prediction import Setting, predict
from ddlscope.modeling.profile import DeviceProfile, LayerProfile, StepProfile, WorkloadProfile
from ddlscope.profiling.calibrate import fit_in_step_rates

MIB = 1024 * 1024


def compute_s(p) -> float:
    """A prediction's training compute: its forward and backward parts."""
    return p.breakdown_s["forward_s"] + p.breakdown_s["backward_s"]


def make_profile(layer_params_bytes=(4 * MIB, 4 * MIB, 4 * MIB, 4 * MIB), per_sample_s=1e-3, out_bytes=4096):
    """Layers whose forward takes ``per_sample_s`` per sample (backward twice that), linear in batch."""
    batches = [4, 8, 16, 32]
    n = len(layer_params_bytes)
    layers = [LayerProfile(name=f"l{i}", param_bytes=p, forward_s=[per_sample_s * b for b in batches],
                           backward_s=[2 * per_sample_s * b for b in batches], output_bytes_per_sample=out_bytes,
                           saved_bytes_per_sample=out_bytes, forward_flops_per_sample=1e6)
              for i, p in enumerate(layer_params_bytes)]
    steps = [StepProfile(batch_size=b, forward_s=n * per_sample_s * b, backward_s=2 * n * per_sample_s * b,
                         optimizer_s=0.01, step_s=3 * n * per_sample_s * b + 0.01, activation_peak_bytes=b * 10_000)
             for b in batches]
    total = sum(layer_params_bytes)
    return WorkloadProfile(
        network="toy", dataset="cifar10", input_shape=(3, 32, 32), num_classes=10, optimizer="sgd",
        device=DeviceProfile(type="cpu", name="test", threads=1, peak_tflops=0.1, memory_bandwidth_gb_per_s=10,
                             memory_bytes=8 * 2**30, runtime_bytes=300 * MIB),
        torch_version="x", batch_sizes=batches, layers=layers, steps=steps, param_count=total // 4,
        param_bytes=total, buffer_bytes=0, optimizer_state_bytes=total, sample_bytes=3 * 32 * 32 * 4,
        profile_s=1.0, created_at=0.0)


def make_cluster(bw=1.0, latency=1e-5, fixed=0.0, p2p_fixed=0.0, devices=4, slowdown=1.0, overlap=1.0, peers=()):
    return ClusterSpec(name="t", nodes=1, devices_per_node=devices, device=DeviceSpec(kind="local"),
                       intra_node=LinkSpec(bandwidth_gb_per_s=bw, latency_s=latency), collective_fixed_s=fixed,
                       p2p_fixed_s=p2p_fixed, concurrent_compute_slowdown=slowdown, comm_overlap=overlap,
                       peers=list(peers))


def test_ring_allreduce_formula():
    link = LinkSpec(bandwidth_gb_per_s=1.0, latency_s=1e-4)
    assert ring_allreduce_s(1e9, 1, link, 0.5) == 0.0
    # 2(W-1) steps of (latency + n/(W bw)) plus the fixed cost
    assert ring_allreduce_s(1e9, 4, link, 0.5) == pytest.approx(0.5 + 6 * (1e-4 + 0.25))


def test_ddp_buckets_cover_every_gradient_in_reverse_order():
    params = [3 * MIB, 10 * MIB, 60 * MIB, 2 * MIB]
    buckets = ddp_buckets(params, 25 * MIB)
    assert sum(b for _, b in buckets) == pytest.approx(sum(params))
    assert buckets[0][1] <= MIB  # the first bucket is small so communication starts early
    assert [i for i, _ in buckets] == sorted([i for i, _ in buckets], reverse=True)
    assert all(b <= 25 * MIB for _, b in buckets)


def test_ddp_with_a_free_network_costs_the_single_step_at_the_worker_batch():
    prof = make_profile()
    free = make_cluster(bw=1e9, latency=0.0)
    ddp = predict(prof, free, Setting("ddp", 4, 8, epoch_samples=3200))
    single = predict(prof, free, Setting("single", 1, 8, epoch_samples=3200))
    assert ddp.step_s == pytest.approx(single.step_s, rel=1e-6)
    assert ddp.epoch_s == pytest.approx(single.epoch_s / 4, rel=1e-6)  # 4 workers share the epoch


def test_tree_broadcast_formula():
    link = LinkSpec(bandwidth_gb_per_s=1.0, latency_s=1e-4)
    assert tree_broadcast_s(1e9, 1, link, 0.5) == 0.0
    assert tree_broadcast_s(1e9, 2, link, 0.5) == pytest.approx(0.5 + 1e-4 + 1.0)  # one round
    assert tree_broadcast_s(1e9, 5, link, 0.5) == pytest.approx(0.5 + 3 * (1e-4 + 1.0))  # ceil(log2 5) rounds


def test_ddp_broadcasts_the_buffers_before_every_forward():
    plain = make_profile()
    with_bn = plain.model_copy(update={"buffer_bytes": 2 * MIB})
    s = Setting("ddp", 4, 8, epoch_samples=3200)
    slow = make_cluster(bw=0.01, fixed=1e-3)  # 10 MB/s
    p0, p1 = predict(plain, slow, s), predict(with_bn, slow, s)
    assert p0.inputs["buffer_broadcast_s"] == 0.0
    # two tree rounds for 4 workers, each moving all 2 MiB over the 10 MB/s link, plus the call's fixed cost
    expected = 1e-3 + 2 * (1e-5 + 2 * MIB / 1e7)
    assert p1.inputs["buffer_broadcast_s"] == pytest.approx(expected)
    assert p1.breakdown_s["forward_s"] == pytest.approx(p0.breakdown_s["forward_s"] + expected)
    assert p1.step_s == pytest.approx(p0.step_s + expected)


def test_ddp_exposes_communication_compute_cannot_hide_and_eq51_misses_it():
    prof = make_profile(layer_params_bytes=(100 * MIB,) * 4)  # VGG-like: many gradients, little compute
    slow = make_cluster(bw=0.5)
    p = predict(prof, slow, Setting("ddp", 4, 8, epoch_samples=3200))
    assert p.breakdown_s["comm_wait_s"] > 0.1
    assert p.dominant_cost == "comm_wait_s"
    # eq. 5.1 counts only the last (threshold-sized) all-reduce: optimistic here
    assert p.reference_epoch_s["eq5.1"] < p.epoch_s


def test_ddp_fixed_cost_per_collective_grows_with_the_number_of_buckets():
    prof = make_profile(layer_params_bytes=(8 * MIB,) * 4)
    cl = make_cluster(bw=1e9, fixed=5e-3)  # MobileNetV2-like: fixed costs dominate
    few = predict(prof, cl, Setting("ddp", 2, 8, epoch_samples=3200, bucket_cap_mb=64))
    many = predict(prof, cl, Setting("ddp", 2, 8, epoch_samples=3200, bucket_cap_mb=1))
    assert many.inputs["buckets"] > few.inputs["buckets"]
    assert many.step_s > few.step_s


def test_contention_and_partial_overlap_slow_data_parallel_down():
    prof = make_profile()
    base = predict(prof, make_cluster(bw=0.2), Setting("ddp", 4, 8, epoch_samples=3200))
    contended = predict(prof, make_cluster(bw=0.2, slowdown=1.5), Setting("ddp", 4, 8, epoch_samples=3200))
    interfered = predict(prof, make_cluster(bw=0.2, overlap=0.0), Setting("ddp", 4, 8, epoch_samples=3200))
    assert compute_s(contended) == pytest.approx(1.5 * compute_s(base))
    assert interfered.step_s > base.step_s


def test_fsdp_costs_more_communication_than_ddp_and_shards_the_optimizer():
    prof = make_profile()
    cl = make_cluster(bw=0.5)
    ddp = predict(prof, cl, Setting("ddp", 4, 8, epoch_samples=3200))
    fsdp = predict(prof, cl, Setting("fsdp", 4, 8, epoch_samples=3200))
    zero2 = predict(prof, cl, Setting("fsdp", 4, 8, epoch_samples=3200, reshard_after_forward=False))
    assert fsdp.inputs["comm_s"] > ddp.inputs["comm_s"]  # 3 half-all-reduces per unit vs 1 all-reduce
    assert zero2.inputs["comm_s"] < fsdp.inputs["comm_s"]  # no second all-gather in backward
    assert fsdp.breakdown_s["optimizer_s"] == pytest.approx(ddp.breakdown_s["optimizer_s"] / 4)
    # a calibrated all-gather / reduce-scatter slower than half an all-reduce costs fsdp more
    slow_ag = make_cluster(bw=0.5).model_copy(update={
        "all_gather": CollectiveFit(fixed_s=1e-3, bandwidth_gb_per_s=0.1),
        "reduce_scatter": CollectiveFit(fixed_s=1e-3, bandwidth_gb_per_s=0.1)})
    assert predict(prof, slow_ag, Setting("fsdp", 4, 8, epoch_samples=3200)).inputs["comm_s"] > 3 * fsdp.inputs["comm_s"]
    # FSDP's own per-unit work (calibrated on tiny units) is paid by every unit with parameters
    costly = predict(prof, make_cluster(bw=0.5).model_copy(update={"fsdp_unit_fixed_s": 0.005}),
                     Setting("fsdp", 4, 8, epoch_samples=3200))
    assert costly.inputs["fsdp_overhead_s"] == pytest.approx(4 * 0.005)
    assert costly.step_s == pytest.approx(fsdp.step_s + 0.02)
    free = predict(prof, make_cluster(bw=1e9, latency=0.0), Setting("fsdp", 4, 8, epoch_samples=3200))
    assert free.breakdown_s["comm_wait_s"] == pytest.approx(0.0, abs=1e-9)


def test_fsdp_on_cpu_waits_for_every_collective_and_on_gpus_prefetches():
    prof = make_profile()
    s = Setting("fsdp", 4, 8, epoch_samples=3200)
    cpu = predict(prof, make_cluster(bw=0.5), s)
    assert not cpu.inputs["prefetch"]
    # no streams: the step is compute + every all-gather and reduce-scatter + the rest, nothing hidden
    assert cpu.breakdown_s["comm_wait_s"] == pytest.approx(cpu.inputs["comm_s"])
    assert cpu.inputs["comm_interference_s"] == pytest.approx(0.0, abs=1e-12)
    gpu_cluster = make_cluster(bw=0.5).model_copy(update={"device": DeviceSpec(kind="a100-40gb")})
    gpu = predict(prof, gpu_cluster, s)
    # gloo's reduce-scatter (CPU) moves an all-reduce's bytes, nccl's (GPU) half of them
    link = LinkSpec(bandwidth_gb_per_s=0.5, latency_s=1e-5)
    extra = 4 * (ring_allreduce_s(4 * MIB, 4, link, 0.0) - ring_allgather_s(4 * MIB, 4, link, 0.0))
    assert gpu.inputs["prefetch"] and cpu.inputs["comm_s"] == pytest.approx(gpu.inputs["comm_s"] + extra)
    assert gpu.breakdown_s["comm_wait_s"] < cpu.breakdown_s["comm_wait_s"]  # prefetch hides part of it


def test_in_step_rates_make_cpu_communication_serial_at_the_measured_rate():
    prof = make_profile()  # 4 layers of 4 MiB
    rates = {"ddp_step_gb_per_s": 0.1, "fsdp_step_gb_per_s": 0.05}
    cpu = make_cluster(bw=0.5, fixed=1e-3, overlap=1.0).model_copy(update=rates)
    ddp_s, fsdp_s = Setting("ddp", 2, 8, epoch_samples=3200), Setting("fsdp", 2, 8, epoch_samples=3200)
    ddp = predict(prof, cpu, ddp_s)
    # every bucket on the critical path: fixed cost + 2(W-1)/W x bytes at the in-step rate
    buckets = ddp.inputs["buckets"]
    assert ddp.inputs["serial_comm"]
    assert ddp.breakdown_s["comm_wait_s"] == pytest.approx(buckets * 1e-3 + 16 * MIB / 0.1e9)
    assert ddp.inputs["comm_interference_s"] == 0.0
    plain = predict(prof, make_cluster(bw=0.5, fixed=1e-3, overlap=1.0), ddp_s)
    assert not plain.inputs["serial_comm"] and plain.step_s < ddp.step_s  # without the rate: overlapped
    fsdp = predict(prof, cpu, fsdp_s)
    # each unit: two all-gathers and a reduce-scatter, (W-1)/W x bytes each, at the in-step rate
    assert fsdp.inputs["in_step_rate"]
    assert fsdp.breakdown_s["comm_wait_s"] == pytest.approx(4 * 3 * 0.5 * 4 * MIB / 0.05e9)
    zero2 = predict(prof, cpu, Setting("fsdp", 2, 8, epoch_samples=3200, reshard_after_forward=False))
    assert zero2.breakdown_s["comm_wait_s"] == pytest.approx(fsdp.breakdown_s["comm_wait_s"] * 2 / 3)
    # GPUs overlap communication: the CPU rates do not apply there
    gpu = cpu.model_copy(update={"device": DeviceSpec(kind="a100-40gb")})
    assert not predict(prof, gpu, ddp_s).inputs["serial_comm"] and not predict(prof, gpu, fsdp_s).inputs["in_step_rate"]


def test_rates_measured_on_loopback_never_beat_a_slower_link():
    prof = make_profile()  # 4 layers of 4 MiB
    fits = {"ddp_step_gb_per_s": 0.1, "fsdp_step_gb_per_s": 0.05,
            "all_gather": CollectiveFit(fixed_s=0.0, bandwidth_gb_per_s=0.1)}
    slow_link = make_cluster(bw=0.001, overlap=1.0).model_copy(update=fits)  # 8 Mbit/s, 100x slower than the rates
    ddp = predict(prof, slow_link, Setting("ddp", 2, 8, epoch_samples=3200))
    # each bucket pays its ring all-reduce over the 1 MB/s link: 2(W-1)/W x 16 MiB in all
    assert ddp.breakdown_s["comm_wait_s"] == pytest.approx(16 * MIB / 0.001e9, rel=1e-3)
    fsdp = predict(prof, slow_link, Setting("fsdp", 2, 8, epoch_samples=3200))
    # all-gathers (fitted): the in-step share plus the wire beyond the fit's; reduce-scatters (no fit, gloo: an
    # all-reduce's bytes on the wire): at least the wire
    wire, fitted = 0.5 * 4 * MIB / 0.001e9, 0.5 * 4 * MIB / 0.1e9
    in_step = 0.5 * 4 * MIB / 0.05e9  # each of a unit's 3 collectives: 1/3 of 1.5 x 4 MiB at 0.05 GB/s
    assert fsdp.breakdown_s["comm_wait_s"] == pytest.approx(4 * (2 * (in_step + wire - fitted) + max(in_step, 2 * wire)),
                                                            rel=1e-3)
    link = LinkSpec(bandwidth_gb_per_s=0.001, latency_s=0.0)
    assert ring_allgather_s(4 * MIB, 2, link, 0.0, CollectiveFit(fixed_s=0.0, bandwidth_gb_per_s=0.1)) == \
        pytest.approx(0.5 * 4 * MIB / 0.001e9)



def test_fsdp_over_probed_links_takes_the_wire_or_the_in_step_work_whichever_is_longer():
    from ddlscope.modeling.collectives import gloo_fsdp_step_wire_s

    prof = make_profile()  # 4 layers of 4 MiB
    fits = {"fsdp_step_gb_per_s": 0.05, "fsdp_unit_fixed_s": 0.01}
    s = Setting("fsdp", 2, 8, epoch_samples=3200)
    plain = make_cluster(bw=0.001, overlap=1.0).model_copy(update=fits)
    slow = LinkSpec(bandwidth_gb_per_s=0.0008, latency_s=0.0)  # what the probe measured: 80 % of 8 Mbit/s
    probed = predict(prof, plain.model_copy(update={"fsdp_link": slow}), s)
    # the wire dominates: every collective at the probed link, FSDP's own work (0.01 s per unit) hidden behind it
    assert probed.inputs["probed_link"] and probed.inputs["fsdp_overhead_s"] == 0.0
    assert probed.breakdown_s["comm_wait_s"] == pytest.approx(gloo_fsdp_step_wire_s([4 * MIB] * 4, 2, slow))
    assert probed.breakdown_s["forward_s"] == pytest.approx(predict(prof, plain, s).breakdown_s["forward_s"]
                                                            - 4 * 0.01 / 3)
    # a fast probed link: each collective is its share of the in-step time and of FSDP's own work
    fast = predict(prof, plain.model_copy(update={"fsdp_link": LinkSpec(bandwidth_gb_per_s=100.0, latency_s=0.0)}), s)
    assert fast.breakdown_s["comm_wait_s"] == pytest.approx(4 * (1.5 * 4 * MIB / 0.05e9 + 0.01))
    # without in-step rates (GPU devices) the probed link is not used
    gpu = plain.model_copy(update={"fsdp_link": slow, "device": DeviceSpec(kind="a100-40gb")})
    assert not predict(prof, gpu, s).inputs["probed_link"]

def test_fit_in_step_rates_divides_the_traffic_by_the_extra_step_time():
    notes: list[str] = []
    # fsdp: 2 units of 16 MiB (2048x2048 + bias), 0.1 s per unit beyond 4 ms fixed -> 1.5 x bytes / 0.096 s
    fsdp, ddp = fit_in_step_rates(2, 0.004, 0.001, fsdp_large=(0.05, 0.05 + 2 * 0.1), ddp=(0.1, 0.15), notes=notes)
    unit = 4 * (2048 * 2048 + 2048)
    assert fsdp == pytest.approx(1.5 * unit / 0.096 / 1e9)
    # ddp: 32 MiB of gradients (8 x 1024x1024 + bias) in 3 buckets, 50 ms - 3 ms -> bytes / 0.047 s
    assert ddp == pytest.approx(8 * 4 * (1024 * 1024 + 1024) / 0.047 / 1e9)
    assert notes == []
    none_f, none_d = fit_in_step_rates(2, 0.004, 0.001, fsdp_large=(0.05, 0.05), ddp=(0.1, 0.09), notes=notes)
    assert none_f is None and none_d is None and len(notes) == 2 and "left unset" in notes[0]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,micro", [(2, 4), (4, 4), (4, 8), (3, 1)])
def test_pipeline_schedules_are_complete_and_ordered(schedule, stages, micro):
    if (stages, micro) == (2, 4):  # torch's orders, written out
        assert pipeline_ops(schedule, 0, 2, 4) == {
            "gpipe": [("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0), ("B", 1), ("B", 2), ("B", 3)],
            "1f1b": [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)]}[schedule]
        assert pipeline_ops("1f1b", 1, 2, 4) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2),
                                                  ("F", 3), ("B", 3)]
    for s in range(stages):
        ops = pipeline_ops(schedule, s, stages, micro)
        assert sorted(ops) == sorted([("F", m) for m in range(micro)] + [("B", m) for m in range(micro)])
        for m in range(micro):
            assert ops.index(("F", m)) < ops.index(("B", m))
    if schedule == "1f1b" and micro >= stages:  # at most S - s micro-batches in flight on stage s
        for s in range(stages):
            live = peak = 0
            for kind, _ in pipeline_ops(schedule, s, stages, micro):
                live += 1 if kind == "F" else -1
                peak = max(peak, live)
            assert peak == stages - s


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_balanced_pipeline_without_transfers_takes_m_plus_s_minus_1_slots(schedule):
    # equal stages, no transfer: (M + S - 1) slots of forward and of backward (eq. 6.1's structure)
    s, m, tf, tb = 4, 8, 1.0, 2.0
    span, busy = simulate_pipeline(schedule, [tf] * s, [tb] * s, [0.0] * (s - 1), m)
    assert span == pytest.approx((m + s - 1) * (tf + tb))
    assert busy == [m * (tf + tb)] * s


def test_transfers_lengthen_the_pipeline():
    no = simulate_pipeline("gpipe", [1.0] * 2, [2.0] * 2, [0.0], 4)[0]
    yes = simulate_pipeline("gpipe", [1.0] * 2, [2.0] * 2, [0.5], 4)[0]
    assert yes > no


def test_pipeline_transfers_wait_for_the_receiver_and_take_turns_on_the_link():
    """gloo's send/recv are rendezvous (a transfer starts once the receiver's ready-to-receive notice has
    reached the sender) and a direction carries one transfer at a time (measured on an emulated link, stop 42)."""
    # GPipe, 2 stages, 2 micro-batches, forward 1 s, backward 1 s, transfers 3 s: the link is the bottleneck
    span, _ = simulate_pipeline("gpipe", [1.0, 1.0], [1.0, 1.0], [3.0], 2)
    # activation 0 at 1..4, F(1,0) 4..5; activation 1 posted at 2, but stage 1 posts its receive at 5 (after
    # F(1,0)): 5..8, F(1,1) 8..9; B(1,0) 9..10, gradient 0 10..13 (stage 0's notice, posted at 5, came
    # behind activation 1 at 8), B(1,1) 10..11, gradient 1 waits for its direction (13) and for stage 0's
    # receive after B(0,0) 13..14: 14..17, B(0,1) 17..18
    assert span == pytest.approx(18.0)
    # free transfers: (M + S - 1) slots of forward and backward
    assert simulate_pipeline("gpipe", [1.0, 1.0], [1.0, 1.0], [0.0], 2)[0] == pytest.approx(6.0)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,micro", [(2, 4), (4, 4), (4, 8), (3, 1), (2, 2)])
def test_stage_programs_run_the_schedule_and_pair_every_send_with_a_receive(schedule, stages, micro):
    programs = [stage_program(schedule, s, stages, micro) for s in range(stages)]
    for s, prog in enumerate(programs):
        assert [op for op in prog if op[0] in ("F", "B")] == pipeline_ops(schedule, s, stages, micro)
        posted = set()
        for op, arg in prog:  # a stage waits only for what it has posted
            if op in ("send", "recv"):
                posted.add(arg)
            elif op == "wait":
                assert set(arg) <= posted
        assert posted == {t for op, arg in prog if op == "wait" for t in arg}  # and waits for all it posts
    sends = sorted(arg for prog in programs for op, arg in prog if op == "send")
    recvs = sorted(arg for prog in programs for op, arg in prog if op == "recv")
    assert sends == recvs and len(sends) == 2 * micro * (stages - 1)


def test_1f1b_waits_for_each_send_like_torchs_schedule():
    """torch's Schedule1F1B posts a forward's send with the next backward's receive and waits for both: with
    rendezvous transfers a stage cannot compute ahead of its neighbour's receive, and a stage's
    ready-to-receive notice, posted after its own send, travels behind that send's data, so the two
    directions take turns (1F1B's runs over emulated links, stops 43 and 62)."""
    # 2 stages, 2 micro-batches, forward 1 s, backward 1 s, transfers 3 s. Stage 0: F0 0..1, activation 0
    # 1..4 (stage 1 posted its receive at 0; stage 0's send is done once handed over, at 1); F1 1..2; posts
    # send F1 and receive B0 at 2 (that notice reaches stage 1 behind activation 0, at 4). Stage 1: F0 4..5,
    # B0 5..6, posts send B0 (gradient 0 6..9), then receive F1, whose notice follows gradient 0: activation
    # 1 9..12; stage 0's send F1 is handed over at 9, when gradient 0 arrives: B0 9..10, posts receive B1 at
    # 10 (its notice behind activation 1, at 12). Stage 1 F1 12..13, B1 13..14, gradient 1 14..17; stage 0
    # B1 17..18.
    span, busy = simulate_pipeline("1f1b", [1.0, 1.0], [1.0, 1.0], [3.0], 2)
    assert span == pytest.approx(18.0) and busy == [4.0, 4.0]
    # a sender's own time per send lengthens the op that produces it
    assert simulate_pipeline("1f1b", [1.0, 1.0], [1.0, 1.0], [0.0], 2, [0.5])[0] > \
        simulate_pipeline("1f1b", [1.0, 1.0], [1.0, 1.0], [0.0], 2)[0]


def test_an_idle_streams_token_bucket_lets_a_transfer_through_at_once():
    """tc tbf's bucket (emulated links): an idle direction passes up to ``bucket_s`` of wire time at once and
    refills one second per second of idleness (benchmarks/p2p_links.py, docs/validation.md stop 62)."""
    # GPipe, 2 stages, 2 micro-batches, forward = backward = 1 s, transfers 3 s, bucket 3 s. Activation 0
    # at 1 passes at once (full bucket); activation 1 at 2 has 1 s of bucket: 2..4; F(1,1) 4..5, B(1,0)
    # 5..6; gradient 0 at 6 on the idle backward direction passes at once, B(1,1) 6..7, gradient 1 at 7
    # (stage 0 posts its receive after B(0,0) 6..7) has 1 s: 7..9; B(0,1) 9..10
    assert simulate_pipeline("gpipe", [1.0, 1.0], [1.0, 1.0], [3.0], 2, bucket_s=[3.0])[0] == pytest.approx(10.0)
    assert simulate_pipeline("gpipe", [1.0, 1.0], [1.0, 1.0], [3.0], 2, bucket_s=[0.0])[0] == pytest.approx(18.0)
    # one micro-batch: F 0..1, activation, F 1 s, B 1 s, gradient, B 1 s; a full bucket takes a transfer's
    # wire time but not its fixed part
    one = [simulate_pipeline("gpipe", [1.0, 1.0], [1.0, 1.0], [3.0], 1, bucket_s=bucket, fixed_s=fixed)[0]
           for bucket, fixed in (([0.0], [0.0]), ([3.0], [0.0]), ([3.0], [1.0]))]
    assert one == pytest.approx([10.0, 4.0, 6.0])


def test_notices_that_cross_before_any_data_let_both_directions_move_at_once():
    """Three 1F1B stages: where a stage's notice went out before its neighbour's data, the two directions
    overlap (an exchange took one transfer time, not two: benchmarks/p2p_links.py), so the step is shorter
    than with one transfer at a time per boundary, and never shorter than with no transfers."""
    f, b, tr = [1.0] * 3, [1.0] * 3, [1.0] * 2
    span = simulate_pipeline("1f1b", f, b, tr, 3)[0]
    # one transfer at a time per boundary, in either direction, gave 20 s
    assert span == pytest.approx(18.0)
    assert simulate_pipeline("1f1b", f, b, [0.0, 0.0], 3)[0] < span


def test_pipeline_prediction_and_its_eq6_reference():
    prof = make_profile()
    cl = make_cluster(bw=1e9, latency=0.0)
    for strategy in ("gpipe", "1f1b"):
        p = predict(prof, cl, Setting(strategy, 2, 32, epoch_samples=3200, microbatches=4))
        assert p.inputs["stage_bounds"] == [0, 2, 4]
        # 2 equal stages, 4 micro-batches of 8: (4 + 1) slots of one stage's micro-batch time
        slot = 2 * (1e-3 * 8) + 2 * (2e-3 * 8)
        assert compute_s(p) + p.breakdown_s["bubble_s"] == pytest.approx(5 * slot, rel=1e-6)
        # eq. 6.1 with a free network: T_seq (W + M - 1) / (W M), T_seq = 4 micro-batch steps
        t_seq = 4 * prof.step_at(8).step_s
        assert p.reference_epoch_s["eq6.1+6.2"] == pytest.approx(t_seq * 5 / 8 * 3200 / 32, rel=1e-6)


def test_pipeline_rejects_impossible_settings():
    prof = make_profile()
    with pytest.raises(UserError, match="divide"):
        predict(prof, make_cluster(), Setting("gpipe", 2, 30, epoch_samples=100, microbatches=4))
    with pytest.raises(UserError, match="layers"):
        predict(prof, make_cluster(devices=8), Setting("gpipe", 8, 32, epoch_samples=100, microbatches=4))
    with pytest.raises(UserError, match="devices"):
        predict(prof, make_cluster(devices=2), Setting("ddp", 4, 8, epoch_samples=100))
    with pytest.raises(UserError, match="allowed"):
        predict(prof, make_cluster(), Setting("pipedream", 2, 8, epoch_samples=100))


def test_butterfly_allreduce_matches_ring_for_equal_peers_and_favours_fast_peers():
    n, g = 4, 1e9
    equal = butterfly_allreduce_s(g, [1.0] * n, [0.0] * n)
    assert equal == pytest.approx(2 * g * (n - 1) / n / 1e9, rel=1e-6)
    # one slow peer: the LP gives it nothing to reduce, so it only sends its vector and receives the average,
    # one after the other (hivemind delays a zero-fraction peer's results until it has sent everything)
    mixed = butterfly_allreduce_s(g, [1.0, 1.0, 1.0, 0.1], [0.0] * n)
    assert mixed == pytest.approx(2 * g / 0.1e9, rel=1e-6)
    # equal parts (no bandwidth declared): the slow peer reduces a quarter, sending and receiving at once
    assert butterfly_allreduce_s(g, [1.0, 1.0, 1.0, 0.1], [0.0] * n, balanced=False) == pytest.approx(
        g * (1 + (n - 2) / n) / 0.1e9, rel=1e-6)
    # peers that are only a little uneven all reduce a share: the LP beats equal parts
    near = [1.0, 1.0, 0.8, 0.7]
    assert butterfly_allreduce_s(g, near, [0.0] * n) < butterfly_allreduce_s(g, near, [0.0] * n, balanced=False)
    assert butterfly_allreduce_s(g, [1.0], [0.0]) == 0.0


def test_butterfly_allreduce_with_auxiliary_and_client_peers():
    g, bw = 1e9, 1.0
    three = butterfly_allreduce_s(g, [bw] * 3, [0.0] * 3, balanced=False)
    assert three == pytest.approx(g * (1 + 1 / 3) / 1e9, rel=1e-6)
    # an auxiliary peer takes a quarter to reduce and sends no vector: the trainers send less
    with_aux = butterfly_allreduce_s(g, [bw] * 4, [0.0] * 4, balanced=False, roles=["trainer"] * 3 + ["auxiliary"])
    assert with_aux == pytest.approx(g * (1 + 1 / 4) / 1e9, rel=1e-6)
    # the auxiliary peer's own load: 3 trainers' quarter in and out; on a slow link it is the bottleneck
    slow_aux = butterfly_allreduce_s(g, [bw] * 3 + [0.1], [0.0] * 4, balanced=False,
                                     roles=["trainer"] * 3 + ["auxiliary"])
    assert slow_aux == pytest.approx(3 * g / 4 / 0.1e9, rel=1e-6)
    # declared bandwidths: the LP gives the slow auxiliary peer a smaller part than equal parts do
    assert butterfly_allreduce_s(g, [bw] * 3 + [0.1], [0.0] * 4, roles=["trainer"] * 3 + ["auxiliary"]) < slow_aux
    # a client reduces nothing: it sends everything, then receives everything
    client = butterfly_allreduce_s(g, [bw] * 3, [0.0] * 3, balanced=False, roles=["trainer", "trainer", "client"])
    assert client == pytest.approx(2 * g / 1e9, rel=1e-6)
    # one sender and an auxiliary peer average nothing
    assert butterfly_allreduce_s(g, [bw] * 2, [0.0] * 2, roles=["trainer", "auxiliary"]) == 0.0
    with pytest.raises(ValueError, match="allowed"):
        butterfly_allreduce_s(g, [bw] * 2, [0.0] * 2, roles=["trainer"])
    with pytest.raises(ValueError, match="nobody can reduce"):
        butterfly_allreduce_s(g, [bw] * 2, [0.0] * 2, roles=["client", "client"])


def test_collaborative_accumulates_the_target_batch_from_the_peers_throughputs():
    prof = make_profile()
    peers = [PeerSpec(compute_share=1.0, bandwidth_gb_per_s=1e3), PeerSpec(compute_share=3.0, bandwidth_gb_per_s=1e3)]
    cl = make_cluster(peers=peers)
    s = Setting("collaborative", 2, 8, epoch_samples=3200, target_batch_size=256, matchmaking_time_s=2.0)
    p = predict(prof, cl, s)
    step = prof.step_at(8)
    rate = 8 / (step.forward_s + step.backward_s) + 8 / ((step.forward_s + step.backward_s) / 3)
    assert compute_s(p) == pytest.approx(256 / rate, rel=1e-6)
    assert p.epoch_s == pytest.approx(p.step_s * 3200 / 256)
    # accumulation (0.6 s) is shorter than matchmaking: the gradient round waits for most of the 2 s window
    wait = 2.0 - (p.inputs["accumulate_s"] - max(p.inputs["peer_step_s"]))
    assert p.inputs["matchmaking_wait_s"] == pytest.approx(wait) and wait > 0
    assert p.breakdown_s["averaging_s"] == pytest.approx(p.inputs["grad_round_s"] + p.inputs["state_round_s"])
    assert p.inputs["grad_round_s"] > wait  # the wait is counted once, in the gradient round
    long = predict(prof, cl, Setting("collaborative", 2, 8, epoch_samples=3200, target_batch_size=256,
                                     matchmaking_time_s=0.01))
    assert long.inputs["matchmaking_wait_s"] == 0.0  # matchmaking hidden behind a long accumulation
    lu = predict(prof, cl, Setting("collaborative", 2, 8, epoch_samples=3200, target_batch_size=256,
                                   matchmaking_time_s=2.0, use_local_updates=True))
    assert lu.breakdown_s["averaging_s"] < p.breakdown_s["averaging_s"]  # averaging overlaps local steps
    bigger = predict(prof, cl, Setting("collaborative", 2, 8, epoch_samples=3200, target_batch_size=1024,
                                       matchmaking_time_s=2.0))
    assert bigger.epoch_s < p.epoch_s  # fewer averaging rounds per epoch
    assert math.isfinite(bigger.step_s)


def test_collaborative_state_round_costs_cpu_peers_in_full_and_hides_on_gpus():
    prof = make_profile()
    s = Setting("collaborative", 2, 8, epoch_samples=3200, target_batch_size=256, matchmaking_time_s=0.01)
    cpu = predict(prof, make_cluster(bw=0.05), s)
    assert cpu.inputs["state_round_on_cores"]
    # parameters only (no optimizer state): the same bytes as the gradient round, added in full
    assert cpu.inputs["state_round_s"] == pytest.approx(cpu.inputs["grad_round_s"])
    assert cpu.breakdown_s["averaging_s"] == pytest.approx(2 * cpu.inputs["grad_round_s"])
    gpu = predict(prof, make_cluster(bw=0.05).model_copy(update={"device": DeviceSpec(kind="a100-40gb")}), s)
    assert not gpu.inputs["state_round_on_cores"]
    # on GPUs the state round overlaps the next epoch's accumulation, which is longer here
    assert gpu.inputs["accumulate_s"] > gpu.inputs["state_round_s"]
    assert gpu.breakdown_s["averaging_s"] == pytest.approx(gpu.inputs["grad_round_s"])
    every4 = predict(prof, make_cluster(bw=0.05), Setting("collaborative", 2, 8, epoch_samples=3200,
                                                          target_batch_size=256, matchmaking_time_s=0.01,
                                                          average_state_every=4))
    assert every4.inputs["state_round_s"] == pytest.approx(cpu.inputs["state_round_s"] / 4)


def test_collaborative_with_a_hivemind_fit_adds_overshoot_and_the_measured_epoch_overhead():
    prof = make_profile()
    s = Setting("collaborative", 2, 8, epoch_samples=3200, target_batch_size=64, matchmaking_time_s=0.01)
    fit = HivemindFit(epoch_overhead_s=1.5, overshoot_steps=1.0, reference_param_bytes=prof.param_bytes,
                      matchmaking_time_s=0.01)
    plain = predict(prof, make_cluster(bw=1e3), s)
    hm = predict(prof, make_cluster(bw=1e3).model_copy(update={"hivemind": fit}), s)
    assert [n for n in plain.notes if "no hivemind fit" in n] and not hm.notes  # fitted at this matchmaking time
    step = hm.inputs["peer_step_s"][0]
    # 64 samples = 4 steps per peer, plus one of overshoot: the epoch holds 2 x 5 x 8 samples
    assert hm.inputs["accumulate_s"] == pytest.approx(5 * step)
    assert hm.inputs["samples_per_global_epoch"] == pytest.approx(80)
    assert hm.breakdown_s["averaging_s"] == pytest.approx(1.5)  # replaces the two rounds (same bytes as the reference)
    assert hm.epoch_s == pytest.approx(hm.step_s * 3200 / 80)
    assert hm.step_s > plain.step_s
    # a matchmaking wait leaves the cores to hivemind's work: the two overlap
    long_mm = Setting("collaborative", 2, 8, epoch_samples=3200, target_batch_size=64, matchmaking_time_s=10.0)
    waited = predict(prof, make_cluster(bw=1e3).model_copy(update={"hivemind": fit}), long_mm)
    assert waited.inputs["matchmaking_wait_s"] > 1.5
    assert waited.breakdown_s["averaging_s"] == pytest.approx(waited.inputs["matchmaking_wait_s"])
    # the fit was measured at 0.01 s, this setting uses 10 s: the prediction says so
    assert len(waited.notes) == 1 and "0.01 s" in waited.notes[0] and "10 s" in waited.notes[0]
    unrecorded = fit.model_copy(update={"matchmaking_time_s": None})
    assert "unrecorded" in predict(prof, make_cluster(bw=1e3).model_copy(update={"hivemind": unrecorded}), s).notes[0]
    # twice the reference's bytes over a slow link: the extra bytes' two rounds come on top
    big = fit.model_copy(update={"reference_param_bytes": prof.param_bytes // 2})
    slow = predict(prof, make_cluster(bw=0.01).model_copy(update={"hivemind": big}), s)
    assert slow.breakdown_s["averaging_s"] > 1.5 + 2 * (prof.param_bytes / 2) / 0.01e9 * 0.99


def test_collaborative_hivemind_work_during_the_steps_moves_from_averaging_into_forward_and_backward():
    prof = make_profile()
    s = Setting("collaborative", 2, 8, epoch_samples=3200, target_batch_size=64, matchmaking_time_s=0.01)
    fit = HivemindFit(epoch_overhead_s=1.5, overshoot_steps=1.0, reference_param_bytes=prof.param_bytes,
                      matchmaking_time_s=0.01)
    cluster = make_cluster(bw=1e3)
    before = predict(prof, cluster.model_copy(update={"hivemind": fit}), s)
    split = predict(prof, cluster.model_copy(update={"hivemind": fit.model_copy(update={"compute_overhead_s": 0.6})}), s)
    step = prof.step_at(8)
    fb = lambda p: p.breakdown_s["forward_s"] + p.breakdown_s["backward_s"]  # noqa: E731
    # 4 steps per peer + 1 of overshoot, then 0.6 s of hivemind's work in them, in the profiled proportion
    assert fb(before) == pytest.approx(5 * (step.forward_s + step.backward_s))
    assert fb(split) == pytest.approx(fb(before) + 0.6) and split.inputs["hivemind_in_steps_s"] == 0.6
    assert split.breakdown_s["forward_s"] / split.breakdown_s["backward_s"] == pytest.approx(step.forward_s / step.backward_s)
    assert split.breakdown_s["averaging_s"] == pytest.approx(1.5 - 0.6)
    assert split.step_s == pytest.approx(before.step_s)  # a split of the measured overhead, not more of it
    assert split.inputs["samples_per_global_epoch"] == pytest.approx(before.inputs["samples_per_global_epoch"])
    # a matchmaking wait starts from the epoch's end with the slowed steps: the wait is shorter by that work,
    # and the rest of the overhead overlaps what is left of it
    long_mm = Setting("collaborative", 2, 8, epoch_samples=3200, target_batch_size=64, matchmaking_time_s=10.0)
    waited = predict(prof, cluster.model_copy(update={"hivemind": fit}), long_mm)
    waited_split = predict(prof, cluster.model_copy(update={"hivemind": fit.model_copy(update={"compute_overhead_s": 0.6})}),
                           long_mm)
    assert waited_split.inputs["matchmaking_wait_s"] == pytest.approx(waited.inputs["matchmaking_wait_s"] - 0.6)
    assert waited_split.step_s == pytest.approx(waited.step_s)  # the wait dominates either way
    # never more than the overhead it is part of
    more = predict(prof, cluster.model_copy(update={"hivemind": fit.model_copy(update={"compute_overhead_s": 9.0})}), s)
    assert more.inputs["hivemind_in_steps_s"] == pytest.approx(1.5) and more.breakdown_s["averaging_s"] == pytest.approx(0.0)


def test_collaborative_overshoot_is_read_at_the_peers_compute_step_and_names_another_network():
    prof = make_profile()
    s = Setting("collaborative", 2, 8, epoch_samples=3200, target_batch_size=64, matchmaking_time_s=0.01)
    compute = prof.step_at(8).forward_s + prof.step_at(8).backward_s
    # 2 extra steps at this compute step, 0 at ten times it: the prediction reads 2
    fit = HivemindFit(epoch_overhead_s=1.0, overshoot_steps=1.0, overshoot_points=[(compute, 2.0), (10 * compute, 0.0)],
                      reference_param_bytes=prof.param_bytes, matchmaking_time_s=0.01, reference_network="toy")
    hm = predict(prof, make_cluster(bw=1e3).model_copy(update={"hivemind": fit}), s)
    assert hm.inputs["overshoot_steps"] == pytest.approx(2.0)
    assert hm.inputs["samples_per_global_epoch"] == pytest.approx(64 + 2 * 2 * 8)
    assert not hm.notes
    other = predict(prof, make_cluster(bw=1e3).model_copy(
        update={"hivemind": fit.model_copy(update={"reference_network": "resnet18"})}), s)
    [note] = other.notes
    assert "calibrated on resnet18, not toy" in note and "--swarm-network toy --swarm-batch-sizes 8" in note


def test_collaborative_overshoot_follows_hiveminds_rule_on_the_fits_step_pattern():
    prof = make_profile(per_sample_s=0.01)  # about 1 s steps at batch 8, longer than the trackers' refresh
    compute = prof.step_at(8).forward_s + prof.step_at(8).backward_s
    fit = HivemindFit(epoch_overhead_s=1.0, overshoot_points=[(compute, 2.0)], reference_param_bytes=prof.param_bytes,
                      matchmaking_time_s=0.01, reference_network="toy")
    cluster = make_cluster(bw=1e3)

    def overshoot(pattern, steps_per_peer):
        s = Setting("collaborative", 2, 8, epoch_samples=3200, target_batch_size=2 * 8 * steps_per_peer,
                    matchmaking_time_s=0.01)
        p = predict(prof, cluster.model_copy(update={"hivemind": fit.model_copy(update={"step_pattern_s": pattern})}), s)
        return p.inputs["overshoot_steps"], p.inputs["overshoot_from"]

    # a share of 2 steps that ends with the slower step ends at the rule's estimate of the epoch's end; one that
    # ends with the faster step is often followed by another
    spread = 0.1 * compute
    slow_second = [(0.0, spread), (0.5 * compute, spread), (0.0, spread)]
    slow_first = [(0.5 * compute, spread), (0.0, spread), (0.0, spread)]
    assert overshoot(slow_second, 2) == (pytest.approx(0.0, abs=0.1), "rule") and overshoot(slow_first, 2)[0] > 0.5
    # hivemind's work in the first two steps after the round (as measured, issue 14): longer shares end with
    # steps shorter than the average, and run further past the target
    measured_like = [(0.4 * compute, spread), (0.6 * compute, spread), (0.0, spread)]
    two, six = overshoot(measured_like, 2)[0], overshoot(measured_like, 6)[0]
    assert 0.0 < two < six - 0.2 and six <= 1.0
    # a fit without the pattern keeps its overshoot read at the compute step
    assert overshoot([], 2) == (pytest.approx(2.0), "fit")


def test_collaborative_overshoot_draws_the_fits_epochs_whole():
    import random
    import statistics

    prof = make_profile(per_sample_s=0.01)  # about 1 s steps at batch 8
    c = prof.step_at(8).forward_s + prof.step_at(8).backward_s
    rng = random.Random(0)

    def extra(share):
        return rng.gauss(share * c, 0.05 * c)

    # in every epoch hivemind's work lands on one peer's first step (+0.3 of a step), the other's is clean;
    # which one changes at random; both second steps +0.4
    epochs = [[[extra(0.3), extra(0.4)], [extra(0.0), extra(0.4)]][::rng.choice((1, -1))] for _ in range(40)]
    firsts = [e[q][0] for e in epochs for q in (0, 1)]
    seconds = [e[q][1] for e in epochs for q in (0, 1)]
    fit = HivemindFit(epoch_overhead_s=1.0, reference_param_bytes=prof.param_bytes, matchmaking_time_s=0.01,
                      reference_network="toy", step_epochs_s=epochs,
                      step_pattern_s=[(statistics.fmean(firsts), statistics.stdev(firsts)),
                                      (statistics.fmean(seconds), statistics.stdev(seconds))])
    s = Setting("collaborative", 2, 8, epoch_samples=3200, target_batch_size=32, matchmaking_time_s=0.01)

    def overshoot(fit):
        p = predict(prof, make_cluster(bw=1e3).model_copy(update={"hivemind": fit}), s)
        return p.inputs["overshoot_steps"], p.inputs["overshoot_from"]

    whole, source = overshoot(fit)
    assert source == "rule" and 0.2 < whole < 0.5
    # the same steps drawn per peer and position (a fit without the epochs) lose which peer took the work
    apart, source = overshoot(fit.model_copy(update={"step_epochs_s": []}))
    assert source == "rule" and apart < whole - 0.1


def test_collaborative_gradient_round_adds_its_wire_time_to_the_fits_loopback_rounds():
    prof = make_profile()
    s = Setting("collaborative", 2, 8, epoch_samples=3200, target_batch_size=64, matchmaking_time_s=0.01)
    fit = HivemindFit(epoch_overhead_s=0.6, epoch_cpu_s=0.5, reference_param_bytes=prof.param_bytes,
                      matchmaking_time_s=0.01)

    def over(gb_per_s, **options):
        peers = [PeerSpec(compute_share=1.0, bandwidth_gb_per_s=gb_per_s) for _ in range(2)]
        return predict(prof, make_cluster(peers=peers).model_copy(update={"hivemind": fit}),
                       dataclasses.replace(s, **options))

    slow, fast = over(0.002), over(0.004)
    # the round's wire time at the link's rate, whatever hivemind's CPU per epoch: twice the rate, half of it
    assert slow.inputs["grad_round_wire_s"] > 0.1
    assert fast.inputs["grad_round_wire_s"] == pytest.approx(slow.inputs["grad_round_wire_s"] / 2, rel=0.05)
    assert (slow.breakdown_s["averaging_s"] - slow.inputs["link_wait_s"]) - (
        fast.breakdown_s["averaging_s"] - fast.inputs["link_wait_s"]) == pytest.approx(
        slow.inputs["grad_round_wire_s"] - fast.inputs["grad_round_wire_s"])
    # on loopback (no listed links) the fit's rounds hold it; with local updates there is no gradient round
    assert predict(prof, make_cluster().model_copy(update={"hivemind": fit}), s).inputs["grad_round_wire_s"] == 0.0
    assert over(0.002, use_local_updates=True).inputs["grad_round_wire_s"] == 0.0


def test_collaborative_epoch_lasts_at_least_both_rounds_on_the_link():
    prof = make_profile()
    fit = HivemindFit(epoch_overhead_s=0.2, overshoot_steps=0.0, reference_param_bytes=prof.param_bytes,
                      matchmaking_time_s=0.5)
    s = Setting("collaborative", 2, 8, epoch_samples=3200, target_batch_size=64, matchmaking_time_s=0.5)

    def swarm(bw):
        peers = [PeerSpec(compute_share=1.0, bandwidth_gb_per_s=bw) for _ in range(2)]
        return predict(prof, make_cluster(peers=peers).model_copy(update={"hivemind": fit}), s)

    fast, slow = swarm(10.0), swarm(0.001)
    assert fast.inputs["link_wait_s"] == 0.0  # the rounds fit between the epochs' compute
    # the gradient round, the parameter round in the background and its matchmaking hold the slow link
    rounds = slow.inputs["grad_round_s"] - slow.inputs["matchmaking_wait_s"] + slow.inputs["state_round_s"]
    assert slow.inputs["link_busy_s"] == pytest.approx(rounds + 0.5)
    assert slow.inputs["link_wait_s"] > 0
    assert slow.step_s == pytest.approx(slow.inputs["link_busy_s"])  # the epoch is the link's busy time
    # there, both peers' gradient matchmaking starts as the link frees: the join timeouts it risks are named
    assert [n for n in slow.notes if "request_timeout" in n] and not [n for n in fast.notes if "request_timeout" in n]
    every2 = predict(prof, make_cluster(peers=[PeerSpec(compute_share=1.0, bandwidth_gb_per_s=0.001)] * 2)
                     .model_copy(update={"hivemind": fit}), Setting("collaborative", 2, 8, epoch_samples=3200,
                                                                  target_batch_size=64, matchmaking_time_s=0.5,
                                                                  average_state_every=2))
    assert every2.inputs["link_busy_s"] < slow.inputs["link_busy_s"]  # a parameter round every second epoch


def test_collaborative_hivemind_work_stays_in_the_steps_as_far_as_the_parameter_round_overlaps_the_accumulation():
    prof = make_profile()
    s = Setting("collaborative", 2, 8, epoch_samples=3200, target_batch_size=64, matchmaking_time_s=0.5)

    def swarm(bw, in_steps=0.6, listed=True):
        fit = HivemindFit(epoch_overhead_s=1.0, compute_overhead_s=in_steps, overshoot_steps=0.0,
                          reference_param_bytes=prof.param_bytes, matchmaking_time_s=0.5)
        peers = [PeerSpec(compute_share=1.0, bandwidth_gb_per_s=bw) for _ in range(2)]
        cluster = make_cluster(bw=bw, peers=peers if listed else ())
        return predict(prof, cluster.model_copy(update={"hivemind": fit}), s)

    fast, slow = swarm(10.0), swarm(0.001)
    assert fast.inputs["state_round_overlap"] == 1.0 and fast.inputs["hivemind_in_steps_s"] == pytest.approx(0.6)
    # over the slow link the parameter round (0.5 s of matchmaking, then its transfer) outlasts the accumulation
    accumulation, transfer = slow.inputs["accumulate_s"] + 0.6, slow.inputs["state_round_s"]
    assert transfer > 10 * accumulation
    overlap = min(1.0, accumulation / (0.5 + transfer)) / min(1.0, accumulation / 0.5)
    assert slow.inputs["state_round_overlap"] == pytest.approx(overlap) and 0 < overlap < 0.1
    assert slow.inputs["hivemind_in_steps_s"] == pytest.approx(0.6 * overlap)
    # the link bounds the epoch: forward and backward hold less of hivemind's work, the link's wait more, the sum stays
    fb = lambda p: p.breakdown_s["forward_s"] + p.breakdown_s["backward_s"]  # noqa: E731
    none = swarm(0.001, in_steps=0.0)
    assert fb(slow) == pytest.approx(fb(none) + 0.6 * overlap)
    assert slow.step_s == pytest.approx(slow.inputs["link_busy_s"]) == pytest.approx(none.step_s)
    # links not listed are the fit's own (loopback): its figure stands
    assert swarm(0.001, listed=False).inputs["state_round_overlap"] == 1.0


def test_collaborative_rounds_run_at_the_averaging_efficiency_of_the_peers_links():
    prof = make_profile()
    s = Setting("collaborative", 2, 8, epoch_samples=3200, target_batch_size=64, matchmaking_time_s=0.01)
    peers = [PeerSpec(compute_share=1.0, bandwidth_gb_per_s=0.001) for _ in range(2)]
    full = predict(prof, make_cluster(peers=peers), s)
    half = predict(prof, make_cluster(peers=peers).model_copy(update={"averaging_efficiency": 0.5}), s)
    # the rounds' wire time doubles (matchmaking waits do not); the accumulation is untouched
    wire = full.inputs["grad_round_s"] - full.inputs["matchmaking_wait_s"]
    assert half.inputs["grad_round_s"] - half.inputs["matchmaking_wait_s"] == pytest.approx(2 * wire, rel=0.02)
    assert half.inputs["state_round_s"] == pytest.approx(2 * full.inputs["state_round_s"], rel=0.02)
    assert half.inputs["accumulate_s"] == full.inputs["accumulate_s"]
    # with a hivemind fit its overhead holds the rounds' work on the cores: the wire time is added at the full
    # bandwidth, and the efficiency counts in the link's busy time
    fit = HivemindFit(epoch_overhead_s=0.6, overshoot_steps=0.0, reference_param_bytes=prof.param_bytes,
                      matchmaking_time_s=0.01)
    fitted = [predict(prof, make_cluster(peers=peers).model_copy(update={"hivemind": fit, "averaging_efficiency": e}),
                      s) for e in (1.0, 0.5)]
    assert fitted[1].breakdown_s["averaging_s"] - fitted[1].inputs["link_wait_s"] == pytest.approx(
        fitted[0].breakdown_s["averaging_s"] - fitted[0].inputs["link_wait_s"])
    busy_full, busy_half = (f.inputs["link_busy_s"] - 0.01 for f in fitted)  # less the parameter round's matchmaking
    assert busy_half == pytest.approx(2 * busy_full, rel=0.02)


def test_eq51_reference_equals_its_formula():
    prof = make_profile()
    cl = make_cluster(bw=2.0, latency=1e-3)
    s = Setting("ddp", 4, 8, epoch_samples=3200, bucket_cap_mb=4)
    per_batch = prof.step_at(8).step_s + 2 * 3 * (1e-3 + 4 * MIB / (4 * 2e9))
    assert eq_5_1_epoch_s(prof, cl, s) == pytest.approx(per_batch * 3200 / 32)


def test_collaborative_groups_average_within_the_slowest_group():
    prof = make_profile()
    peers = [PeerSpec(compute_share=1.0, bandwidth_gb_per_s=b) for b in (0.01, 0.01, 0.1, 0.1)]
    cl = make_cluster(peers=peers)
    whole = predict(prof, cl, Setting("collaborative", 4, 8, epoch_samples=3200, target_batch_size=256))
    pairs = predict(prof, cl, Setting("collaborative", 4, 8, epoch_samples=3200, target_batch_size=256,
                                      options={"target_group_size": 2}))
    assert whole.inputs["averaging_group_size"] == 4 and pairs.inputs["averaging_group_size"] == 2
    # the slowest pair (both at 0.01 GB/s) each send and receive the whole vector once: nbytes / bw
    assert pairs.inputs["grad_round_s"] - pairs.inputs["matchmaking_wait_s"] == pytest.approx(
        prof.param_bytes / 0.01e9 + 2 * 0.0 + cl.collective_fixed_s, rel=1e-6)
    assert pairs.inputs["grad_round_s"] < whole.inputs["grad_round_s"]


def test_collaborative_auxiliary_and_client_peers_and_declared_bandwidths():
    prof = make_profile()
    peers = [PeerSpec(compute_share=1.0, bandwidth_gb_per_s=0.01) for _ in range(3)] + \
        [PeerSpec(compute_share=1.0, bandwidth_gb_per_s=0.02)]
    cl = make_cluster(peers=peers)

    def setting(**options):
        return Setting("collaborative", 4, 8, epoch_samples=3200, target_batch_size=256, matchmaking_time_s=0.01,
                       options=options)

    trainers = predict(prof, cl, setting())
    aux = predict(prof, cl, setting(auxiliary_peers=[3]))
    # the auxiliary peer trains on nothing: 3 peers accumulate the target batch, slower than 4
    assert aux.inputs["trainers"] == 3 and aux.inputs["accumulate_s"] == pytest.approx(
        trainers.inputs["accumulate_s"] * 4 / 3)
    rnd = butterfly_allreduce_s(float(prof.param_bytes), [0.01, 0.01, 0.01, 0.02], [0.0] * 4, balanced=False,
                                roles=["trainer"] * 3 + ["auxiliary"])
    assert aux.inputs["grad_round_s"] == pytest.approx(rnd + aux.inputs["matchmaking_wait_s"])
    # declared bandwidths: hivemind's LP gives the faster auxiliary peer more, so the round is shorter (a peer much
    # faster than the others would get everything, and the others' delayed results make the round longer)
    balanced = predict(prof, cl, setting(auxiliary_peers=[3], declared_bandwidths_mbit_per_s="network"))
    assert balanced.inputs["load_balanced"] and balanced.inputs["grad_round_s"] < aux.inputs["grad_round_s"]
    client = predict(prof, cl, setting(client_mode_peers=[2]))
    assert client.inputs["peer_roles"] == ["trainer", "trainer", "client", "trainer"]
    assert client.inputs["grad_round_s"] > trainers.inputs["grad_round_s"]  # the client sends, then receives


def test_a_lone_peer_trains_to_its_epochs_end_then_waits_for_a_partner_until_the_timeout():
    # epoch 10 s at 4 samples/s, timeout 20 s: 5 s to the first epoch's end, a wait, then whole epochs
    assert lone_peer_samples(3.0, 4.0, 10.0, 20.0) == pytest.approx(12.0)
    assert lone_peer_samples(25.0, 4.0, 10.0, 20.0) == pytest.approx(20.0)  # the wait ends with the stretch
    assert lone_peer_samples(30.0, 4.0, 10.0, 20.0) == pytest.approx(40.0)  # 5 s, wait 20 s, 5 s of the next
    assert lone_peer_samples(0.0, 4.0, 10.0, 20.0) == 0.0


def test_collaborative_churn_is_predicted_stretch_by_stretch():
    prof = make_profile()
    cl = make_cluster(bw=1.0, peers=[PeerSpec(compute_share=1.0, bandwidth_gb_per_s=1.0) for _ in range(3)])

    def setting(churn, run_s=100.0):
        return Setting("collaborative", 3, 8, epoch_samples=3200, target_batch_size=256, matchmaking_time_s=0.01,
                       options={"churn": churn, "run_s": run_s})

    steady = predict(prof, cl, Setting("collaborative", 3, 8, epoch_samples=3200, target_batch_size=256,
                                       matchmaking_time_s=0.01))
    two = predict(prof, cl, Setting("collaborative", 2, 8, epoch_samples=3200, target_batch_size=256,
                                    matchmaking_time_s=0.01))
    # peer 2 leaves half-way and never comes back: the run's mean epoch is between the 3- and 2-peer epochs
    left = predict(prof, cl, setting([{"peer": 2, "leave_at_s": 50.0}]))
    rate3 = steady.inputs["samples_per_global_epoch"] / steady.step_s
    rate2 = two.inputs["samples_per_global_epoch"] / two.step_s
    assert left.inputs["samples_trained"] == pytest.approx(50 * rate3 + 50 * rate2)
    assert left.step_s == pytest.approx(100 * 256 / (50 * rate3 + 50 * rate2))
    assert [st["peers"] for st in left.inputs["churn_stretches"]] == [[0, 1, 2], [0, 1]]
    # killed instead: the same stretches, minus half of the peer's share of an epoch
    killed = predict(prof, cl, setting([{"peer": 2, "kill_at_s": 50.0}]))
    assert 0 < killed.inputs["samples_lost_to_kills"] < steady.inputs["samples_per_global_epoch"] / 3
    assert killed.step_s > left.step_s
    # a rejoining peer trains again after a step whose gradients the state load discards and the load
    # (parameters + optimizer state over its link)
    back = predict(prof, cl, setting([{"peer": 2, "kill_at_s": 30.0, "rejoin_at_s": 60.0}]))
    load = (prof.param_bytes + prof.optimizer_state_bytes) / 1e9
    first = steady.inputs["peer_step_s"][2]
    assert back.inputs["state_load_s"][2] == pytest.approx(load) and first > 0
    assert [st["from_s"] for st in back.inputs["churn_stretches"]] == pytest.approx([0.0, 30.0, 60.0 + first + load])
    # the load streams at the share of the link hivemind's transfers reach, as its rounds do
    half = predict(prof, cl.model_copy(update={"averaging_efficiency": 0.5}),
                   setting([{"peer": 2, "kill_at_s": 30.0, "rejoin_at_s": 60.0}]))
    assert half.inputs["state_load_s"][2] == pytest.approx(2 * load)
    assert steady.step_s < back.step_s < killed.step_s
    assert any("no hivemind.peer_startup_s" in n for n in back.notes)
    # with the calibrated start-up of a joining peer it trains that much later
    started = predict(prof, cl.model_copy(update={"hivemind": HivemindFit(epoch_overhead_s=0.0, peer_startup_s=5.0)}),
                      setting([{"peer": 2, "kill_at_s": 30.0, "rejoin_at_s": 60.0}]))
    assert [st["from_s"] for st in started.inputs["churn_stretches"]] == pytest.approx([0.0, 30.0, 65.0 + first + load])
    assert started.inputs["peer_startup_s"] == 5.0 and not any("peer_startup_s" in n for n in started.notes)
    with pytest.raises(UserError, match="run_s"):
        predict(prof, cl, setting([{"peer": 2, "leave_at_s": 50.0}], run_s=None))
    # a pair whose peer 1 is killed: peer 0 alone trains to its epoch's end, then waits in a round nobody
    # joins until peer 1 is back (hivemind's averager needs a group of 2)
    pair = Setting("collaborative", 2, 8, epoch_samples=3200, target_batch_size=256, matchmaking_time_s=0.01,
                   options={"churn": [{"peer": 1, "kill_at_s": 30.0, "rejoin_at_s": 60.0}], "run_s": 100.0,
                            "averaging_timeout_s": 20.0})
    lone = predict(prof, cl, pair).inputs["churn_stretches"][1]
    assert lone["peers"] == [0] and lone["alone"]
    solo = predict(prof, cl, Setting("collaborative", 1, 8, epoch_samples=3200, target_batch_size=256,
                                     matchmaking_time_s=0.01))
    per_s = solo.inputs["samples_per_global_epoch"] / solo.step_s
    assert lone["samples"] == pytest.approx(lone_peer_samples(lone["to_s"] - lone["from_s"], per_s, solo.step_s, 20.0))
    assert lone["samples"] < (lone["to_s"] - lone["from_s"]) * per_s
    with pytest.raises(UserError, match="allowed: 0..2"):
        predict(prof, cl, setting([{"peer": 5, "leave_at_s": 50.0}]))


def test_a_peer_that_finds_its_partner_waiting_alone_in_a_round_trains_alone_through_the_reunion():
    """The survivor of a pair waits in its round until the rejoined peer's step, the gradient round and the
    parameter round pending since the kill are done; a survivor that is training when its partner
    arrives (its round timed out) has no reunion."""
    import dataclasses

    from ddlscope.distribution.collaborative import lone_peer_waits_at_end

    # half an epoch of 10 s, then a wait of 20 s, then whole epochs between waits
    assert not lone_peer_waits_at_end(4.0, 10.0, 20.0) and lone_peer_waits_at_end(6.0, 10.0, 20.0)
    assert lone_peer_waits_at_end(24.0, 10.0, 20.0) and not lone_peer_waits_at_end(26.0, 10.0, 20.0)
    assert lone_peer_waits_at_end(36.0, 10.0, 20.0) and not lone_peer_waits_at_end(5.0, 10.0, 0.0)
    prof = make_profile()
    cl = make_cluster(bw=1.0, peers=[PeerSpec(compute_share=1.0, bandwidth_gb_per_s=1e-3) for _ in range(2)])

    def pair(timeout_s):
        return predict(prof, cl, Setting("collaborative", 2, 8, epoch_samples=3200, target_batch_size=256,
                                         matchmaking_time_s=0.01,
                                         options={"churn": [{"peer": 1, "kill_at_s": 30.0, "rejoin_at_s": 60.0}],
                                                  "run_s": 200.0, "averaging_timeout_s": timeout_s}))

    waited = pair(300.0)
    lone, after = waited.inputs["churn_stretches"][1:]
    assert lone["waiting_at_end"] and after["peers"] == [0, 1]
    swarm = predict(prof, cl, Setting("collaborative", 2, 8, epoch_samples=3200, target_batch_size=256,
                                      matchmaking_time_s=0.01))
    step_s, round_s = swarm.inputs["peer_step_s"][1], swarm.breakdown_s["averaging_s"]
    assert round_s > 0 and after["reunion_s"] == pytest.approx(step_s + 2 * round_s)
    per_s = swarm.inputs["samples_per_global_epoch"] / swarm.step_s
    span_s = after["to_s"] - after["from_s"]
    # the newcomer trains outside the gradient round, here more than an epoch's samples at its pace: capped
    assert (after["reunion_s"] - round_s) * 8 / step_s > swarm.inputs["samples_per_global_epoch"]
    assert after["samples"] == pytest.approx(swarm.inputs["samples_per_global_epoch"]
                                             + (span_s - after["reunion_s"]) * per_s)
    assert after["samples"] < span_s * per_s
    # with hivemind's work inside the steps (a fit) the newcomer's step is as long as the swarm's steps are
    fitted = cl.model_copy(update={"hivemind": HivemindFit(epoch_overhead_s=2.0, compute_overhead_s=1.0)})
    churned = Setting("collaborative", 2, 8, epoch_samples=3200, target_batch_size=256, matchmaking_time_s=0.01,
                      options={"churn": [{"peer": 1, "kill_at_s": 30.0, "rejoin_at_s": 60.0}], "run_s": 200.0,
                               "averaging_timeout_s": 300.0})
    with_fit = predict(prof, fitted, churned)
    i = with_fit.inputs
    assert i["hivemind_in_steps_s"] > 0
    step_in_swarm = i["peer_step_s"][1] * (i["accumulate_s"] + i["hivemind_in_steps_s"]) / i["accumulate_s"]
    fit_swarm = predict(prof, fitted, dataclasses.replace(churned, options={}))
    assert i["churn_stretches"][2]["reunion_s"] == pytest.approx(step_in_swarm + 2 * fit_swarm.breakdown_s["averaging_s"])
    assert i["churn_stretches"][2]["from_s"] == pytest.approx(60.0 + step_in_swarm + i["state_load_s"][1])
    # with a round timeout of a microsecond the lone peer is training when peer 1 is back: no reunion
    trained = pair(1e-6).inputs["churn_stretches"]
    assert not trained[1]["waiting_at_end"] and trained[2]["reunion_s"] == 0.0
    assert trained[2]["samples"] == pytest.approx((trained[2]["to_s"] - trained[2]["from_s"]) * per_s)


def test_a_kill_inside_a_gradient_round_stalls_the_swarm_until_the_rounds_timeout():
    """hivemind's all-reduce waits for a member killed in the middle of it until averaging_timeout_s:
    the prediction is the likelier outcome and names the other."""
    import dataclasses

    from ddlscope.distribution.collaborative import kill_in_round_risk

    prof = make_profile()
    one_kill = ({"peer": 1, "kill_at_s": 30.0, "rejoin_at_s": 60.0},)

    def killed(bw_gb_per_s, timeout_s=20.0, kills=one_kill, peers=2):
        cl = make_cluster(bw=bw_gb_per_s, peers=[PeerSpec(compute_share=1.0, bandwidth_gb_per_s=bw_gb_per_s)
                                                 for _ in range(peers)])
        return predict(prof, cl, Setting("collaborative", peers, 8, epoch_samples=3200, target_batch_size=64,
                                         matchmaking_time_s=0.01,
                                         options={"churn": list(kills), "run_s": 200.0, "averaging_timeout_s": timeout_s}))

    # one kill, a short round in the epoch: likelier without the stall; two kills in rounds that are
    # nearly half of each epoch: likelier with one
    fast = killed(1.0)
    slow = killed(1e-2, peers=3, kills=(*one_kill, {"peer": 2, "kill_at_s": 100.0, "rejoin_at_s": 130.0}))
    for p in (fast, slow):
        assert 0 < p.inputs["kill_in_round_probability"] < 1 and p.inputs["kill_in_round_stall_s"] > 0
    assert fast.inputs["kill_in_round_probability"] < 0.5 < slow.inputs["kill_in_round_probability"]
    assert not fast.inputs["predicted_kill_in_round"] and fast.inputs["epoch_s_other_outcome"] > fast.step_s
    assert slow.inputs["predicted_kill_in_round"] and slow.inputs["epoch_s_other_outcome"] < slow.step_s
    assert any("no stall, the more likely outcome" in n for n in fast.notes)
    assert any("predicted: that stall" in n for n in slow.notes)
    # a longer timeout stalls longer
    assert killed(1.0, timeout_s=60.0).inputs["epoch_s_other_outcome"] > fast.inputs["epoch_s_other_outcome"]
    # nobody killed (a clean leave): no risk, no note
    left = killed(1.0, kills=({"peer": 1, "leave_at_s": 30.0},))
    assert left.inputs["kill_in_round_probability"] == 0 and not any("gradient round" in n for n in left.notes)
    # the stall window takes the samples of the stretches it covers: 10 s of a 100-sample/s stretch
    stretches = [{"from_s": 0.0, "to_s": 50.0, "peers": [0, 1], "samples": 5000.0}]
    # the window: the gradient round's 0.5 s plus half the slowest peer's 1.0 s step, of a 4 s epoch
    swarm = dataclasses.replace(fast, step_s=4.0, inputs={**fast.inputs, "grad_round_s": 0.5, "peer_step_s": [1.0, 0.8]})
    risk = kill_in_round_risk(stretches, [swarm], [(20.0, 1)], ["trainer", "trainer"], timeout_s=10.5, run_s=50.0)
    assert risk["probability"] == pytest.approx(0.25) and risk["stall_s"] == pytest.approx(10.0)
    assert risk["stall_samples"] == pytest.approx(1000.0)


def test_a_kill_can_leave_a_stale_progress_record_which_a_note_bounds_and_the_figure_leaves_out():
    """A peer killed just after it moved alone to a later epoch stalls the others until its progress
    record expires (hivemind's metadata_expiration); the cost model cannot tell whether a kill does
    that, so the note gives the epoch it would make, growing with progress_expiration_s."""
    from ddlscope.distribution.collaborative import stale_record_stall

    prof = make_profile()
    cl = make_cluster(peers=[PeerSpec(compute_share=1.0, bandwidth_gb_per_s=1.0) for _ in range(3)])

    def killed(churn, **extra):
        return predict(prof, cl, Setting("collaborative", 3, 8, epoch_samples=3200, target_batch_size=64,
                                         matchmaking_time_s=0.01,
                                         options={"churn": churn, "run_s": 200.0, **extra}))

    kill = [{"peer": 1, "kill_at_s": 30.0, "rejoin_at_s": 60.0}]
    short, long_, default = (killed(kill, progress_expiration_s=10.0), killed(kill, progress_expiration_s=40.0),
                             killed(kill))
    assert short.step_s == long_.step_s == default.step_s  # the figure leaves it out
    assert short.inputs["stale_record_stall_s"] == 10.0 and default.inputs["stale_record_stall_s"] == 60.0
    assert short.step_s < short.inputs["epoch_s_with_stale_record"] < long_.inputs["epoch_s_with_stale_record"] \
        < default.inputs["epoch_s_with_stale_record"]
    assert any("progress_expiration_s (10 s)" in n for n in short.notes)
    # a clean leave leaves no record behind it: no bound, no note
    left = killed([{"peer": 1, "leave_at_s": 30.0}])
    assert left.inputs["stale_record_stall_s"] == 0.0 and not any("progress_expiration_s" in n for n in left.notes)
    # where the prediction already has the kill stall its gradient round, the longer of the two stalls counts
    slow_cl = make_cluster(bw=1e-2, peers=[PeerSpec(compute_share=1.0, bandwidth_gb_per_s=1e-2) for _ in range(3)])
    kills = [*kill, {"peer": 2, "kill_at_s": 100.0, "rejoin_at_s": 130.0}]

    def in_round(expiration_s):
        return predict(prof, slow_cl, Setting("collaborative", 3, 8, epoch_samples=3200, target_batch_size=64,
                                              matchmaking_time_s=0.01,
                                              options={"churn": kills, "run_s": 200.0, "averaging_timeout_s": 20.0,
                                                       "progress_expiration_s": expiration_s}))
    shorter, longer = in_round(5.0), in_round(60.0)
    assert shorter.inputs["predicted_kill_in_round"] and shorter.inputs["kill_in_round_stall_s"] > 5.0
    assert shorter.inputs["stale_record_stall_s"] == 0.0 and not any("progress_expiration_s" in n for n in shorter.notes)
    assert longer.inputs["stale_record_stall_s"] == 60.0 and longer.inputs["epoch_s_with_stale_record"] > longer.step_s
    # the bound: the samples inside [kill, kill + expiration], cut at the run's end; none for an auxiliary
    # peer or one with nobody to be ahead of
    stretches = [{"from_s": 0.0, "to_s": 50.0, "peers": [0, 1], "samples": 5000.0}]
    assert stale_record_stall(stretches, [(20.0, 1)], ["trainer", "trainer"], 10.0, 50.0) == pytest.approx(1000.0)
    assert stale_record_stall(stretches, [(20.0, 1)], ["trainer", "trainer"], 100.0, 50.0) == pytest.approx(3000.0)
    assert stale_record_stall(stretches, [(20.0, 1)], ["trainer", "auxiliary"], 10.0, 50.0) == 0.0
    # two kills whose stalls overlap count the overlap once: [20, 30] and [25, 35] are 15 s
    assert stale_record_stall(stretches, [(20.0, 1), (25.0, 0)], ["trainer", "trainer"], 10.0, 50.0) \
        == pytest.approx(1500.0)
    alone = [{"from_s": 0.0, "to_s": 50.0, "peers": [1], "samples": 5000.0}]
    assert stale_record_stall(alone, [(20.0, 1)], ["trainer", "trainer"], 10.0, 50.0) == 0.0
