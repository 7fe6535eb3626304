"""``ddlscope profile``: the measured workload profile, its cache and its command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import time

import pytest
import torch

from ddlscope import distribution
from ddlscope.errors import UserError
from ddlscope.measure.timeline import HostClock
from ddlscope.modeling.prediction import Setting
from ddlscope.modeling.profile import OptimizerSetting, WorkloadProfile, interpolate
from ddlscope.profiling import profile as prof
from ddlscope.profiling.profile import (
    load_or_profile,
    profile_batch_sizes,
    profile_cache_key,
    profile_path,
)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(data_root, tmp_path_factory):
    """A real profile of tiny_cnn on MNIST at batch 8 (about 10 s), measured through the cache;
    torch's thread count is 2 around the call, to see that profiling restores it."""
    cache = tmp_path_factory.mktemp("profiles")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        p = load_or_profile("tiny_cnn", "mnist", 8, threads=1, loader_workers=(0, 1), data_root=data_root,
                            cache_dir=cache)
        threads_after = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    return p, cache, threads_after


def test_batch_sizes_are_the_batch_and_its_halvings():
    assert profile_batch_sizes(32) == [4, 8, 16, 32]
    assert profile_batch_sizes(8) == [1, 2, 4, 8]
    assert profile_batch_sizes(3) == [1, 3]
    assert profile_batch_sizes(1) == [1]


def test_tiny_profile_measures_every_layer_at_every_batch_size(tiny):
    p, _, threads_after = tiny
    assert threads_after == 2  # restored after profiling with 1 thread
    assert p.batch_sizes == [1, 2, 4, 8] and [s.batch_size for s in p.steps] == p.batch_sizes
    assert [layer.name for layer in p.layers] == ["conv1", "conv2", "pool", "classifier"]
    for layer in p.layers:
        assert len(layer.forward_s) == len(layer.backward_s) == 4
        assert all(t > 0 for t in layer.forward_s + layer.backward_s)
    # tiny_cnn on 1x28x28: conv1 3x3x1 -> 8 channels (80 params), conv2 3x3x8 -> 16 (1168), linear 256 -> 10 (2570)
    assert p.param_count == 80 + 1168 + 2570 and p.param_bytes == 4 * p.param_count
    assert [layer.param_bytes for layer in p.layers] == [320, 4672, 0, 10280]
    assert p.optimizer_state_bytes == p.param_bytes  # SGD momentum: one buffer per parameter
    assert p.optimizer == "sgd" and p.optimizer_setting == OptimizerSetting(name="sgd", learning_rate=0.01, momentum=0.9,
                                                                            weight_decay=0.0)
    assert p.buffer_bytes == 0 and p.sample_bytes == 28 * 28 * 4 and p.input_shape == (1, 28, 28)
    conv1, conv2, pool, fc = p.layers
    assert conv1.output_bytes_per_sample == 8 * 28 * 28 * 4 and conv2.output_bytes_per_sample == 16 * 14 * 14 * 4
    # conv1 saves its input (the batch) and ReLU its output; the pool saves nothing, the linear layer its input
    assert conv1.input_saved_bytes_per_sample == 28 * 28 * 4
    assert conv1.saved_bytes_per_sample == 28 * 28 * 4 + 8 * 28 * 28 * 4
    assert pool.saved_bytes_per_sample == 0 and fc.input_saved_bytes_per_sample == fc.saved_bytes_per_sample == 256 * 4
    assert conv1.forward_flops_per_sample == 2 * 9 * 8 * 28 * 28  # multiply-adds of the convolution, x2
    for s in p.steps:
        assert s.step_s == pytest.approx(s.forward_s + s.backward_s + s.optimizer_s)
        assert s.measured_activation_peak_bytes is not None
    # what a worker keeps beyond its live tensors: measured at the smallest and the largest batch (in fresh
    # processes), unknown elsewhere
    assert [s.retained_bytes is None for s in p.steps] == [False, True, True, False]
    assert p.retained_share() is not None and p.retained_share() >= 0
    fake = [s.activation_peak_bytes for s in p.steps]
    assert fake == sorted(fake) and fake[-1] > fake[0] > 0
    assert [d.loader_workers for d in p.data_loading] == [0, 1] and all(d.samples_per_s > 0 for d in p.data_loading)
    dev = p.device
    assert dev.type == "cpu" and dev.threads == 1 and dev.peak_tflops > 0 and dev.memory_bandwidth_gb_per_s > 0
    assert 0 < dev.memory_bytes and dev.runtime_bytes > 50 * 2**20  # an interpreter with torch loaded
    assert dev.hivemind_runtime_bytes > 10 * 2**20  # what importing hivemind adds (53 MiB, 2026-12-04)
    assert p.torch_version == torch.__version__ and p.profile_s > 0


