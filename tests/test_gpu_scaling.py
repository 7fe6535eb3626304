"""Scaling a profile measured on a GPU (issue 16, "predict from the GPU you have"), the band check,
and ``--device`` of ``ddlscope recommend`` / ``validate``. CPU only: the GPU profiles are synthetic."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from ddlscope.cli import app
from ddlscope.errors import UserError
from ddlscope.experiments.validate import ValidationGrid, run_validation, validation_cell
from ddlscope.modeling.cluster import DeviceSpec
from ddlscope.modeling.devices import (BAND_CHECKS, DEVICE_KINDS, LAUNCH_BOUND_LAYER_S, ScaleEstimate, check_band, compute_scale,
                                       profiled_kind)
from ddlscope.modeling.prediction import Setting
from ddlscope.modeling.profile import LayerProfile, StepProfile, WorkloadProfile
from tests.test_costs import make_cluster, make_profile

REPO = Path(__file__).resolve().parents[1]
LOCAL = REPO / "ddlscope" / "examples" / "cluster-local-2cores.toml"
A100, H100 = DEVICE_KINDS["a100-40gb"], DEVICE_KINDS["h100-80gb"]
OVERHEAD_S = 50e-6  # the launch-bound layer's forward + backward, whatever the batch


def gpu_profile(name: str = "NVIDIA A100-SXM4-40GB", peak_tflops: float = 18.0, bandwidth: float = 1400.0,
                batches: tuple[int, ...] = (4, 8, 16, 32)) -> WorkloadProfile:
    """A CPU profile (tests/test_costs.py) edited into a GPU one: a launch-bound layer (``tiny``, the
    same time at every batch) and a compute-bound one (``big``, linear in batch, 1e9 FLOP/sample);
    the steps add up to the layers, no optimizer time."""
    bs = list(batches)
    tiny = LayerProfile(name="tiny", param_bytes=4, forward_s=[OVERHEAD_S / 3] * len(bs),
                        backward_s=[2 * OVERHEAD_S / 3] * len(bs), output_bytes_per_sample=4,
                        saved_bytes_per_sample=4, forward_flops_per_sample=1e3)
    big = LayerProfile(name="big", param_bytes=4, forward_s=[1e-4 * b for b in bs], backward_s=[2e-4 * b for b in bs],
                       output_bytes_per_sample=4, saved_bytes_per_sample=4, forward_flops_per_sample=1e9)
    steps = [StepProfile(batch_size=b, forward_s=OVERHEAD_S / 3 + 1e-4 * b, backward_s=2 * OVERHEAD_S / 3 + 2e-4 * b,
                         optimizer_s=0.0, step_s=OVERHEAD_S + 3e-4 * b, activation_peak_bytes=b * 1000) for b in bs]
    cpu = make_profile()
    device = cpu.device.model_copy(update={"type": "cuda", "name": name, "peak_tflops": peak_tflops,
                                           "memory_bandwidth_gb_per_s": bandwidth, "memory_bytes": 40 * 2**30})
    return cpu.model_copy(update={"device": device, "batch_sizes": bs, "layers": [tiny, big], "steps": steps})


# ------------------------------------------------------------------------------ local and names
def test_local_kind_on_a_gpu_profile_is_the_profiled_gpu_itself():
    prof = gpu_profile()
    est = compute_scale(prof, 32, "local")
    assert (est.factor, est.low, est.high) == (1.0, 1.0, 1.0)
    assert DeviceSpec(kind="local").memory_bytes(prof.device.memory_bytes) == 40 * 2**30


@pytest.mark.parametrize("name, kind", [
    ("NVIDIA H100 80GB HBM3", "h100-80gb"), ("NVIDIA H100 PCIe", None), ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
    ("NVIDIA A100 80GB PCIe", None), ("Tesla V100-SXM2-16GB", "v100-16gb"), ("Tesla T4", "t4"),
    ("NVIDIA GeForce RTX 3090", "rtx-3090"), ("NVIDIA GeForce RTX 3090 Ti", None), ("NVIDIA H200", "h200-141gb"),
    ("NVIDIA H200 NVL", None),
    ("AMD EPYC 7763 64-Core Processor", None),
])
def test_gpu_names_match_their_datasheet_kind_only(name, kind):
    assert profiled_kind(name) == kind


# ------------------------------------------------------------------------------ GPU -> GPU
def test_gpu_to_gpu_scales_big_layers_by_the_roofline_and_keeps_launch_bound_ones():
    est = compute_scale(gpu_profile(), 32, "h100-80gb")
    big_s, ratio = 3e-4 * 32, A100.peak_tflops / H100.peak_tflops  # datasheet vs datasheet (name matched)
    # the tiny layer stays at its measured 50 us (its floor); the big one is compute-bound on both GPUs
    assert est.factor == pytest.approx((OVERHEAD_S + big_s * ratio) / (OVERHEAD_S + big_s), rel=1e-6)
    assert est.low == pytest.approx(est.factor / 2) and est.high == pytest.approx(est.factor * 2)
    assert "datasheet of a100-40gb (matched by name)" in est.method and "1 of 2 layers at their floor" in est.method
    assert "not validated" in est.method and "ROUGH" not in est.method


def test_a_pair_whose_band_a_measurement_checked_states_that_check_and_others_say_there_is_none():
    checked = compute_scale(gpu_profile(name="NVIDIA H100 80GB HBM3"), 32, "h200-141gb")
    assert BAND_CHECKS[("h100-80gb", "h200-141gb")] in checked.method and "not validated" not in checked.method
    assert "not validated on a v100-16gb" in compute_scale(gpu_profile(name="NVIDIA H100 80GB HBM3"), 32,
                                                           "v100-16gb").method
    from_cpu = compute_scale(make_profile(), 32, "h100-80gb")
    assert "ROUGH" in from_cpu.method and "OUTSIDE" in from_cpu.method
    for profiled, target in BAND_CHECKS:  # every entry names kinds that exist
        assert target in DEVICE_KINDS and (profiled == "cpu" or profiled in DEVICE_KINDS)


def test_launch_bound_network_does_not_speed_up_on_a_faster_gpu():
    prof = gpu_profile()
    tiny_only = prof.model_copy(update={"layers": prof.layers[:1], "steps": [
        s.model_copy(update={"forward_s": OVERHEAD_S / 3, "backward_s": 2 * OVERHEAD_S / 3, "step_s": OVERHEAD_S})
        for s in prof.steps]})
    assert compute_scale(tiny_only, 32, "h100-80gb").factor == pytest.approx(1.0, rel=1e-6)
    # a slower GPU slows it by the roofline (the floor only stops speed-ups)
    assert compute_scale(tiny_only, 32, "t4").factor > 1.0


def test_unmatched_gpu_name_uses_the_measured_peaks():
    est = compute_scale(gpu_profile(name="NVIDIA H200 NVL", peak_tflops=50.0), 32, "h100-80gb")
    big_s = 3e-4 * 32
    assert est.factor == pytest.approx((OVERHEAD_S + big_s * 50.0 / H100.peak_tflops) / (OVERHEAD_S + big_s), rel=1e-6)
    assert "measured" in est.method


def test_one_measured_batch_floors_at_the_cheapest_layer_capped():
    prof = gpu_profile(batches=(32,))
    est = compute_scale(prof, 32, "h100-80gb")
    big_s, ratio = 3e-4 * 32, A100.peak_tflops / H100.peak_tflops
    floor = min(OVERHEAD_S, LAUNCH_BOUND_LAYER_S)  # 50 us measured, capped at the constant
    assert est.factor == pytest.approx((floor + big_s * ratio) / (OVERHEAD_S + big_s), rel=1e-6)


# ------------------------------------------------------------------------------ CPU -> GPU
def test_cpu_to_gpu_says_it_is_a_rough_estimate():
    est = compute_scale(make_profile(), 32, "h100-80gb")
    assert "CPU -> GPU scaling is a ROUGH ESTIMATE" in est.method and "launch" in est.method


# ------------------------------------------------------------------------------ the band check
def test_check_band_says_whether_a_measurement_lies_in_the_band():
    est = ScaleEstimate(0.5, 0.25, 1.0, "m")
    inside = check_band(est, profiled_step_s=2.0, measured_step_s=1.6)  # measured factor 0.8
    assert inside.inside and inside.measured_factor == pytest.approx(0.8)
    assert inside.error == pytest.approx(0.5 / 0.8 - 1)
    assert check_band(est, 2.0, 0.5).inside and check_band(est, 2.0, 2.0).inside  # both edges count
    assert not check_band(est, 2.0, 0.4).inside and not check_band(est, 2.0, 2.2).inside
    with pytest.raises(ValueError, match="measured_step_s = 0.0; allowed: seconds > 0"):
        check_band(est, 2.0, 0.0)


# ------------------------------------------------------------------------------ --device
@pytest.fixture
def no_cuda(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _must_not_profile(*args, **kwargs):
    raise AssertionError("profiled although --device was refused")


@pytest.mark.parametrize("args", [["recommend", "--cluster", LOCAL, "--device", "cuda"],
                                  ["validate", "tiny", "--device", "cuda", "--predict-only", "--cluster", LOCAL]])
def test_device_cuda_without_cuda_is_one_error_before_anything_starts(args, no_cuda, monkeypatch, tmp_path):
    import ddlscope.predict.commands
    import ddlscope.profiling.profile

    monkeypatch.setattr(ddlscope.profiling.profile, "load_or_profile", _must_not_profile)
    monkeypatch.setattr(ddlscope.predict.commands, "_local_cluster", _must_not_profile)
    result = CliRunner().invoke(app, [str(a) for a in args] + ["--cache-dir" if args[0] == "recommend" else "--db",
                                                               str(tmp_path / "x")])
    assert isinstance(result.exception, UserError), result.output
    message = str(result.exception)
    assert "\n" not in message and message.startswith("--device cuda needs CUDA")
    assert 'allowed here: device = "cpu"' in message


def test_validate_on_cuda_without_a_cluster_file_is_refused_before_calibrating(monkeypatch, tmp_path):
    import ddlscope.predict.commands

    monkeypatch.setattr(ddlscope.predict.commands, "_local_cluster", _must_not_profile)
    result = CliRunner().invoke(app, ["validate", "tiny", "--device", "cuda", "--db", str(tmp_path / "r.db")])
    assert isinstance(result.exception, UserError), result.output
    assert str(result.exception).startswith("validate on cuda needs --cluster FILE") and "\n" not in str(result.exception)
    assert not (tmp_path / "r.db").exists()


def test_unknown_device_lists_the_allowed_ones(monkeypatch, tmp_path):
    import ddlscope.profiling.profile

    monkeypatch.setattr(ddlscope.profiling.profile, "load_or_profile", _must_not_profile)
    result = CliRunner().invoke(app, ["recommend", "--cluster", str(LOCAL), "--device", "tpu"])
    assert isinstance(result.exception, UserError) and str(result.exception) == "--device 'tpu'; allowed: cpu, cuda"


# ------------------------------------------------------------------------------ validation on a device
def test_validation_cells_run_and_profile_on_the_grids_device(tmp_path, monkeypatch):
    import ddlscope.profiling.profile

    grid = ValidationGrid(name="v", datasets=["mnist"], networks=["tiny_cnn"], strategies=["single", "ddp"],
                          workers=2, batch_size=16, threads_per_device=1, synthetic_train_size=16, device="cuda")
    ddp = Setting("ddp", 2, 8, epoch_samples=60000)
    assert validation_cell(grid, ddp, "tiny_cnn", "mnist", tmp_path).values["device"] == "cuda"
    cpu = grid.model_copy(update={"device": "cpu"})
    assert validation_cell(cpu, ddp, "tiny_cnn", "mnist", tmp_path).config.device == "cpu"
    assert ValidationGrid(datasets=["mnist"], networks=["tiny_cnn"]).device == "cpu"
    with pytest.raises(ValueError, match="device"):
        ValidationGrid(datasets=["mnist"], networks=["tiny_cnn"], device="tpu")
    devices = []

    def profile(*args, **kwargs):
        devices.append(args[3] if len(args) > 3 else kwargs["device"])
        return make_profile()

    monkeypatch.setattr(ddlscope.profiling.profile, "load_or_profile", profile)
    run_validation(grid, make_cluster(), tmp_path / "r.db", progress=False, run_real=False)
    assert devices == ["cuda"]
