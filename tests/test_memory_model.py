"""The memory models (:mod:`ddlscope.modeling.memory`; each model's formula in ``ddlscope/distribution/``):
formulas, and predictions against measured peaks.

The formula tests use a hand-written profile with round numbers, so each figure can be checked
exactly. The measured tests (``slow``) profile ResNet-18 on MNIST at batch 8 and train it in real
worker processes (1 thread each, gloo) under ``single``, ``ddp``, ``fsdp`` and ``gpipe``
(``tests/memory_probe.py``), comparing each worker's measured training memory with the prediction.

How memory is measured on CPU: the workers run with ``MALLOC_MMAP_THRESHOLD_=65536`` so that
freed tensors leave the resident set at once (glibc otherwise keeps freed heap memory, and
resident memory says little about live tensors). A worker warms its runtime up (two steps of
``tiny_cnn``), reads its resident set (baseline), builds the model, trains two warm-up steps,
resets the kernel's high-water mark, trains one more step, and reports high-water mark minus
baseline: the memory training added. That is compared with the predicted ``training_bytes``
(total minus runtime) less what a worker keeps beyond its live tensors (``K``: the first steps ran
before the measured one).

Tolerance 10%: the predictions were 1-5% below these measurements when this was written (the
test prints both); the rest is resident memory no tensor accounts for (kernel code pages of this
model's layer shapes, allocator pages under 64 KiB), a few MB here, and it does not vary between
runs (no timing is involved). Leaving out a component fails it: the DDP buckets (45 MB, 21% of
the measured), the gradient
accumulation term on stage 1 (19 MB, 14%) or FSDP's gloo working copy (19 MB, 10.3%).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ddlscope.distribution.collaborative import HIVEMIND_PART_SIZE_BYTES
from ddlscope.errors import UserError
from ddlscope.modeling.memory import MemoryEstimate, predict_memory
from ddlscope.modeling.profile import DeviceProfile, LayerProfile, StepProfile, WorkloadProfile

MB = 10**6
REPO = Path(__file__).resolve().parents[1]
TOLERANCE = 0.10


def hand_profile(device_type: str = "cpu") -> WorkloadProfile:
    """Four layers with round numbers: params 1, 2, 3, 4 MB; 10 kB saved and 5 kB output per sample each."""
    layers = [LayerProfile(name=f"l{i}", param_bytes=(i + 1) * MB, forward_s=[0.01 * (i + 1)] * 2,
                           backward_s=[0.02 * (i + 1)] * 2, output_bytes_per_sample=5000,
                           saved_bytes_per_sample=10_000, forward_flops_per_sample=1e6, buffer_bytes=1000,
                           input_saved_bytes_per_sample=4000 if i == 0 else 5000) for i in range(4)]
    steps = [StepProfile(batch_size=b, forward_s=0.1 * b, backward_s=0.2 * b, optimizer_s=0.01, step_s=0.3 * b + 0.01,
                         activation_peak_bytes=50_000 * b, measured_activation_peak_bytes=60_000 * b) for b in (4, 8)]
    device = DeviceProfile(type=device_type, name="test", threads=1, peak_tflops=0.1, memory_bandwidth_gb_per_s=10,
                           memory_bytes=8 * 2**30, runtime_bytes=300 * MB)
    return WorkloadProfile(network="hand", dataset="mnist", input_shape=(1, 28, 28), num_classes=10, optimizer="sgd",
                           device=device, torch_version="x", batch_sizes=[4, 8], layers=layers, steps=steps,
                           param_count=10 * MB // 4, param_bytes=10 * MB, buffer_bytes=4000,
                           optimizer_state_bytes=10 * MB, sample_bytes=4000, profile_s=1.0, created_at=0.0)


# --------------------------------------------------------------------------- formulas


def test_single_is_the_full_replica_with_measured_activations():
    (est,) = predict_memory(hand_profile(), "single", 1, 8)
    assert (est.params_bytes, est.grads_bytes, est.optimizer_bytes) == (10 * MB + 4000, 10 * MB, 10 * MB)
    assert est.activations_bytes == 480_000  # the measured activation peak at batch 8, not the fake one
    assert est.comm_buffers_bytes == 0 and est.runtime_bytes == 300 * MB
    assert est.total_bytes == 30 * MB + 4000 + 480_000 + 300 * MB == est.training_bytes + 300 * MB
    assert predict_memory(hand_profile(), "single", 1, 6)[0].activations_bytes == 360_000  # interpolated
    dumped = json.loads(est.model_dump_json())
    assert dumped.pop("total_bytes") == est.total_bytes and MemoryEstimate.model_validate(dumped) == est


def test_ddp_adds_one_copy_of_the_gradients_on_every_worker():
    single = predict_memory(hand_profile(), "single", 1, 8)[0]
    ddp = predict_memory(hand_profile(), "ddp", 3, 8)
    assert len(ddp) == 3 and [e.worker for e in ddp] == [0, 1, 2]
    assert all(e.total_bytes - single.total_bytes == 10 * MB == e.comm_buffers_bytes for e in ddp)


def test_fsdp_shards_the_state_and_gathers_one_unit_at_a_time():
    single = predict_memory(hand_profile(), "single", 1, 8)[0]
    two, four = (predict_memory(hand_profile(), "fsdp", n, 8)[0] for n in (2, 4))
    assert two.params_bytes == 5 * MB + 4000 and two.grads_bytes == single.grads_bytes // 2  # buffers unsharded
    assert four.optimizer_bytes == single.optimizer_bytes // 4 and four.activations_bytes == single.activations_bytes
    # reshard after forward: max_l 3 p_l + 2 p_(l-1) = 3*4 + 2*3 MB; on CPU gloo's working copy adds max p_l = 4 MB
    assert two.comm_buffers_bytes == four.comm_buffers_bytes == 18 * MB + 4 * MB
    assert predict_memory(hand_profile("cuda"), "fsdp", 2, 8)[0].comm_buffers_bytes == 18 * MB
    zero2 = predict_memory(hand_profile(), "fsdp", 2, 8, reshard_after_forward=False)[0]
    assert zero2.comm_buffers_bytes == 10 * MB + 8 * MB + 4 * MB  # all units gathered + 2 p_max + gloo copy
    assert four.training_bytes < two.training_bytes < single.training_bytes + two.comm_buffers_bytes
    # what a step allocates and frees beyond its gradients and activations (P = 10 MB): per all-gather the output
    # and the unsharded parameters, in the backward the unsharded gradients and the reduce-scatter input, on CPU
    # gloo's flat copy per collective; held at no peak
    assert two.step_transient_bytes == four.step_transient_bytes == (2 * 3 + 3) * 10 * MB
    assert zero2.step_transient_bytes == (3 + 3) * 10 * MB  # one all-gather per unit
    assert predict_memory(hand_profile("cuda"), "fsdp", 2, 8)[0].step_transient_bytes == (2 * 2 + 2) * 10 * MB
    assert single.step_transient_bytes == 0 and two.total_bytes == sum(
        getattr(two, f) for f in ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes",
                                  "comm_buffers_bytes", "runtime_bytes"))  # no retained heap measured


def test_pipelines_hold_micro_batches_in_flight():
    p = hand_profile()
    gpipe = predict_memory(p, "gpipe", 2, 8, microbatches=4, stage_bounds=[0, 2, 4])
    f1b = predict_memory(p, "1f1b", 2, 8, microbatches=4, stage_bounds=[0, 2, 4])
    assert [e.worker for e in gpipe] == [0, 1]
    # own gradients (layers 0-1: 3 MB, 2-3: 7 MB) + the largest layer's while accumulating micro-batches
    assert [e.grads_bytes for e in gpipe] == [3 * MB + 2 * MB, 7 * MB + 4 * MB]
    assert [e.optimizer_bytes for e in gpipe] == [3 * MB, 7 * MB]
    # each stage keeps only its own layers' parameters and buffers (the strategy frees the others)
    bufs = [sum(layer.buffer_bytes for layer in p.layers[a:b]) for a, b in ((0, 2), (2, 4))]
    assert [e.params_bytes for e in gpipe] == [3 * MB + bufs[0], 7 * MB + bufs[1]]
    # GPipe keeps all 4 micro-batches of 2 samples in flight on both stages; 1F1B 2 on the first, 1 on the last
    assert gpipe[0].activations_bytes > f1b[0].activations_bytes > f1b[1].activations_bytes
    per_mb_stage0 = 2 * (10_000 + 10_000 - 4000 + 5000)  # saved - the batch slice + output only the next stage saves
    assert gpipe[0].activations_bytes - f1b[0].activations_bytes == 2 * per_mb_stage0
    per_mb_stage1 = 2 * (10_000 + 10_000 - 5000)  # the received input is a receive buffer
    assert gpipe[1].activations_bytes - f1b[1].activations_bytes == 3 * per_mb_stage1
    # receive buffers: activations into stage 1, gradients into stage 0, one per micro-batch
    assert gpipe[0].comm_buffers_bytes == gpipe[1].comm_buffers_bytes == 4 * 2 * 5000
    one = predict_memory(p, "gpipe", 2, 8, microbatches=1, stage_bounds=[0, 2, 4])
    assert [e.grads_bytes for e in one] == [3 * MB, 7 * MB]  # no accumulation with one micro-batch


def test_pipeline_default_bounds_balance_the_profiled_times():
    est = predict_memory(hand_profile(), "1f1b", 2, 8, microbatches=2)
    # layer times 1:2:3:4 -> stages [l0, l1, l2] (6) and [l3] (4)
    assert est[0].notes.startswith("stage 0: layers 0..2") and est[1].notes.startswith("stage 1: layers 3..3")


def test_a_cpu_profile_s_retained_heap_is_a_share_of_what_each_worker_s_steps_allocate_and_free():
    prof = hand_profile()
    assert prof.retained_share() is None  # not measured: no term, not 0 bytes
    assert all(e.retained_bytes is None for e in predict_memory(prof, "gpipe", 2, 8, microbatches=4))
    # measured at batch 8: 5.24 MB kept beyond the live step, half of P + A(8) = 10 MB + 0.48 MB
    prof.steps[-1].retained_bytes = 5_240_000
    assert prof.retained_share() == pytest.approx(0.5)
    (single,) = predict_memory(prof, "single", 1, 8)
    assert single.retained_bytes == round(0.5 * (10 * MB + 480_000))
    assert single.total_bytes == 30 * MB + 4000 + 480_000 + single.retained_bytes + 300 * MB
    for stage in predict_memory(prof, "gpipe", 2, 8, microbatches=4):  # each stage: its own gradients and activations
        assert stage.retained_bytes == round(0.5 * (stage.grads_bytes + stage.activations_bytes)) > 0
    # an fsdp worker's steps also allocate and free the gathered units: the heap keeps the same share of them
    (fsdp, _) = predict_memory(prof, "fsdp", 2, 8)
    assert fsdp.step_transient_bytes == 90 * MB
    assert fsdp.retained_bytes == round(0.5 * (5 * MB + 480_000 + 90 * MB))


def test_a_cpu_profile_measured_at_two_batches_separates_what_every_process_keeps_whatever_the_batch():
    prof = hand_profile()
    small, large = prof.steps[0], prof.steps[-1]
    moved_small, moved_large = prof.param_bytes + small.activation_bytes, prof.param_bytes + large.activation_bytes
    assert moved_large > moved_small
    # F = 20 MB per process plus k = 0.25 of what the steps allocate and free
    small.retained_bytes = round(20 * MB + 0.25 * moved_small)
    large.retained_bytes = round(20 * MB + 0.25 * moved_large)
    fixed, share = prof.retained_fit()
    assert fixed == pytest.approx(20 * MB, abs=2) and share == pytest.approx(0.25)
    assert prof.first_training_bytes() == pytest.approx(20 * MB, abs=2)
    (single,) = predict_memory(prof, "single", 1, 8)
    assert single.first_training_bytes == prof.first_training_bytes()
    assert single.retained_bytes == round(0.25 * (single.grads_bytes + single.activations_bytes))
    assert single.total_bytes == (single.params_bytes + single.grads_bytes + single.optimizer_bytes
                                  + single.activations_bytes + single.retained_bytes + single.first_training_bytes
                                  + 300 * MB)
    stages = predict_memory(prof, "gpipe", 2, 8, microbatches=4)
    assert all(s.first_training_bytes == prof.first_training_bytes() for s in stages)  # once per process, not split
    # growth that is not larger at the larger batch: no share of the steps, all of it per process
    small.retained_bytes = large.retained_bytes = 30 * MB
    assert prof.retained_fit() == (pytest.approx(30 * MB), 0.0)
    # a fit whose per-process part would be negative: not separated, the share at the largest batch
    small.retained_bytes, large.retained_bytes = 0, 10 * MB
    assert prof.first_training_bytes() is None and prof.retained_share() == pytest.approx(10 * MB / moved_large)
    assert predict_memory(prof, "single", 1, 8)[0].first_training_bytes is None


def test_collaborative_adds_hivemind_buffers():
    single = predict_memory(hand_profile(), "single", 1, 8)[0]
    grads, lu = (predict_memory(hand_profile(), "collaborative", 2, 8, use_local_updates=u)[0] for u in (False, True))
    work = 4 * MB + HIVEMIND_PART_SIZE_BYTES
    assert grads.comm_buffers_bytes == 10 * MB + 2 * 10 * MB + work  # parameter copy, accumulators, averaged grads
    assert lu.comm_buffers_bytes == 2 * 10 * MB + work  # parameter copy and the delta rule's old copy
    assert grads.total_bytes - single.total_bytes == grads.comm_buffers_bytes
    # a peer imports hivemind: its runtime holds what the profile measured that import adds
    prof = hand_profile()
    prof.device.hivemind_runtime_bytes = 53 * MB
    peer = predict_memory(prof, "collaborative", 2, 8)[0]
    assert peer.runtime_bytes == 300 * MB + 53 * MB and predict_memory(prof, "ddp", 2, 8)[0].runtime_bytes == 300 * MB


@pytest.mark.parametrize("args, kwargs, words", [
    (("nope", 2, 8), {}, ["unknown distribution model 'nope'", "fsdp"]),
    (("single", 2, 8), {}, ["workers = 2", "workers = 1"]),
    (("ddp", 0, 8), {}, ["workers = 0"]),
    (("ddp", 2, 0), {}, ["batch_size = 0"]),
    (("gpipe", 5, 8), {}, ["5 stages", "4 top-level layers"]),
    (("gpipe", 2, 8), {"microbatches": 9}, ["microbatches = 9", "1..batch_size"]),
    (("gpipe", 2, 8), {"stage_bounds": [0, 4, 4]}, ["stage_bounds [0, 4, 4]", "strictly increasing"]),
])
def test_bad_input_is_a_user_error(args, kwargs, words):
    with pytest.raises(UserError) as err:
        predict_memory(hand_profile(), *args, **kwargs)
    assert all(w in str(err.value) for w in words)


def test_training_peak_rss_reset_keeps_the_lifetime_peak():
    import torch

    from ddlscope.measure.memory import peak_memory_bytes, peak_rss_bytes, reset_peak_rss, rss_bytes

    big = torch.ones(50 * MB // 4)  # touched: 50 MB resident
    del big
    lifetime = peak_memory_bytes(torch.device("cpu"))
    assert reset_peak_rss()
    assert peak_rss_bytes() < lifetime  # the high-water mark starts again from the resident set
    assert peak_memory_bytes(torch.device("cpu")) >= lifetime
    base = rss_bytes()
    big = torch.ones(50 * MB // 4)
    assert peak_rss_bytes() - base >= 45 * MB
    del big


# --------------------------------------------------------------------------- against measurements

NETWORK, DATASET, BATCH = "resnet18", "mnist", 8


@pytest.fixture(scope="module")
def resnet_profile(tmp_path_factory):
    from ddlscope.profiling.profile import profile_workload

    return profile_workload(NETWORK, DATASET, BATCH, threads=1, loader_workers=(),
                            cache_root=tmp_path_factory.mktemp("cache"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_workers(strategy: str, workers: int, extra: dict | None = None) -> list[dict]:
    """Run ``tests/memory_probe.py`` as ``workers`` processes (gloo, 1 thread each); their reports by rank."""
    args = dict(strategy=strategy, workers=workers, network=NETWORK, dataset=DATASET, family="mnist",
                batch_size=BATCH, **(extra or {}))
    port = _free_port()
    procs = []
    for rank in range(workers):
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1", RANK=str(rank),
                   LOCAL_RANK=str(rank), WORLD_SIZE=str(workers), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, str(REPO / "tests" / "memory_probe.py"), json.dumps(args)],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO))
    reports = []
    for proc in procs:
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err[-2000:]
        reports.append(json.loads(out.strip().splitlines()[-1]))
    return sorted(reports, key=lambda r: r["rank"])


@pytest.mark.slow
def test_profiled_activations_match_a_real_step(resnet_profile):
    """The fake-tensor activation peak agrees with the one measured on real tensors (same definition).

    Within 10 % plus 1 MB: the measured step also counts heap pages that no tensor accounts for
    (autograd's and the kernels' own buffers, allocations under the 64 KiB mmap threshold), and how
    many of them a step touches anew depends on which freed chunks are still resident. At batch 2
    (fake 4.6 MB) nine profiles on the 2-core CI machine read 4.0-5.0 MB (2026-12-03), a spread
    that 15 % alone did not cover; at batch 8 the fakes were 5-6 % (1.2-1.4 MB) below. Batch 1
    (fake 2.0 MB, measured 3.0-3.5 MB) is left out: the pages not seen dominate it.
    """
    for step in resnet_profile.steps[1:]:
        fake, real = step.activation_peak_bytes, step.measured_activation_peak_bytes
        assert real is not None and abs(fake - real) <= 0.10 * real + MB, (step.batch_size, fake, real)


@pytest.mark.slow
@pytest.mark.parametrize("strategy, workers, extra, kwargs", [
    ("single", 1, None, {}),
    ("ddp", 2, None, {}),
    ("fsdp", 2, None, {}),
    ("gpipe", 2, {"distributed": {"microbatches": 4}}, {"microbatches": 4}),
])
def test_predicted_training_memory_matches_the_measured_peak(resnet_profile, strategy, workers, extra, kwargs):
    reports = measure_workers(strategy, workers, extra)
    bounds = reports[0]["details"].get("stage_bounds")  # the partition the pipeline measured and used
    predicted = predict_memory(resnet_profile, strategy, workers, BATCH, stage_bounds=bounds, **kwargs)
    for est, rep in zip(predicted, reports):
        measured = rep["training_bytes"]
        # these workers keep no freed heap memory, and their first steps ran before the measured ones
        live = est.training_bytes - (est.retained_bytes or 0) - (est.first_training_bytes or 0)
        print(f"{strategy} worker {est.worker}: predicted {live / MB:.1f} MB live "
              f"(+ runtime {est.runtime_bytes / MB:.0f}), measured {measured / MB:.1f} MB "
              f"(+ baseline {rep['baseline_bytes'] / MB:.0f}); {est.notes}")
        assert abs(live - measured) <= TOLERANCE * measured, (est, rep)