def test_interpolation_between_measured_batch_sizes(tiny):
    p, _, _ = tiny
    s2, s4 = p.steps[1], p.steps[2]
    mid = p.step_at(3)
    assert mid.step_s == pytest.approx((s2.step_s + s4.step_s) / 2)
    assert mid.activation_peak_bytes == pytest.approx((s2.activation_peak_bytes + s4.activation_peak_bytes) / 2, abs=1)
    fwd, bwd = p.layer_times_s(3)  # per-layer times rescaled to the whole step's
    assert sum(fwd) == pytest.approx(mid.forward_s) and sum(bwd) == pytest.approx(mid.backward_s)
    assert interpolate([2.0], [4.0], 3.0) == 6.0  # one point: proportional
    assert interpolate([1.0, 2.0], [1.0, 3.0], 4.0) == 7.0  # extended linearly
    assert interpolate([1.0, 2.0], [3.0, 1.0], 10.0) == 0.0  # never below zero


def test_cache_hit_refresh_and_corrupt_file(tiny, tmp_path, monkeypatch):
    p, _, _ = tiny
    calls = []

    def fake_measure(*args, **kwargs):
        calls.append(args)
        return p

    monkeypatch.setattr(prof, "profile_workload", fake_measure)
    args = ("tiny_cnn", "mnist", 8)
    first = load_or_profile(*args, cache_dir=tmp_path)
    path = profile_path(*args, cache_dir=tmp_path)
    assert len(calls) == 1 and path.is_file() and first == p
    assert load_or_profile(*args, cache_dir=tmp_path) == p and len(calls) == 1  # hit
    load_or_profile(*args, cache_dir=tmp_path, refresh=True)
    assert len(calls) == 2
    path.write_text('{"network": "tiny_cnn", "truncated')  # e.g. an interrupted copy
    assert load_or_profile(*args, cache_dir=tmp_path) == p and len(calls) == 3
    assert WorkloadProfile.model_validate_json(path.read_text()) == p  # replaced by a valid one
    assert [f.name for f in tmp_path.iterdir()] == [path.name]  # no temporary files left


def test_cache_key_names_everything_that_changes_a_profile():
    key = profile_cache_key("resnet18", "cifar10", 32, "cpu", 1, (0, 1))
    assert key == profile_cache_key("resnet18", "cifar10", 32, "cpu", 1, (1, 0))
    assert key.startswith("resnet18_cifar10_bs32_cpu_t1_sgd_")
    # a name means the run config's default hyperparameters
    assert key == profile_cache_key("resnet18", "cifar10", 32, "cpu", 1, (0, 1), prof.optimizer_setting("sgd"))
    plain_sgd = OptimizerSetting(name="sgd", learning_rate=0.01, momentum=0.0, weight_decay=0.0)
    others = [profile_cache_key("resnet18", "cifar10", 16, "cpu", 1, (0, 1)),
              profile_cache_key("resnet18", "cifar10", 32, "cpu", 2, (0, 1)),
              profile_cache_key("resnet18", "mnist", 32, "cpu", 1, (0, 1)),
              profile_cache_key("resnet18", "cifar10", 32, "cpu", 1, (0,)),
              profile_cache_key("resnet18", "cifar10", 32, "cpu", 1, (0, 1), "adam"),
              profile_cache_key("resnet18", "cifar10", 32, "cpu", 1, (0, 1), plain_sgd)]
    assert len({key, *others}) == 7
    assert others[-2].startswith("resnet18_cifar10_bs32_cpu_t1_adam_")


@pytest.fixture(scope="module")
def adam():
    """A profile of tiny_cnn trained with Adam at batch 2 (no data loading measured)."""
    return prof.profile_workload("tiny_cnn", "mnist", 2, loader_workers=(), optimizer="adam")


def test_profile_records_the_optimizer_and_measures_its_state(adam, tiny):
    sgd, _, _ = tiny
    assert adam.optimizer == "adam" and adam.optimizer_setting.name == "adam" and adam.data_loading == []
    assert adam.param_bytes == sgd.param_bytes
    # Adam: two moments per parameter, plus a float32 step count per parameter tensor (tiny_cnn has 6)
    assert adam.optimizer_state_bytes == 2 * adam.param_bytes + 4 * 6
    # plain SGD keeps no state; SGD with momentum one buffer per parameter (as the tiny profile measured)
    for momentum, state_bytes in ((0.0, 0), (0.9, sgd.param_bytes)):
        setting = OptimizerSetting(name="sgd", learning_rate=0.01, momentum=momentum, weight_decay=0.0)
        assert prof._fake_analysis("tiny_cnn", "mnist", [2], setting)["optimizer_state_bytes"] == state_bytes


