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
    # one field of a table set on the command line keeps the file's other fields of that table
    cfg = load_config(path, {"collaborative": {"next_chunk_timeout_s": 5.0}})
    c = cfg.collaborative
    assert (c.next_chunk_timeout_s, c.target_batch_size, c.use_local_updates) == (5.0, 64, True)
    cfg = load_config(path, {"collaborative": {"target_batch_size": 32}, "network": {"emulate": False}})
    assert (cfg.collaborative.target_batch_size, cfg.collaborative.use_local_updates) == (32, True)
    (tmp_path / "bad.toml").write_text("[run\n")
    with pytest.raises(UserError, match="not valid TOML"):
        load_config(tmp_path / "bad.toml")
    with pytest.raises(UserError, match="not found"):
        load_config(tmp_path / "missing.toml")
    (tmp_path / "extra.toml").write_text("[runn]\nx = 1\n")
    with pytest.raises(UserError, match="unknown table"):
        load_config(tmp_path / "extra.toml")


# ---------------------------------------------------------------------- the registry seen from the CLI
def test_models_command_lists_every_registered_model_with_its_launcher():
    import json

    from typer.testing import CliRunner

    from ddlscope import distribution
    from ddlscope.cli import app

    listed = CliRunner().invoke(app, ["models", "--json"])
    assert listed.exit_code == 0, listed.output
    assert {r["name"]: r["launcher"] for r in json.loads(listed.output)} == \
        {m.name: m.launcher for m in distribution.all_models()}
    text = CliRunner().invoke(app, ["models"]).output.splitlines()
    for m in distribution.all_models():
        at = next(i for i, line in enumerate(text) if line.split()[:1] == [m.name])
        assert f"launcher {m.launcher}," in text[at + 1], (m.name, text[at:at + 2])


def test_peer_command_joins_only_a_swarm_model(tmp_path):
    from typer.testing import CliRunner

    from ddlscope import distribution
    from ddlscope.cli import app

    not_swarm = next(m.name for m in distribution.all_models() if m.launcher != "swarm")
    result = CliRunner().invoke(app, ["peer", "--run-id", "r", "--index", "0", "--peers", "2", "--initial-peers",
                                      "/ip4/127.0.0.1/tcp/1", "--strategy", not_swarm, "--db", str(tmp_path / "x.db")])
    assert isinstance(result.exception, UserError), result.output
    assert "joins a swarm" in str(result.exception) and "allowed: " + ", ".join(distribution.with_launcher("swarm")) \
        in str(result.exception)
    assert not (tmp_path / "x.db").exists()


def test_registry_attributes_used_by_launch_and_analysis():
    from pydantic import BaseModel

    from ddlscope import distribution

    assert distribution.baseline().name == "single"
    assert [m.name for m in distribution.all_models() if m.baseline] == ["single"]
    assert {m.name for m in distribution.all_models() if m.has_matchmaking} == \
        {m.name for m in distribution.all_models() if m.has_option("matchmaking_time_s")} >= {"collaborative"}
    for name in distribution.with_launcher("swarm"):  # the swarm launcher's protocol holds for every swarm model
        assert all(distribution.get(name).has_option(f) for f in distribution.SWARM_OPTIONS)

    class NoJoinTable(BaseModel):
        target_batch_size: int = 1

    with pytest.raises(ValueError, match="initial_peers, join_timeout_s"):
        distribution.DistributionModel(name="x", summary="s", strategy="x:X", launcher="swarm", measures="m",
                                       predicts="p", config_table="x", config_class=NoJoinTable)
    with pytest.raises(ValueError, match="already"):
        distribution.register(distribution.DistributionModel(name="another-baseline", summary="s", strategy="x:X",
                                                             launcher="process", measures="m", predicts="p",
                                                             baseline=True))
    assert "another-baseline" not in distribution.names()
