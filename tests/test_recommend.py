"""The recommender and ``ddlscope recommend`` (``ddlscope validate``: tests/test_validate.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ddlscope import distribution
from ddlscope.modeling.cluster import ClusterSpec, DeviceSpec, LinkSpec
from ddlscope.modeling.recommend import candidate_settings, recommend
from tests.test_costs import MIB, make_profile

REPO = Path(__file__).resolve().parents[1]
LOCAL = REPO / "ddlscope" / "examples" / "cluster-local-2cores.toml"


def cluster(memory_gib: float, bw: float = 1.0) -> ClusterSpec:
    return ClusterSpec(name="t", nodes=1, devices_per_node=4, device=DeviceSpec(kind="local", memory_gib=memory_gib),
                       intra_node=LinkSpec(bandwidth_gb_per_s=bw, latency_s=1e-5))


def settings(strategies=("single", "ddp", "fsdp", "gpipe", "1f1b"), workers=4):
    return candidate_settings(list(strategies), workers, 32, 3200, microbatches=4)


def test_candidates_train_the_same_global_batch():
    by = {s.strategy: s for s in candidate_settings(["single", "ddp", "gpipe", "collaborative"], 4, 64, 1000)}
    assert by["single"].batch_size == 64 and by["ddp"].batch_size == 16 and by["ddp"].global_batch_size == 64
    assert by["gpipe"].batch_size == 64 and by["gpipe"].microbatches == 8
    assert by["collaborative"].target_batch_size == 64 and by["collaborative"].batch_size == 16


def test_the_fastest_feasible_model_is_recommended():
    rec = recommend(make_profile(), cluster(64), settings())
    assert rec.best is not None and rec.best.fits
    feasible = [c for c in rec.candidates if c.fits]
    assert rec.best.prediction.epoch_s == min(c.prediction.epoch_s for c in feasible)
    assert rec.best.setting.strategy in rec.why
    # a pipeline's label names the cut that was predicted (to run it: distributed.stage_bounds)
    pipe = next(c for c in rec.candidates if c.setting.strategy == "gpipe")
    assert pipe.label == f"gpipe x4, 4 micro-batches, stages {pipe.prediction.inputs['stage_bounds']}"
    assert next(c for c in rec.candidates if c.setting.strategy == "ddp").label == "ddp x4"


def test_a_model_that_does_not_fit_is_never_recommended():
    prof = make_profile(layer_params_bytes=(200 * MIB,) * 4)  # 800 MiB of parameters
    free = recommend(prof, cluster(64, bw=1e6), settings())
    assert free.best.setting.strategy in ("ddp", "fsdp")  # data parallel wins with a free network
    # a device that holds a sharded model but not a full replica
    full = max(c.memory_bytes for c in free.candidates if c.setting.strategy == "ddp")
    fsdp = max(c.memory_bytes for c in free.candidates if c.setting.strategy == "fsdp")
    tight = (full + fsdp) / 2 / 2**30
    rec = recommend(prof, cluster(tight, bw=1e6), settings())
    assert rec.best is not None and rec.best.setting.strategy not in ("single", "ddp")
    assert all(c.fits for c in rec.candidates[: rec.candidates.index(rec.best) + 1])
    assert "out of memory" in rec.why or all(not c.fits for c in rec.candidates if c.setting.strategy == "ddp")


def test_nothing_fits_names_the_smallest_shortfall():
    prof = make_profile(layer_params_bytes=(200 * MIB,) * 4)
    rec = recommend(prof, cluster(0.1), settings())
    assert rec.best is None
    assert rec.why.startswith("nothing fits")
    smallest = min(rec.candidates, key=lambda c: c.shortfall_bytes)
    assert smallest.label in rec.why and all(c.shortfall_bytes > 0 for c in rec.candidates)
    assert rec.to_dict()["recommended"] is None


def test_invalid_settings_are_listed_not_fatal():
    big = cluster(64).model_copy(update={"devices_per_node": 8})
    rec = recommend(make_profile(), big, candidate_settings(["gpipe", "ddp"], 8, 32, 3200, microbatches=4))
    reasons = {c.setting.strategy: c.invalid_reason for c in rec.candidates}
    assert reasons["ddp"] is None and "8 stages but the network has 4 layers" in reasons["gpipe"]
    assert rec.best.setting.strategy == "ddp" and rec.candidates[-1].setting.strategy == "gpipe"


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "ddlscope", *args], capture_output=True, text=True, cwd=cwd or REPO,
                          timeout=300)


@pytest.fixture(scope="module")
def profile_cache(tmp_path_factory, data_root):
    """tiny_cnn on MNIST at batch 16, profiled once for the CLI tests."""
    from ddlscope.profiling.profile import load_or_profile

    cache = tmp_path_factory.mktemp("profiles")
    load_or_profile("tiny_cnn", "mnist", 16, threads=1, loader_workers=(0,), data_root=data_root, cache_dir=cache)
    return cache


def test_recommend_cli_json(profile_cache):
    res = _cli("recommend", "--model", "tiny_cnn", "--dataset", "mnist", "--cluster", str(LOCAL), "--batch-size", "16",
               "--cache-dir", str(profile_cache), "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["recommended"] in {c["strategy"] for c in out["candidates"] if c["fits"]}
    # every registered model with a cost model is a candidate by default
    assert {c["strategy"] for c in out["candidates"]} == {m.name for m in distribution.all_models() if m.cost_model}
    assert {"single", "ddp", "fsdp", "gpipe", "1f1b", "collaborative"} <= {c["strategy"] for c in out["candidates"]}
    ddp = next(c for c in out["candidates"] if c["strategy"] == "ddp")
    assert ddp["reference_epoch_s"]["eq5.1"] > 0 and ddp["memory_bytes"] > 0
    # this cluster file has no hivemind calibration: the collaborative prediction's note says what that means
    assert [n for n in out["notes"] if "no hivemind fit" in n and "too fast" in n]


def test_recommend_cli_table_and_scaled_device(profile_cache):
    res = _cli("recommend", "--model", "tiny_cnn", "--dataset", "mnist", "--batch-size", "16",
               "--cluster", str(REPO / "ddlscope" / "examples" / "cluster-4xv100-nvlink.toml"), "--cache-dir", str(profile_cache))
    assert res.returncode == 0, res.stderr
    assert "recommended:" in res.stdout and "compute scaled" in res.stdout


@pytest.mark.parametrize("text, words", [
    ("[cluster]\nnodes = 1\n", ["device"]),
    ("[cluster]\ndevices_per_node = 2\n[cluster.device]\nkind = \"tpu-v9\"\n[cluster.intra_node]\n"
     "bandwidth_gb_per_s = 1\nlatency_s = 0\n", ["kind", "tpu-v9"]),
    ("[cluster]\ndevices_per_node = 2\n[cluster.device]\nkind = \"local\"\n[cluster.intra_node]\n"
     "bandwidth_gb_per_s = -1\nlatency_s = 0\n", ["bandwidth_gb_per_s"]),
])
def test_recommend_cli_bad_cluster_is_one_error_line(tmp_path, text, words):
    path = tmp_path / "c.toml"
    path.write_text(text)
    res = _cli("recommend", "--model", "tiny_cnn", "--dataset", "mnist", "--cluster", str(path))
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert all(w in res.stderr for w in words), res.stderr


def test_a_swarm_run_config_is_predicted_with_its_roles_links_and_churn():
    from ddlscope.config import load_config
    from ddlscope.distribution.collaborative import swarm_options
    from ddlscope.examples import resolve_example
    from ddlscope.modeling.links import over_links
    from ddlscope.modeling.prediction import predict

    cfg = load_config(resolve_example("examples/swarm-churn.toml"))
    opts = swarm_options(cfg)
    assert opts["auxiliary_peers"] == [3] and opts["run_s"] == 60 and [e["peer"] for e in opts["churn"]] == [1, 2]
    assert opts["progress_expiration_s"] == cfg.collaborative.progress_expiration_s
    cluster = over_links(ClusterSpec(name="t", nodes=1, devices_per_node=2, device=DeviceSpec(kind="local"),
                                     intra_node=LinkSpec(bandwidth_gb_per_s=1.0, latency_s=1e-5)),
                         [100.0, 100.0, 20.0, 100.0], 4)
    s, = candidate_settings(["collaborative"], 4, 32, 1000, model_options=opts)
    assert s.target_batch_size == 256 and s.options["churn"] == opts["churn"]
    p = predict(make_profile(), cluster, s)
    assert p.inputs["trainers"] == 3 and p.inputs["peer_roles"][3] == "auxiliary"
    # peer 2 joins at 10 s and trains once it computed the step the load discards and loaded the state over its
    # 20 Mbit/s link; peer 1 is killed at 20 s and trains again at 30 s plus its step and load
    load, step = p.inputs["state_load_s"], p.inputs["peer_step_s"]
    assert load[2] == pytest.approx(load[1] * 5)
    starts = [st["from_s"] for st in p.inputs["churn_stretches"]]
    assert starts == pytest.approx(sorted([0.0, 20.0, 10.0 + step[2] + load[2], 30.0 + step[1] + load[1]]))
    assert p.inputs["samples_lost_to_kills"] > 0
    stretches = p.inputs["churn_stretches"]
    trained = sum(st["samples"] for st in stretches) - p.inputs["samples_lost_to_kills"]
    assert p.inputs["samples_trained"] == pytest.approx(trained) and p.step_s == pytest.approx(60 * 256 / trained)
    # without the slow peer 2 (before it joined) the rounds are far shorter than with it
    assert stretches[0]["epoch_s"] < stretches[-1]["epoch_s"]
