"""Cluster descriptions (TOML), device kinds, and scaling a profile to another device."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from ddlscope.errors import UserError
from ddlscope.modeling.cluster import (ClusterSpec, DeviceSpec, HivemindFit, LinkSpec, PeerSpec, dumps_cluster,
                                      load_cluster, write_cluster)
from ddlscope.modeling.devices import DEVICE_KINDS, UNCERTAINTY, compute_scale
from ddlscope.modeling.profile import DeviceProfile, LayerProfile, StepProfile, WorkloadProfile

EXAMPLES = Path(__file__).resolve().parent.parent / "ddlscope" / "examples"
GOOD = """
[cluster]
name = "t"
nodes = 1
devices_per_node = 2

[cluster.device]
kind = "v100-16gb"

[cluster.intra_node]
bandwidth_gb_per_s = 25.0
latency_s = 5e-6
"""


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    return path


# ------------------------------------------------------------------------------------ examples
@pytest.mark.parametrize("name, workers, kind, inter", [
    ("cluster-4xv100-nvlink.toml", 4, "v100-16gb", False),
    ("cluster-2x4xa100.toml", 8, "a100-40gb", True),
    ("cluster-thesis-titanrtx.toml", 8, "titan-rtx", True),
    ("cluster-collaborative.toml", 4, "local", True),
    ("cluster-local-2cores.toml", 2, "local", False),
])
def test_example_files_load(name, workers, kind, inter):
    spec = load_cluster(EXAMPLES / name)
    assert spec.workers == workers
    assert spec.device.kind == kind
    assert (spec.inter_node is not None) == inter
    assert spec.intra_node.bandwidth_gb_per_s > 0


def test_collaborative_example_has_heterogeneous_peers():
    spec = load_cluster(EXAMPLES / "cluster-collaborative.toml")
    assert len(spec.peers) == 4
    assert len({p.compute_share for p in spec.peers}) == 4
    assert spec.peers[3].memory_gib == 8.0


def test_device_memory_from_kind_explicit_or_profile():
    gib = 1024**3
    assert load_cluster(EXAMPLES / "cluster-4xv100-nvlink.toml").device_memory_bytes(123) == 16 * gib
    assert DeviceSpec(kind="a100-80gb", memory_gib=70).memory_bytes(123) == 70 * gib
    assert DeviceSpec(kind="local").memory_bytes(5 * gib) == 5 * gib  # the profiled device's


# ------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("text, must_mention", [
    (GOOD.replace("bandwidth_gb_per_s = 25.0\n", ""), ["cluster.intra_node.bandwidth_gb_per_s: field required"]),
    (GOOD.replace("[cluster.device]\nkind = \"v100-16gb\"\n", ""), ["cluster.device: field required", "kind"]),
    (GOOD.replace("[cluster.intra_node]\nbandwidth_gb_per_s = 25.0\nlatency_s = 5e-6\n", ""),
     ["cluster.intra_node: field required", "bandwidth_gb_per_s, latency_s"]),
    (GOOD.replace("25.0", "0"), ["cluster.intra_node.bandwidth_gb_per_s", "greater than 0", "got 0"]),
    (GOOD.replace("25.0", "-3.5"), ["cluster.intra_node.bandwidth_gb_per_s", "greater than 0", "-3.5"]),
    (GOOD.replace('kind = "v100-16gb"', 'kind = "v100-16gb"\nmemory_gib = 0'), ["cluster.device.memory_gib", "greater than 0"]),
    (GOOD.replace('kind = "v100-16gb"', 'kind = "v101"'),
     ["cluster.device.kind", "unknown device kind 'v101'", "allowed:", "v100-16gb", "a100-80gb", "local"]),
    (GOOD.replace("nodes = 1", "nodes = 2"), ["cluster.inter_node", "required when nodes > 1", "nodes = 2"]),
    (GOOD.replace("latency_s = 5e-6", "latency_s = 5e-6\nbandwith_gb_per_s = 3"),
     ["cluster.intra_node.bandwith_gb_per_s: unknown field", "allowed: bandwidth_gb_per_s, latency_s"]),
    (GOOD.replace('name = "t"', 'name = "t"\ngpus = 4'), ["cluster.gpus: unknown field", "devices_per_node"]),
    (GOOD + "\n[[cluster.peers]]\ncompute_share = 1.0\nbandwidth_gb_per_s = 0.1\n"
            "\n[[cluster.peers]]\ncompute_share = 0.5\nbandwidth_gb_per_s = -1\n",
     ["cluster.peers[1].bandwidth_gb_per_s", "greater than 0"]),
    (GOOD + "\n[[cluster.peers]]\nbandwidth_gb_per_s = 0.1\n", ["cluster.peers[0].compute_share: field required"]),
    (GOOD.replace('kind = "v100-16gb"', 'kind = "v100-16gb"\n[cluster.device.extra]\nx = 1'),
     ["cluster.device.extra: unknown field", "allowed: kind, memory_gib"]),
    (GOOD.replace("devices_per_node = 2", "devices_per_node = 0"), ["cluster.devices_per_node", "greater than or equal to 1"]),
    (GOOD.replace("devices_per_node = 2", 'devices_per_node = "two"'), ["cluster.devices_per_node", "integer"]),
    (GOOD + "\n[run]\nx = 1\n", ["unknown table(s) ['run']", "allowed: [cluster]"]),
    ("[clusters]\nnodes = 1\n", ["unknown table(s) ['clusters']"]),
    ("# empty\n", ["no [cluster] table"]),
    ("[cluster\nnodes = 1\n", ["not valid TOML"]),
])
def test_bad_cluster_file_names_the_field(tmp_path, text, must_mention):
    with pytest.raises(UserError) as err:
        load_cluster(_write(tmp_path, text))
    for text_part in must_mention:
        assert text_part in str(err.value), str(err.value)
    assert str(tmp_path / "cluster.toml") in str(err.value)


def test_missing_cluster_file(tmp_path):
    with pytest.raises(UserError, match="cluster file not found: .*nope.toml"):
        load_cluster(tmp_path / "nope.toml")


def test_unknown_kind_in_python_too():
    with pytest.raises(ValueError, match="unknown device kind 'tpu'"):
        DeviceSpec(kind="tpu")


# ------------------------------------------------------------------------------------ writing
def test_write_then_load_round_trip(tmp_path):
    spec = ClusterSpec(name='odd "name" \\ ü', nodes=2, devices_per_node=4, device=DeviceSpec(kind="a100-80gb", memory_gib=79.5),
                       intra_node=LinkSpec(bandwidth_gb_per_s=300.0, latency_s=3e-6),
                       inter_node=LinkSpec(bandwidth_gb_per_s=12.5, latency_s=1.5e-5),
                       collective_fixed_s=4.2e-5, p2p_fixed_s=1e-6, concurrent_compute_slowdown=1.25, comm_overlap=0.3,
                       peers=[PeerSpec(compute_share=0.5, bandwidth_gb_per_s=0.01),
                              PeerSpec(compute_share=2, bandwidth_gb_per_s=0.125, latency_s=0.02, memory_gib=8)],
                       hivemind=HivemindFit(epoch_overhead_s=1.7, overshoot_steps=0.9,
                                            overshoot_points=[(0.35, 1.5), (0.64, 0.3)], reference_network="mobilenet_v2",
                                            step_epochs_s=[[[0.3, 0.1], [0.0, 0.2, -0.01]], [[0.4], [0.1, 0.1]]]))
    path = write_cluster(spec, tmp_path / "sub" / "c.toml", header="measured somewhere\non some day")
    assert load_cluster(path) == spec
    text = path.read_text()
    assert text.startswith("# measured somewhere\n# on some day\n[cluster]\n")
    assert [p.name for p in path.parent.iterdir()] == ["c.toml"]  # no temporary file left behind


@pytest.mark.parametrize("name", ["cluster-4xv100-nvlink.toml", "cluster-2x4xa100.toml", "cluster-collaborative.toml"])
def test_examples_round_trip(tmp_path, name):
    spec = load_cluster(EXAMPLES / name)
    assert load_cluster(write_cluster(spec, tmp_path / name)) == spec


def test_a_hivemind_fit_refuses_epochs_of_uneven_peers_or_without_steps():
    for bad in ([[[0.1], [0.2]], [[0.1]]], [[[0.1], []]], [[]]):
        with pytest.raises(ValueError, match="same number of peers"):
            HivemindFit(epoch_overhead_s=1.0, step_epochs_s=bad)


def test_dumps_has_no_empty_peers_or_none():
    text = dumps_cluster(ClusterSpec(device=DeviceSpec(kind="local"), intra_node=LinkSpec(bandwidth_gb_per_s=1, latency_s=0)))
    assert "peers" not in text and "memory_gib" not in text and "inter_node" not in text


# ------------------------------------------------------------------------------------ scaling
def _profile(layers: list[tuple[float, int, int, float]], optimizer_s: float = 0.0, peak_tflops: float = 0.1,
             bandwidth: float = 10.0) -> WorkloadProfile:
    """A hand-made profile at batch 8: layers as (seconds fwd+bwd, param_bytes, activation bytes/sample, fwd FLOPs/sample)."""
    lp = [LayerProfile(name=f"l{i}", param_bytes=pb, forward_s=[t / 3], backward_s=[2 * t / 3],
                       output_bytes_per_sample=ab, saved_bytes_per_sample=0, forward_flops_per_sample=fl)
          for i, (t, pb, ab, fl) in enumerate(layers)]
    fwd, bwd = sum(t / 3 for t, *_ in layers), sum(2 * t / 3 for t, *_ in layers)
    step = StepProfile(batch_size=8, forward_s=fwd, backward_s=bwd, optimizer_s=optimizer_s,
                       step_s=fwd + bwd + optimizer_s, activation_peak_bytes=0)
    dev = DeviceProfile(type="cpu", name="test cpu", threads=1, peak_tflops=peak_tflops,
                        memory_bandwidth_gb_per_s=bandwidth, memory_bytes=2**30, runtime_bytes=0)
    return WorkloadProfile(network="n", dataset="d", input_shape=(1, 8, 8), num_classes=10, optimizer="sgd", device=dev,
                           torch_version="x", batch_sizes=[8], layers=lp, steps=[step], param_count=1,
                           param_bytes=sum(x[1] for x in layers), buffer_bytes=0, optimizer_state_bytes=0,
                           sample_bytes=256, profile_s=1.0, created_at=0.0)


def test_local_kind_is_no_scaling():
    est = compute_scale(_profile([(0.01, 400, 100, 1e6)]), 8, "local")
    assert (est.factor, est.low, est.high) == (1.0, 1.0, 1.0)


def test_compute_bound_layer_scales_with_peak_flops():
    # 1e9 FLOPs/sample, 4 bytes of everything: compute-bound on both devices
    est = compute_scale(_profile([(1.0, 4, 4, 1e9)]), 8, "v100-16gb")
    assert est.factor == pytest.approx(0.1 / DEVICE_KINDS["v100-16gb"].peak_tflops)
    assert est.low == pytest.approx(est.factor / UNCERTAINTY) and est.high == pytest.approx(est.factor * UNCERTAINTY)
    assert "roofline" in est.method and "not validated" in est.method


def test_memory_bound_layer_and_optimizer_scale_with_bandwidth():
    # 1 FLOP/sample, 1 MB of activations per sample: memory-bound; the optimizer is memory-bound too
    est = compute_scale(_profile([(1.0, 0, 10**6, 1.0)], optimizer_s=1.0), 8, "a100-80gb")
    assert est.factor == pytest.approx(10.0 / DEVICE_KINDS["a100-80gb"].memory_bandwidth_gb_per_s)


def test_layers_weighted_by_measured_time():
    compute_bound, memory_bound = (3.0, 4, 4, 1e9), (1.0, 0, 10**6, 1.0)
    est = compute_scale(_profile([compute_bound, memory_bound]), 8, "t4")
    t4 = DEVICE_KINDS["t4"]
    expected = (3.0 * 0.1 / t4.peak_tflops + 1.0 * 10.0 / t4.memory_bandwidth_gb_per_s) / 4.0
    assert est.factor == pytest.approx(expected)
    assert est.low < est.factor < est.high


def test_faster_gpu_gives_factor_below_one_and_slower_target_above():
    prof = _profile([(0.02, 4 * 10**5, 32 * 1024, 2e7), (0.01, 4 * 10**4, 8 * 1024, 5e6)], optimizer_s=0.002)
    h100, t4 = compute_scale(prof, 8, "h100-80gb"), compute_scale(prof, 8, "t4")
    assert 0 < h100.factor < t4.factor < 1
    assert h100.low <= h100.factor <= h100.high
    slow_device = compute_scale(_profile([(1.0, 4, 4, 1e9)], peak_tflops=100.0, bandwidth=5000.0), 8, "t4")
    assert slow_device.factor > 1  # profiled on something faster than a T4


def test_tiny_layers_on_a_gpu_are_flagged_launch_bound():
    est = compute_scale(_profile([(1e-4, 400, 64, 1e4)]), 8, "h100-80gb")
    assert est.warnings and "launch" in est.warnings[0]
    assert not compute_scale(_profile([(10.0, 4, 4, 1e11)]), 8, "h100-80gb").warnings


def test_unknown_target_kind_lists_known_kinds():
    with pytest.raises(UserError, match="unknown device kind 'gtx-480'; allowed: local, .*h100-80gb"):
        compute_scale(_profile([(0.01, 4, 4, 1e6)]), 8, "gtx-480")


def test_every_kind_has_source_and_positive_figures():
    for name, kind in DEVICE_KINDS.items():
        assert kind.source
        if name != "local":
            assert kind.peak_tflops > 0 and kind.memory_bandwidth_gb_per_s > 0 and kind.memory_gib > 0
            assert math.isfinite(kind.peak_tflops)
