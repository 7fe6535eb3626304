"""The torch-free modelling package (:mod:`ddlscope.modeling`): no torch, dispatch through the
registry, one vocabulary of step parts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ddlscope import distribution
from ddlscope.errors import UserError
from ddlscope.measure.parts import STEP_PARTS
from ddlscope.modeling.memory import predict_memory, setting_memory
from ddlscope.modeling.prediction import Setting, predict
from ddlscope.modeling.recommend import candidate_settings, fastest_that_fits, rank
from tests.test_costs import make_cluster, make_profile
from tests.test_dmoe_model import make_profile as make_moe_profile


def test_modeling_and_the_registry_import_without_torch():
    code = ("import pkgutil, importlib, sys, ddlscope.modeling as m\n"
            "for info in pkgutil.iter_modules(m.__path__):\n"
            "    importlib.import_module('ddlscope.modeling.' + info.name)\n"
            "from ddlscope import distribution\n"
            "distribution.all_models()\n"
            "print(sorted(n for n in ('torch', 'hivemind', 'matplotlib') if n in sys.modules))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


def predictable() -> list[distribution.DistributionModel]:
    return [m for m in distribution.all_models() if m.cost_model is not None]


@pytest.mark.parametrize("name", [m.name for m in predictable()])
def test_every_prediction_speaks_the_step_parts(name):
    cl = make_cluster(bw=0.5)
    (s,) = candidate_settings([name], 2, 32, 3200)
    prof = make_profile()
    try:
        predict(prof, cl, s)
    except UserError:  # a model that predicts only networks with a mixture-of-experts layer (dmoe)
        prof = make_moe_profile()
    p = predict(prof, cl, s)
    assert list(p.breakdown_s) == list(STEP_PARTS)  # every part, in order; 0 for those the model lacks
    assert sum(p.breakdown_s.values()) == pytest.approx(p.step_s)
    assert p.dominant_cost in STEP_PARTS and p.breakdown_s[p.dominant_cost] == max(p.breakdown_s.values())
    assert p.breakdown_s["forward_s"] > 0 and p.breakdown_s["backward_s"] > p.breakdown_s["forward_s"]
    assert len(setting_memory(prof, s)) == s.workers


def test_the_cost_model_is_the_registrys():
    prof, cl = make_profile(), make_cluster()
    s = Setting("ddp", 2, 8, epoch_samples=3200)
    assert predict(prof, cl, s).breakdown_s == distribution.get("ddp").cost_model(prof, cl, s, 1.0).breakdown_s


def test_shared_checks_name_the_field():
    prof, cl = make_profile(), make_cluster()
    with pytest.raises(UserError, match="epoch_samples = 0; allowed: an integer >= 1"):
        predict(prof, cl, Setting("ddp", 2, 8, epoch_samples=0))
    with pytest.raises(UserError, match="workers = 2: single runs on exactly 1 worker"):
        predict(prof, cl, Setting("single", 2, 8, epoch_samples=100))
    with pytest.raises(UserError, match="unknown distribution model 'ring'"):
        predict_memory(prof, "ring", 2, 8)
    # collaborative peers bring their own devices: more peers than the cluster's devices is fine
    assert predict(prof, make_cluster(devices=2), Setting("collaborative", 4, 8, epoch_samples=100)).step_s > 0


def test_pipeline_memory_and_cost_use_the_same_default_microbatches_and_cut():
    prof = make_profile()
    implicit = Setting("gpipe", 2, 32, epoch_samples=3200)
    explicit = Setting("gpipe", 2, 32, epoch_samples=3200, microbatches=distribution.pipeline.DEFAULT_MICROBATCHES)
    assert predict(prof, make_cluster(), implicit).step_s == predict(prof, make_cluster(), explicit).step_s
    assert setting_memory(prof, implicit) == setting_memory(prof, explicit)
    cut = Setting("gpipe", 2, 32, epoch_samples=3200, stage_bounds=[0, 1, 4])
    assert predict(prof, make_cluster(), cut).inputs["stage_bounds"] == [0, 1, 4]
    assert setting_memory(prof, cut)[0].notes.startswith("stage 0: layers 0..0")


def test_candidates_come_from_the_registry_rules():
    from ddlscope.distribution.collaborative import DEFAULT_MATCHMAKING_TIME_S

    by = {s.strategy: s for s in candidate_settings(list(distribution.names()), 4, 64, 1000)}
    assert set(by) == set(distribution.names())
    for name, s in by.items():  # every candidate trains the job's global batch per step
        assert s.global_batch_size == 64, name
    assert by["single"].workers == 1 and by["collaborative"].matchmaking_time_s == DEFAULT_MATCHMAKING_TIME_S
    assert Setting("collaborative", 2, 8, epoch_samples=1).matchmaking_time_s == DEFAULT_MATCHMAKING_TIME_S
    given = candidate_settings(["collaborative"], 4, 64, 1000, matchmaking_time_s=2.0)[0]
    assert given.matchmaking_time_s == 2.0
    with pytest.raises(UserError, match="unknown distribution model 'ring'"):
        candidate_settings(["ddp", "ring"], 2, 64, 1000)


def test_rank_puts_what_fits_first_then_the_fastest():
    items = [("a", 3.0, True), ("b", 1.0, False), ("c", 2.0, True), ("d", None, None), ("e", 0.5, None)]
    ranked = rank(items, lambda i: i[1], lambda i: i[2])
    assert [i[0] for i in ranked] == ["c", "a", "e", "b", "d"]
    assert fastest_that_fits(items, lambda i: i[1], lambda i: i[2])[0] == "c"
    assert fastest_that_fits(items[1:2], lambda i: i[1], lambda i: i[2]) is None