@pytest.mark.parametrize("model, workers", [("single", 1), ("ddp", 2)])
def test_memory_estimate_charges_the_profiled_optimizers_state(adam, tiny, model, workers):
    sgd, _, _ = tiny
    setting = Setting(strategy=model, workers=workers, batch_size=2, epoch_samples=1000)
    by_optimizer = {p.optimizer: distribution.get(model).memory_model(p, setting)[0] for p in (adam, sgd)}
    assert by_optimizer["adam"].optimizer_bytes == adam.optimizer_state_bytes
    assert by_optimizer["sgd"].optimizer_bytes == sgd.optimizer_state_bytes
    assert by_optimizer["adam"].optimizer_bytes - by_optimizer["sgd"].optimizer_bytes == sgd.param_bytes + 4 * 6


def test_unknown_optimizer_is_a_user_error(tiny):
    with pytest.raises(UserError, match="unknown optimizer 'lamb'; allowed: sgd, adam, adamw"):
        prof.profile_workload("tiny_cnn", "mnist", 2, loader_workers=(), optimizer="lamb")
    fields = tiny[0].model_dump() | {"optimizer_setting": prof.optimizer_setting("adam").model_dump()}
    with pytest.raises(ValueError, match="optimizer 'sgd' but optimizer_setting names 'adam'"):
        WorkloadProfile.model_validate(fields)


@pytest.mark.parametrize("kwargs, words", [
    (dict(network="resnet19"), ["unknown network 'resnet19'", "resnet18", "tiny_cnn"]),
    (dict(dataset="svhn"), ["unknown dataset 'svhn'", "cifar10", "digits"]),
    (dict(threads=0), ["threads 0", ">= 1"]),
    (dict(batch_size=0), ["batch size 0", ">= 1"]),
    (dict(loader_workers=(-1,)), ["loader workers", ">= 0"]),
])
def test_bad_input_is_a_user_error(kwargs, words):
    args = dict(network="tiny_cnn", dataset="mnist", batch_size=8) | kwargs
    with pytest.raises(UserError) as err:
        prof.profile_workload(**args)
    assert all(w in str(err.value) for w in words)


def test_data_loading_without_a_local_copy_writes_a_synthetic_one(tmp_path):
    rates = prof._measure_data_loading("cifar10", 8, (0,), tmp_path / "empty", tmp_path / "cache")
    assert [r.loader_workers for r in rates] == [0] and rates[0].samples_per_s > 0
    assert (tmp_path / "cache" / "cifar10").is_dir() and not (tmp_path / "empty").exists()


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ddlscope", "profile", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=120)


def test_cli_prints_the_cached_profile(tiny):
    p, cache, _ = tiny
    common = ["--model", "tiny_cnn", "--dataset", "mnist", "--batch-size", "8", "--loader-workers", "0,1",
              "--cache-dir", str(cache)]
    out = _cli(*common, "--json")
    assert out.returncode == 0, out.stderr
    assert WorkloadProfile.model_validate(json.loads(out.stdout)) == p  # the cache hit, JSON only
    table = _cli(*common)
    assert table.returncode == 0, table.stderr
    assert "conv1" in table.stdout and "classifier" in table.stdout and "samples/s" in table.stdout
    assert str(profile_path("tiny_cnn", "mnist", 8, cache_dir=cache)) in table.stdout.replace("\n", "")


@pytest.mark.parametrize("args, words", [
    (["--model", "nope", "--dataset", "mnist", "--batch-size", "8"], ["unknown network 'nope'", "resnet18"]),
    (["--model", "tiny_cnn", "--dataset", "mnist", "--batch-size", "8", "--threads", "0"], ["threads 0"]),
    (["--model", "tiny_cnn", "--dataset", "mnist", "--batch-size", "8", "--loader-workers", "x"], ["--loader-workers"]),
    (["--model", "tiny_cnn", "--dataset", "mnist", "--batch-size", "8", "--optimizer", "lamb"],
     ["unknown optimizer 'lamb'", "sgd, adam, adamw"]),
])
def test_cli_bad_input_is_one_error_line(args, words):
    out = _cli(*args)
    assert out.returncode == 2 and out.stderr.startswith("error:") and "Traceback" not in out.stderr
    assert all(w in out.stderr for w in words)


class _TickClock(HostClock):
    """A host clock whose every mark is ``tick_s`` after the previous one (a Stopwatch's lap reads one tick)."""

    def __init__(self, tick_s: float):
        self.tick_s, self.now = tick_s, 0.0

    def mark(self) -> float:
        self.now += self.tick_s
        return self.now


