"""Predicted peak memory split as a measurement sees it (allocator part, runtime part) and the
measured split read from a run's memory events (issue 16, item 4)."""

from __future__ import annotations

import pytest
import torch

from ddlscope.experiments.results import memory_split
from ddlscope.measure import memory as mem
from ddlscope.modeling.memory import peak_split_bytes, setting_memory
from ddlscope.modeling.prediction import Setting
from ddlscope.predict.validation_report import StrategyOutcome, ValidationCell, summarize
from ddlscope.store.db import ResultsStore

from test_costs import make_profile


def test_the_split_is_the_largest_workers_training_and_runtime_parts():
    prof = make_profile()
    for s in (Setting("single", 1, 8, epoch_samples=64), Setting("ddp", 2, 8, epoch_samples=64),
              Setting("gpipe", 2, 16, epoch_samples=64, microbatches=4)):
        allocator, runtime = peak_split_bytes(prof, s)
        top = max(setting_memory(prof, s), key=lambda e: e.total_bytes)
        assert (allocator, runtime) == (top.training_bytes, top.runtime_bytes)
        assert runtime == prof.device.runtime_bytes and allocator > 0


def test_the_measured_split_comes_from_the_memory_events(tmp_path):
    with ResultsStore(tmp_path / "r.db") as store:
        run = store.create_run("x", "ddp", {"strategy": "ddp"})
        assert memory_split(store, run) == (None, None)  # nothing recorded: unknown, not 0
        # CPU workers stored before 2026-12-04: the resident peak during training less the resident set at its start
        store.add_event(run, 0, "memory", rss_at_train_start_bytes=400, train_peak_rss_bytes=1000)
        store.add_event(run, 1, "memory", rss_at_train_start_bytes=300, train_peak_rss_bytes=1200)
        assert memory_split(store, run) == (900, 300)  # worker 1 allocated more
        # since: less the resident set before the model existed (the model is part of what training added)
        store.add_event(run, 3, "memory", rss_at_train_start_bytes=400, train_peak_rss_bytes=1400,
                        rss_before_model_bytes=250)
        assert memory_split(store, run) == (1150, 250)
        # a GPU worker records the allocator's peak and the runtime directly
        store.add_event(run, 2, "memory", allocator_peak_bytes=5000, runtime_bytes=700)
        assert memory_split(store, run) == (5000, 700)


def test_the_resident_set_without_the_model_leaves_out_its_parameters_and_buffers(monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(100, 50), torch.nn.BatchNorm1d(50))  # 5,050 + 100 parameters, 101 buffers
    monkeypatch.setattr(mem, "rss_bytes", lambda: 10**6)
    assert mem.rss_without_model_bytes(model) == 10**6 - 4 * (5050 + 100) - (4 * 100 + 8)
    monkeypatch.setattr(mem, "rss_bytes", lambda: None)
    assert mem.rss_without_model_bytes(model) is None  # no /proc: unknown


def test_outcomes_compare_each_part_with_its_measurement():
    o = StrategyOutcome(strategy="single", predicted_epoch_s=10.0, predicted_memory_bytes=1500, fits=True,
                        measured_epoch_s=10.0, status="completed", predicted_allocator_bytes=1000,
                        predicted_runtime_bytes=500, measured_allocator_bytes=800, measured_runtime_bytes=500)
    assert o.memory_error == pytest.approx(0.25) and o.runtime_memory_error == pytest.approx(0.0)
    unmeasured = StrategyOutcome(strategy="ddp", predicted_epoch_s=5.0, predicted_memory_bytes=1500, fits=True,
                                 measured_epoch_s=5.0, status="completed", predicted_allocator_bytes=1000)
    assert unmeasured.memory_error is None
    summary = summarize([ValidationCell(dataset="mnist", network="n", workers=2, outcomes=[o, unmeasured])])
    assert summary.per_model_memory["single"].median_abs_error == pytest.approx(0.25)
    assert summary.per_model_memory["ddp"].count == 0
    assert summary.per_model_runtime_memory["single"].median_abs_error == pytest.approx(0.0)


def test_cuda_runtime_is_the_device_memory_beyond_the_allocators(monkeypatch):
    assert mem.cuda_runtime_bytes(torch.device("cpu")) is None
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 9 * 2**30)
    assert mem.cuda_runtime_bytes(torch.device("cuda", 0)) == 2**30
