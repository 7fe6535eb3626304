"""Config validation: every bad value gives one message naming the field and what is allowed."""

from __future__ import annotations

import pytest

from ddlscope.config import RunConfig, load_config, validate_config
from ddlscope.errors import UserError


@pytest.mark.parametrize(
    "values, must_mention",
    [
        (dict(batch_size=0), ["batch_size", "greater than or equal to 1"]),
        (dict(strategy="collaborative", peers=2, batch_size=32, collaborative=dict(target_batch_size=16)),
         ["target_batch_size", "allowed: >= 32"]),
        (dict(model="resnet9000"), ["model", "resnet9000", "resnet18"]),
        (dict(dataset="no-such-dataset"), ["dataset", "no-such-dataset", "digits"]),
        (dict(strategy="collaborative", peers=2, vcpus_per_peer=64), ["vcpus_per_peer", "cores"]),
        (dict(strategy="ring"), ["strategy", "single", "collaborative"]),
        (dict(strategy="single", peers=2), ["peers", "single"]),
        (dict(sample_budget=None), ["no stop condition"]),
        (dict(sample_budget=10, batch_size=32), ["sample_budget", ">= 32"]),
        (dict(target_accuracy=1.5), ["target_accuracy", "less than or equal to 1"]),
        (dict(bogus=1), ["bogus", "unknown field"]),
        (dict(collaborative=dict(matchmaking_time_s=0)), ["collaborative.matchmaking_time_s", "greater than 0"]),
    ],
)
def test_bad_values_name_the_field(values, must_mention):
    with pytest.raises(UserError) as err:
        validate_config(values)
    for text in must_mention:
        assert text in str(err.value), str(err.value)


def test_budget_splits_across_peers():
    cfg = RunConfig(strategy="collaborative", peers=2, batch_size=32, sample_budget=3200,
                    collaborative=dict(target_batch_size=64))
    assert cfg.max_steps_per_peer() == 50  # thesis 000: budget / (peers x batch size)
    assert RunConfig(batch_size=32, sample_budget=3200).max_steps_per_peer() == 100


def test_core_sets_are_disjoint_and_sized():
    cfg = RunConfig(strategy="collaborative", peers=2, vcpus_per_peer=2, collaborative=dict(target_batch_size=64))
    assert cfg.core_sets([0, 1, 2, 3, 4]) == [[0, 1], [2, 3]]
    with pytest.raises(UserError, match="needs 4 cores"):
        cfg.core_sets([0, 1, 2])


def test_target_accuracy_turns_on_periodic_eval():
    assert RunConfig(target_accuracy=0.9).eval_every_steps == 10


def test_toml_config_and_overrides(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[run]\nstrategy = "collaborative"\npeers = 2\nmodel = "tiny_cnn"\nbatch_size = 8\n'
                    '[collaborative]\ntarget_batch_size = 64\nuse_local_updates = true\n')
    cfg = load_config(path, {"batch_size": 4})
    assert (cfg.batch_size, cfg.collaborative.target_batch_size, cfg.collaborative.use_local_updates) == (4, 64, True)
    (tmp_path / "bad.toml").write_text("[run\n")
    with pytest.raises(UserError, match="not valid TOML"):
        load_config(tmp_path / "bad.toml")
    with pytest.raises(UserError, match="not found"):
        load_config(tmp_path / "missing.toml")
    (tmp_path / "extra.toml").write_text("[runn]\nx = 1\n")
    with pytest.raises(UserError, match="unknown table"):
        load_config(tmp_path / "extra.toml")
