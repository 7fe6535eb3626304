"""ddlscope's CUDA paths on a real GPU: the event clock, a measured run's phases and memory split,
and the profile's fit search. Skipped where torch sees no CUDA GPU (the CPU parts of these paths
have their own tests: test_timeline, test_memory_split, test_profile_fit)."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_event_clock_times_device_work_that_the_host_does_not_wait_for():
    from ddlscope.measure.timeline import CudaEventClock

    clock, device = CudaEventClock("cuda:0"), torch.device("cuda:0")
    a = torch.randn(4096, 4096, device=device)
    torch.cuda.synchronize(device)
    host_start = time.perf_counter()
    start = clock.mark()
    for _ in range(20):
        a = a @ a / 64.0
    end = clock.mark()
    queued_s = time.perf_counter() - host_start  # the host only queued the kernels
    clock.wait(end)
    host_s = time.perf_counter() - host_start
    device_s = clock.seconds_between(start, end)
    assert clock.reached(end)
    assert 0 < device_s <= host_s * 1.02
    assert device_s > 0.5 * host_s, (device_s, host_s)  # the device's time, not the queueing's
    assert queued_s < host_s


def test_a_single_run_on_cuda_stores_its_phases_and_its_memory_split(tmp_path):
    from ddlscope.config import available_cores, validate_config
    from ddlscope.store.db import ResultsStore
    from ddlscope.strategies import WorkerContext
    from ddlscope.train.loop import run_worker

    cfg = validate_config(dict(model="tiny_cnn", dataset="digits", batch_size=32, device="cuda", sample_budget=20 * 32,
                               warmup_steps=3, final_eval=False))
    with ResultsStore(tmp_path / "r.db") as store:
        run_id = store.create_run("cuda", "single", cfg.model_dump(mode="json"))
        ctx = WorkerContext(run_id=run_id, worker_index=0, num_workers=1, cores=available_cores(), initial_peers=[])
        store.upsert_worker(run_id, 0, status="starting")
        run_worker(cfg, ctx, store)
        steps = [dict(s) for s in store.rows("steps", run_id)]
        memory = [json.loads(e["detail_json"]) for e in store.rows("events", run_id) if e["kind"] == "memory"]
    assert [s["step"] for s in steps] == list(range(20))
    for s in steps:
        parts = [s["data_load_s"], s["forward_s"], s["backward_s"], s["optimizer_s"]]
        assert all(p is not None and math.isfinite(p) and p >= 0 for p in parts), s
        assert s["forward_s"] > 0 and s["backward_s"] > 0
        assert sum(parts) <= s["step_s"] * 1.05 + 1e-4, s  # the phases lie inside the step
    assert memory and memory[0]["allocator_peak_bytes"] > 0
    assert memory[0]["runtime_bytes"] > 50 * 2**20  # a CUDA context holds hundreds of MiB


def test_profile_fit_search_measures_the_largest_batch_that_fits_a_cap_and_extrapolates(tmp_path):
    from ddlscope.profiling.profile import load_or_profile

    prof = load_or_profile("resnet18", "cifar10", 512, device="cuda", cache_dir=tmp_path, loader_workers=(0,),
                           memory_limit_bytes=600 * 2**20)
    assert prof.largest_fitting_batch_size is not None and prof.largest_fitting_batch_size < 512
    assert max(prof.measured_batch_sizes) == prof.largest_fitting_batch_size
    assert prof.step_at(512).extrapolated and prof.fit_note()
    # launch-bound small batches give a flat line on a GPU: the extrapolation never falls below the largest run
    assert prof.step_at(512).step_s >= prof.step_at(prof.largest_fitting_batch_size).step_s


def test_step_values_reach_the_host_without_waiting_for_the_work_queued_after_them():
    from ddlscope.measure.step_values import DeviceValues, ValuesInFlight

    device = torch.device("cuda:0")
    logits = torch.tensor([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7]], device=device) * 2
    flight = ValuesInFlight([DeviceValues.of(torch.tensor(1.5, device=device) * 2, logits,
                                             torch.tensor([1, 1, 1], device=device))])
    a = torch.randn(8192, 8192, device=device)
    for _ in range(10):  # about 0.2 s of work queued after the copy
        a = a @ a / 8192.0
    later = torch.cuda.Event()
    later.record()
    assert flight.read() == [(3.0, 2.0, 3.0)]
    assert not later.query()  # the host has its values while the device still works on what came after
    assert all(host.is_pinned() for _, host in flight._parts)
    torch.cuda.synchronize(device)
