"""``ddlscope calibrate``: the fits (pure functions, synthetic data) and the command end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import psutil
import statistics

import pytest

from ddlscope.errors import UserError
from ddlscope.profiling.calibrate import (DEFAULT_SIZES_BYTES, CalibrationError, calibrate, fit_allreduce,
                                        fit_alpha_beta, fit_half_ring, fit_p2p, overlap_fraction)
from ddlscope.modeling.cluster import load_cluster
from ddlscope.workloads.models import build_model


def _noisy(values, rel_sd: float, seed: int = 0) -> list[float]:
    rng = np.random.default_rng(seed)
    return [float(v * (1 + rng.normal(0, rel_sd))) for v in values]


def test_p2p_fit_recovers_latency_and_bandwidth():
    latency, bw = 30e-6, 2.0e9
    times = _noisy([latency + s / bw for s in DEFAULT_SIZES_BYTES], 0.02)
    fit = fit_p2p(DEFAULT_SIZES_BYTES, times)
    assert fit.latency_s == pytest.approx(latency, rel=0.1)
    assert fit.bandwidth_gb_per_s == pytest.approx(2.0, rel=0.05)
    assert fit.table.max_abs_residual < 0.1


def test_allreduce_fit_recovers_fixed_cost_and_bandwidth():
    workers, latency, fixed, bw = 4, 10e-6, 50e-6, 1.5e9
    times = [fixed + 2 * (workers - 1) * latency + 2 * (workers - 1) / workers * s / bw for s in DEFAULT_SIZES_BYTES]
    fit = fit_allreduce(DEFAULT_SIZES_BYTES, _noisy(times, 0.02, seed=1), workers, latency)
    assert fit.intercept_s == pytest.approx(fixed + 6 * latency, rel=0.1)
    assert fit.collective_fixed_s == pytest.approx(fixed, rel=0.15)
    assert fit.bandwidth_gb_per_s == pytest.approx(1.5, rel=0.05)


def test_half_ring_fit_recovers_all_gather_cost():
    workers, latency, fixed, bw = 2, 10e-6, 300e-6, 0.4e9
    times = [fixed + (workers - 1) * latency + (workers - 1) / workers * s / bw for s in DEFAULT_SIZES_BYTES]
    fit = fit_half_ring(DEFAULT_SIZES_BYTES, _noisy(times, 0.02, seed=2), workers, latency)
    assert fit.fixed_s == pytest.approx(fixed, rel=0.15)
    assert fit.bandwidth_gb_per_s == pytest.approx(0.4, rel=0.05)


def test_fit_is_exact_without_noise_and_robust_to_disturbed_sizes():
    sizes = DEFAULT_SIZES_BYTES
    exact = [40e-6 + s / 1e9 for s in sizes]
    a, b = fit_alpha_beta(sizes, exact)
    assert a == pytest.approx(40e-6, rel=1e-3) and b == pytest.approx(1e-9, rel=1e-3)
    disturbed = list(exact)
    disturbed[0] += 2e-3  # a 2 ms scheduler delay on the two smallest messages (seen on a loaded machine)
    disturbed[2] += 2e-3
    fit = fit_p2p(sizes, disturbed)
    assert fit.latency_s == pytest.approx(40e-6, rel=0.2)
    assert fit.bandwidth_gb_per_s == pytest.approx(1.0, rel=0.1)


def test_latency_larger_than_intercept_clamps_fixed_cost_to_zero():
    sizes = DEFAULT_SIZES_BYTES
    fit = fit_allreduce(sizes, [20e-6 + s / 1e9 for s in sizes], workers=2, latency_s=50e-6)
    assert fit.collective_fixed_s == 0.0
    assert fit.intercept_s == pytest.approx(20e-6, rel=0.01)


@pytest.mark.parametrize("sizes, times, match", [
    ([4096, 4096], [1e-4, 2e-4], "2 distinct sizes"),
    ([4096, 8192], [1e-4, 0.0], "> 0"),
    ([4096, 8192, 16384], [1e-4, 2e-4], "equal length"),
    ([4096, 65536, 1 << 20], [1e-3, 1e-3, 1e-3], "do not grow"),
])
def test_fit_rejects_bad_data(sizes, times, match):
    with pytest.raises(ValueError, match=match):
        fit_p2p(sizes, times)


def test_overlap_fraction():
    assert overlap_fraction(10, 10, 10) == 1.0  # fully hidden
    assert overlap_fraction(10, 10, 20) == 0.0  # serialised
    assert overlap_fraction(10, 5, 12.5) == pytest.approx(0.5)
    assert overlap_fraction(10, 10, 25) == 0.0  # worse than serial: clamped
    assert overlap_fraction(10, 10, 8) == 1.0


@pytest.mark.parametrize("kwargs, match", [
    (dict(workers=1), "at least 2 workers"),
    (dict(workers=2, threads=64), "needs 128 cores"),
    (dict(workers=10_000), "workers x threads <="),
    (dict(workers=2, threads=0), "--threads 0"),
    (dict(workers=2, sizes_bytes=[4096]), "at least 2 distinct sizes"),
    (dict(workers=2, repeats=0), "repeats = 0"),
    (dict(workers=2, hivemind=True, swarm_epochs=1), r"swarm_epochs = 1; allowed: >= 2"),
])
def test_bad_arguments_are_user_errors(kwargs, match):
    with pytest.raises(UserError, match=match):
        calibrate(**kwargs)


def _children() -> list[psutil.Process]:
    return psutil.Process().children(recursive=True)


@pytest.mark.slow
def test_timeout_stops_every_worker():
    before = {p.pid for p in _children()}
    with pytest.raises(CalibrationError, match=r"made no progress for 0.5 s; workers still running: \[.*\]; "
                                               r"last step: .*; worker \d: "):  # says where it stood
        calibrate(workers=2, sizes_bytes=[4096, 65536], repeats=1, timeout_s=0.5)
    assert {p.pid for p in _children()} - before == set()


def test_the_watchdog_expires_only_after_timeout_s_without_progress():
    from ddlscope.profiling.calibrate import ProgressWatchdog

    now = [100.0]
    dog = ProgressWatchdog(10.0, clock=lambda: now[0])
    for _ in range(5):  # 40 s in all, longer than the timeout, but progress every 8 s
        now[0] += 8.0
        assert not dog.expired()
        dog.progress()
    now[0] += 10.0
    assert not dog.expired()
    now[0] += 0.5
    assert dog.expired()


@pytest.mark.slow
def test_worker_failure_is_named_and_others_stopped(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "no-such-interface0")  # gloo cannot create its device
    before = {p.pid for p in _children()}
    with pytest.raises(CalibrationError, match=r"calibration worker \d failed: .*no-such-interface0"):
        calibrate(workers=2, sizes_bytes=[4096, 65536], repeats=1, timeout_s=60)
    assert {p.pid for p in _children()} - before == set()


def test_calibrate_cli_bad_workers(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ddlscope", "calibrate", "--workers", "1", "--out", str(tmp_path / "c.toml")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: --workers 1: calibrate needs at least 2 workers")
    assert "Traceback" not in proc.stderr and not (tmp_path / "c.toml").exists()


def test_trimmed_mean_is_scipys_trim_mean():
    from scipy.stats import trim_mean

    from ddlscope.measure.stats import TRIM, trimmed_mean

    rng = np.random.default_rng(3)
    for n in (1, 2, 5, 10, 20, 23):
        xs = rng.exponential(1.0, n).tolist()
        assert trimmed_mean(xs) == pytest.approx(float(trim_mean(xs, TRIM)))
        assert trimmed_mean(xs, 0.25) == pytest.approx(float(trim_mean(xs, 0.25)))
    assert trimmed_mean([1.0] * 9 + [100.0]) == 1.0  # one wild repeat in ten is cut
    for bad in (([], TRIM), ([1.0], 0.5), ([1.0], -0.1)):
        with pytest.raises(ValueError):
            trimmed_mean(*bad)


def test_time_repeats_warms_up_untimed_and_syncs_around_every_call():
    from ddlscope.measure.stats import time_repeats

    calls: list[str] = []
    times = time_repeats(lambda: calls.append("fn"), 3, warmup=2, sync=lambda: calls.append("sync"))
    assert len(times) == 3 and all(t >= 0 for t in times)
    assert calls == ["fn", "fn"] + ["sync", "fn", "sync"] * 3
    with pytest.raises(ValueError):
        time_repeats(lambda: None, 0)


@pytest.mark.slow
def test_calibrate_cli_quick_writes_a_loadable_cluster_with_what_hivemind_adds(tmp_path):
    """One real calibration (collectives, DDP and FSDP in steps, and the hivemind swarms) checked as a whole.

    The swarm trains the zoo's smallest network (``--swarm-network tiny_cnn``): the default, ResNet-18, made this
    one command take 279 s on an idle 2-core AVX2 EPYC (3.6 s per batch-32 step on one thread). One swarm (batch
    8) instead of the default two: each costs ~11 s here, and the fit over two is checked without processes
    (``test_fit_swarm_reads_whole_epochs_after_the_first_and_fits_overhead_against_the_step``)."""
    out = tmp_path / "cluster.toml"
    sockets = set(Path("/tmp").glob("hivemind-*.sock"))  # hivemind's socket files go with the calibration's folder
    children_tmp = Path(os.environ["TMPDIR"])  # the suite's folder for what it starts (conftest): the command's
    folders = set(children_tmp.glob("pymp-*"))
    proc = subprocess.run([sys.executable, "-m", "ddlscope", "calibrate", "--quick", "--workers", "2", "--hivemind",
                           "--out", str(out), "--matchmaking-time-s", "0.8", "--swarm-network", "tiny_cnn",
                           "--swarm-batch-sizes", "8", "--json"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=900)  # a guard against a hang
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "all-reduce" in proc.stderr and "ping-pong" in proc.stderr  # progress lines
    result = json.loads(proc.stdout)
    spec = load_cluster(out)
    assert spec.devices_per_node == 2 and spec.nodes == 1 and spec.device.kind == "local"
    assert spec.intra_node.bandwidth_gb_per_s > 0 and spec.intra_node.latency_s >= 0
    assert spec.intra_node.bandwidth_gb_per_s == pytest.approx(result["allreduce"]["bandwidth_gb_per_s"], rel=1e-3)
    assert spec.intra_node.latency_s == pytest.approx(result["p2p"]["latency_s"], rel=1e-3)
    assert spec.concurrent_compute_slowdown >= 1 and 0 <= spec.comm_overlap <= 1
    assert spec.all_gather.bandwidth_gb_per_s > 0 and spec.reduce_scatter.bandwidth_gb_per_s > 0
    assert "all-gather" in proc.stderr and "reduce-scatter" in proc.stderr
    assert spec.fsdp_unit_fixed_s >= 0 and result["fsdp_sharded_step_s"] > result["fsdp_plain_step_s"] > 0
    # FSDP and DDP timed inside training steps of the reference stacks: slower than plain, rates fitted
    assert result["fsdp_large_sharded_step_s"] > result["fsdp_large_plain_step_s"] > 0
    assert result["ddp_step_s"] > result["ddp_plain_step_s"] > 0
    assert spec.fsdp_step_gb_per_s > 0 and spec.ddp_step_gb_per_s > 0
    assert "under DDP" in proc.stderr and "under FSDP2" in proc.stderr
    assert len(result["allreduce"]["table"]["measured_s"]) == 4
    assert all(t > 0 for t in result["p2p"]["table"]["measured_s"])
    assert out.read_text().startswith("# Measured by `ddlscope calibrate --workers 2")
    # the hivemind swarms
    assert "hivemind swarm: tiny_cnn" in proc.stderr
    hm = spec.hivemind
    assert hm is not None, result["notes"]
    # hivemind's processes did work every epoch: the fitted overhead at the swarm's step is positive
    assert all(hm.epoch_overhead_s + hm.overhead_steps * step > 0 for step, _ in hm.overshoot_points)
    assert len(hm.overshoot_points) == 1 and hm.epoch_cpu_s > 0
    tiny_bytes = sum(p.numel() * p.element_size() for p in build_model("tiny_cnn", "mnist").parameters())
    assert hm.reference_param_bytes == tiny_bytes and "tiny_cnn" in hm.reference  # the network asked for
    assert hm.matchmaking_time_s == pytest.approx(0.8)  # the swarm ran at the matchmaking time asked for
    assert "steps of 8 per peer" in hm.reference and hm.overhead_steps >= 0  # the swarm's batch size asked for
    assert 0.5 < hm.peer_startup_s < 60  # a fresh interpreter's imports, a DHT join and an optimizer: seconds
    assert set(Path("/tmp").glob("hivemind-*.sock")) <= sockets
    # the swarm peers' multiprocessing folders went with the calibration's (its peers end with os._exit)
    assert set(children_tmp.glob("pymp-*")) <= folders


def test_fit_swarm_reads_whole_epochs_after_the_first_and_fits_overhead_against_the_step():
    from ddlscope.profiling.swarm import STEPS_PER_EPOCH, fit_peer_startup, fit_swarm, swarm_epochs

    def swarm(batch, alone, round_s):
        # [compute s, hivemind step s, epoch after, background CPU s]; epoch 1 ends at step 2 (start-up),
        # then 3 steps per epoch, the first 20 % slower, the last with a round of round_s seconds
        steps = [[alone, 0.0, 0, 0.0], [alone, 0.0, 0, 0.0], [alone, 2.0, 1, 1.0]]
        for epoch in range(2, 12):
            steps += [[1.2 * alone, 0.0, epoch - 1, 0.3], [alone, 0.0, epoch - 1, 0.1], [alone, round_s, epoch, 0.6]]
        return {"batch_size": batch, "compute_alone_s": alone, "steps": steps}

    # overhead per epoch = 0.2 x step + round: 1.0 + 0.2 = 1.2 s at a 1 s step, 0.6 + 0.05 = 0.65 s at 0.25 s
    worker = {"param_bytes": 1000, "matchmaking_time_s": 0.7, "swarms": [swarm(32, 1.0, 1.0), swarm(8, 0.25, 0.6)]}
    epochs = swarm_epochs([worker] * 2)
    assert [len(sw["overhead_s"]) for sw in epochs] == [20, 20]  # 10 whole epochs after the first, 2 workers
    assert epochs[0]["overhead_s"][0] == pytest.approx(1.2) and epochs[1]["overhead_s"][0] == pytest.approx(0.65)
    # of it, 0.2 x step landed in the steps' compute: 0.2 s at the 1 s step, 0.05 s at 0.25 s
    assert epochs[0]["compute_overhead_s"][0] == pytest.approx(0.2)
    assert epochs[1]["compute_overhead_s"][0] == pytest.approx(0.05)
    fit = fit_swarm(epochs, 1000, 0.7)
    # the line through (1.0, 1.2) and (0.25, 0.65): slope 0.55/0.75, intercept 1.2 - slope
    assert fit.overhead_steps == pytest.approx(0.55 / 0.75)
    assert fit.epoch_overhead_s == pytest.approx(1.2 - 0.55 / 0.75)
    assert fit.compute_overhead_s == pytest.approx((0.2 + 0.05) / 2)  # the mean over all epochs of both swarms
    assert fit.epoch_cpu_s == pytest.approx(1.0)
    assert fit.overshoot_steps == pytest.approx(3 - STEPS_PER_EPOCH)
    assert fit.matchmaking_time_s == pytest.approx(0.7) and "32/8" in fit.reference
    assert fit.reference_network == "resnet18" and fit.overshoot_points == [(0.25, 1.0), (1.0, 1.0)]
    # where the work landed, by position after the round: the first step 20 % slower (0.2 s and 0.05 s), then none
    first = [0.2] * 20 + [0.05] * 20
    assert fit.step_pattern_s[0] == pytest.approx((statistics.fmean(first), statistics.stdev(first)))
    assert fit.step_pattern_s[1:] == [pytest.approx((0.0, 0.0))] * 2
    # and per epoch, both workers' steps together: 10 epochs of each swarm
    assert len(fit.step_epochs_s) == 20
    assert fit.step_epochs_s[0] == [pytest.approx([0.2, 0.0, 0.0])] * 2
    assert fit.step_epochs_s[-1] == [pytest.approx([0.05, 0.0, 0.0])] * 2
    # each swarm keeps its own overshoot: 2 extra steps at the short step, 1 at the long one
    def longer(batch, alone):  # 4 steps per epoch after the first
        sw = swarm(batch, alone, 0.5)
        return {**sw, "steps": sw["steps"][:3] + [s for e in range(2, 12) for s in (
            [[alone, 0.0, e - 1, 0.1]] * 3 + [[alone, 0.5, e, 0.5]])]}
    uneven = fit_swarm(swarm_epochs([{**worker, "swarms": [swarm(32, 1.0, 1.0), longer(8, 0.25)]}] * 2), 1000, 0.7,
                       ("mobilenet_v2", "mnist"))
    assert uneven.overshoot_points == [(0.25, 2.0), (1.0, 1.0)] and uneven.overshoot_steps == pytest.approx(1.5)
    assert uneven.reference_network == "mobilenet_v2" and uneven.reference.startswith("mobilenet_v2 on mnist")
    # read at a step: linear between the swarms, the nearest swarm's beyond them
    assert [uneven.overshoot_at(x) for x in (0.1, 0.25, 0.625, 1.0, 5.0)] == pytest.approx([2.0, 2.0, 1.5, 1.0, 1.0])
    assert uneven.model_copy(update={"overshoot_points": []}).overshoot_at(0.25) == pytest.approx(1.5)
    # more overhead at the shorter step: no slope, the mean overhead
    flat = fit_swarm(swarm_epochs([{**worker, "swarms": [swarm(32, 1.0, 0.2), swarm(8, 0.25, 1.5)]}] * 2), 1000, 0.7)
    assert flat.overhead_steps == 0.0 and flat.epoch_overhead_s == pytest.approx((1.2 - 0.8 + 1.55) / 2)
    assert fit_peer_startup([worker] * 2) is None  # a result from before start-up was measured
    first = {**worker, "import_s": 3.0, "join_s": None,
             "swarms": [{**sw, "optimizer_init_s": 0.5} for sw in worker["swarms"]]}
    second = {**first, "import_s": 4.0, "join_s": 1.5, "swarms": [{**sw, "optimizer_init_s": 0.7} for sw in worker["swarms"]]}
    assert fit_peer_startup([first, second]) == pytest.approx(3.5 + 1.5 + 0.6)  # medians of each part
    short = {**worker, "swarms": [swarm(32, 1.0, 1.0), {**swarm(8, 0.25, 0.6), "steps": swarm(8, 0.25, 0.6)["steps"][:6]}]}
    with pytest.raises(ValueError, match="batch 8: worker 0 timed 1 whole global epochs"):
        swarm_epochs([short])

@pytest.mark.parametrize("kwargs, match", [
    (dict(workers=1), "at least 2 workers"),
    (dict(workers=2, swarm_epochs=1), r"swarm_epochs = 1; allowed: >= 2"),
    (dict(workers=2, matchmaking_time_s=0.0), r"matchmaking time 0 s; allowed: > 0"),
    (dict(workers=2, swarm_batch_sizes=[8, 8]), r"swarm batch sizes \[8, 8\]; allowed: one or more distinct"),
    (dict(workers=2, swarm_reference=("nope", "mnist")), r"swarm network 'nope'"),
])
def test_calibrate_hivemind_refuses_bad_arguments_before_starting_anything(kwargs, match):
    from ddlscope.profiling.calibrate import calibrate_hivemind

    before = {p.pid for p in _children()}
    with pytest.raises(UserError, match=match):
        calibrate_hivemind(**kwargs)
    assert {p.pid for p in _children()} - before == set()


def test_load_or_calibrate_hivemind_keeps_its_fit_while_the_options_match(tmp_path, monkeypatch):
    import ddlscope.profiling.calibrate as cal
    from ddlscope.modeling.cluster import HivemindFit

    measured = []

    def measure(progress=None, **options):
        measured.append(options)
        return HivemindFit(epoch_overhead_s=1.0 + len(measured), overshoot_points=[(0.5, 0.25)])

    monkeypatch.setattr(cal, "calibrate_hivemind", measure)
    opts = dict(workers=2, threads=1, swarm_reference=("mobilenet_v2", "mnist"), swarm_batch_sizes=[32])
    fit, cached = cal.load_or_calibrate_hivemind(tmp_path, **opts)
    assert (fit.epoch_overhead_s, cached, len(measured)) == (2.0, False, 1)
    again, cached = cal.load_or_calibrate_hivemind(tmp_path, progress=print, **opts)
    assert again == fit and cached and len(measured) == 1  # read back whole, tuples included
    other, cached = cal.load_or_calibrate_hivemind(tmp_path, **{**opts, "swarm_batch_sizes": [16]})
    assert other.epoch_overhead_s == 3.0 and not cached  # other options: measured again, and kept instead
    fresh, cached = cal.load_or_calibrate_hivemind(tmp_path, refresh=True, **{**opts, "swarm_batch_sizes": [16]})
    assert fresh.epoch_overhead_s == 4.0 and not cached
    (tmp_path / cal.HIVEMIND_FIT_FILE).write_text("{not json")
    assert cal.load_or_calibrate_hivemind(tmp_path, **opts)[0].epoch_overhead_s == 5.0  # unreadable: measured again


@pytest.mark.slow
def test_calibrate_hivemind_measures_only_the_swarms_and_leaves_no_process():
    """The hivemind swarms alone (no collectives), on the zoo's smallest network: a fit of that network."""
    from ddlscope.profiling.calibrate import calibrate_hivemind

    before = {p.pid for p in _children()}
    lines = []
    fit = calibrate_hivemind(workers=2, swarm_epochs=2, swarm_reference=("tiny_cnn", "mnist"), swarm_batch_sizes=[8],
                             matchmaking_time_s=0.5, progress=lines.append)
    assert fit.reference_network == "tiny_cnn" and fit.matchmaking_time_s == 0.5
    assert fit.epoch_overhead_s > 0 and fit.epoch_cpu_s > 0 and len(fit.overshoot_points) == 1
    assert any("hivemind swarm, batch 8: global epoch" in line for line in lines)
    assert not any("ping-pong" in line or "compute kernel" in line for line in lines)  # no collectives measured
    assert {p.pid for p in _children()} - before == set()