def _counted_steps(timing, tick_s: float) -> tuple[int, int]:
    """(forward passes, timed steps) of ``_time_steps`` on a tiny network whose laps each read ``tick_s``."""
    from ddlscope.measure.timeline import Stopwatch

    calls = []
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 3))
    model.register_forward_hook(lambda *_: calls.append(1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(2, 4), torch.tensor([0, 2])
    f, b, o, timed = prof._time_steps(model, optimizer, x, y, timing, Stopwatch(clock=_TickClock(tick_s)))
    assert (f, b, o) == pytest.approx((tick_s, tick_s, tick_s))
    return len(calls), timed


def test_step_timing_warms_up_and_times_for_its_windows_with_a_cap():
    from ddlscope.profiling.profile import STEP_TIMING, StepTiming

    # a step reads 3 ticks of 0.01 s: 0.5 s of warm-up is 17 steps, 2 s of timed steps 67
    timing = StepTiming(warmup_steps=2, warmup_s=0.5, timed_steps=5, window_s=2.0, max_timed_steps=100)
    assert _counted_steps(timing, 0.01) == (17 + 67, 67)
    assert _counted_steps(timing, 1.0) == (2 + 5, 5)  # long steps: the counts bound it
    capped = StepTiming(warmup_steps=1, warmup_s=0.0, timed_steps=5, window_s=2.0, max_timed_steps=10)
    assert _counted_steps(capped, 0.01) == (1 + 10, 10)
    assert _counted_steps(STEP_TIMING["cpu"], 0.01) == (1 + 5, 5)  # CPU: one warm-up, five timed
    cuda = STEP_TIMING["cuda"]  # GPU milliseconds: windows of seconds, not a handful of steps
    assert cuda.warmup_s >= 0.5 and cuda.window_s >= 1.0 and cuda.max_timed_steps >= 100


def test_the_memory_probe_runs_on_the_cores_the_profile_leaves():
    assert prof.spare_cores({0, 1}, 1) == [1]
    assert prof.spare_cores({3, 1, 2, 0}, 2) == [2, 3]
    assert prof.spare_cores({5}, 1) == [5]  # none left: it shares the profile's


def test_a_failing_memory_probe_says_why_and_a_cancelled_one_ends():
    sgd = prof.optimizer_setting("sgd")
    with pytest.raises(RuntimeError, match=r"the memory probe process failed \(exit 1\): .*no_such_network"):
        prof.CpuMemoryProbe("no_such_network", "mnist", 1, sgd).result([1])
    probe = prof.CpuMemoryProbe("tiny_cnn", "mnist", 1, sgd)
    probe.cancel()  # at once: it is still importing torch
    assert probe._process.returncode is not None
    probe.cancel()  # twice: nothing more


def test_a_growth_process_that_fails_measures_nothing_and_a_cancelled_one_ends():
    sgd = prof.optimizer_setting("sgd")
    failing = prof._GrowthProcesses("no_such_network", "mnist", [1, 2], sgd, 1, 1, None)
    assert failing.result() is None  # both processes failed: unknown, not 0 bytes
    growth = prof._GrowthProcesses("tiny_cnn", "mnist", [1, 8], sgd, 1, 1, None)
    time.sleep(0.5)
    child = growth._current
    growth.cancel()  # while the first one imports torch
    assert child is not None and child.returncode is not None and growth.result() is None


def test_cpu_steps_are_timed_in_a_fresh_process_per_batch_size():
    """As a run's worker trains at one batch size in a process of its own: each batch size's steps in a child
    of a clean process, one after the other, pinned to the cores asked for."""
    sgd = prof.optimizer_setting("sgd")
    timer = prof.FreshStepTimer("tiny_cnn", "mnist", 1, sgd, [0])
    times = timer.result([2, 4], [0])
    assert sorted(times) == [2, 4]
    assert all(f > 0 and b > 0 and o > 0 and n == prof.STEP_TIMING["cpu"].timed_steps for f, b, o, n in times.values())
    assert len(set(timer.child_pids)) == 2 and timer._process.pid not in timer.child_pids
    assert timer._process.returncode == 0
    timer.cancel()  # ended already: nothing more


def test_a_failing_step_timer_says_why_and_a_cancelled_one_ends():
    sgd = prof.optimizer_setting("sgd")
    with pytest.raises(RuntimeError, match=r"failed at batch 1 .*no_such_network"):
        prof.FreshStepTimer("no_such_network", "mnist", 1, sgd).result([1, 2], [0])
    timer = prof.FreshStepTimer("tiny_cnn", "mnist", 1, sgd)
    timer.cancel()  # at once: it is still importing torch
    assert timer._process.returncode is not None
