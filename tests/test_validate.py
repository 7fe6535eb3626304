"""``ddlscope validate``: grids, a predicted setting's run config, and the predictions stored next to real runs."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from ddlscope import distribution
from ddlscope.errors import UserError
from ddlscope.distribution.collaborative import DEFAULT_MATCHMAKING_TIME_S
from ddlscope.modeling.links import over_links
from ddlscope.network.emulated import BUCKET_MIN_BYTES
from ddlscope.experiments.validate import (ValidationGrid, load_grid, missing_fits, predicted_models, run_validation,
                                          validation_cell)
from ddlscope.modeling.prediction import Setting
from ddlscope.store.db import ResultsStore
from tests.test_costs import make_cluster, make_profile
from tests.test_experiments import fake_run_fn

REPO = Path(__file__).resolve().parents[1]
LOCAL = REPO / "ddlscope" / "examples" / "cluster-local-2cores.toml"


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "ddlscope", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=300)


def test_grid_defaults_to_every_model_with_a_cost_model_and_refuses_unknown_ones():
    # every model that trains the preset's networks (dmoe trains networks with a mixture-of-experts layer)
    assert load_grid("local").strategies == [m for m in predicted_models() if m != "dmoe"]
    assert set(predicted_models()) >= {"single", "ddp", "fsdp", "gpipe", "1f1b", "collaborative"}
    with pytest.raises(ValueError, match=r"unknown distribution model\(s\) \['horovod'\]"):
        ValidationGrid(datasets=["mnist"], networks=["tiny_cnn"], strategies=["horovod"])
    with pytest.raises(ValueError, match="keys must be distribution models"):
        ValidationGrid(datasets=["mnist"], networks=["tiny_cnn"], model_measured_batches={"horovod": 3})
    with pytest.raises(UserError, match="validation grid not found"):
        load_grid("no-such-grid.toml")


def test_a_grid_calibrates_the_fits_its_models_read_and_hivemind_with_its_one_network_at_its_batch_per_peer():
    from ddlscope.experiments.validate import GRID_SWARM_EPOCHS, calibration_options

    links = calibration_options(load_grid("links"))  # global batch 64 on 2 peers, collaborative in it
    assert links == {"hivemind": True, "dmoe": False, "matchmaking_time_s": load_grid("links").matchmaking_time_s,
                     "swarm_reference": ("mobilenet_v2", "mnist"), "swarm_batch_sizes": [32],
                     "swarm_epochs": GRID_SWARM_EPOCHS}
    assert GRID_SWARM_EPOCHS > 10  # the overshoot is a mean of whole steps: more epochs than calibrate's default
    local = calibration_options(load_grid("local"))  # three networks: one fit cannot be each one's
    assert local["hivemind"] and "swarm_reference" not in local
    moe = calibration_options(load_grid("moe-links"))
    assert moe["dmoe"] and not moe["hivemind"] and "swarm_reference" not in moe
    no_fit = calibration_options(ValidationGrid(datasets=["mnist"], networks=["tiny_cnn"], strategies=["ddp"]))
    assert not no_fit["hivemind"] and not no_fit["dmoe"] and "swarm_reference" not in no_fit


def test_collaborative_validation_runs_exclude_the_first_global_epoch(tmp_path):
    grid = load_grid("local")
    collab = Setting("collaborative", 2, 32, epoch_samples=60000, target_batch_size=128, matchmaking_time_s=1.0)
    cfg = validation_cell(grid, collab, "resnet18", "mnist", tmp_path).config
    # 2 warm-up batches, then 128 / (2 x 32) = 2 steps of the first global epoch, plus its overshoot step
    assert cfg.warmup_steps == grid.warmup_batches + 3
    measured = distribution.get("collaborative").measured_steps
    assert grid.measured_batches_by_model["collaborative"] == measured == 48
    assert cfg.sample_budget == (grid.warmup_batches + 3 + measured) * 32 * 2
    assert cfg.collaborative.target_batch_size == 128 and cfg.collaborative.averaging_timeout_s == grid.averaging_timeout_s
    assert cfg.collaborative.next_chunk_timeout_s is None  # hivemind's default unless the grid sets it
    # the links grid keeps the chunk timeout of a run at the default matchmaking time, not its own 1 s
    links = load_grid("links")
    assert links.matchmaking_time_s == 1.0 and links.next_chunk_timeout_s == DEFAULT_MATCHMAKING_TIME_S == 10.0
    assert validation_cell(links, collab, "mobilenet_v2", "mnist", tmp_path, mbit_per_s=[200.0, 20.0]).config \
        .collaborative.next_chunk_timeout_s == 10.0
    chunked = grid.model_copy(update={"next_chunk_timeout_s": 5.0})
    assert validation_cell(chunked, collab, "resnet18", "mnist", tmp_path).config.collaborative.next_chunk_timeout_s == 5.0
    ddp = validation_cell(grid, Setting("ddp", 2, 32, epoch_samples=60000), "resnet18", "mnist", tmp_path).config
    assert ddp.warmup_steps == grid.warmup_batches
    assert ddp.sample_budget == (grid.warmup_batches + grid.measured_batches) * 32 * 2
    pipe = validation_cell(grid, Setting("1f1b", 2, 64, epoch_samples=60000, microbatches=4), "resnet18", "mnist",
                           tmp_path, stage_bounds=[0, 5, 11]).config
    assert pipe.distributed.stage_bounds == [0, 5, 11] and pipe.distributed.microbatches == 4
    assert pipe.sample_budget == (grid.warmup_batches + grid.measured_batches) * 64  # the stages share one batch
    shorter = grid.model_copy(update={"model_measured_batches": {"collaborative": 5}})
    assert validation_cell(shorter, collab, "resnet18", "mnist", tmp_path).config.sample_budget == (2 + 3 + 5) * 64


def test_validation_stores_predictions_links_runs_and_resumes(tmp_path, monkeypatch):
    """Profiling stubbed, runs made by a stand-in: every prediction is stored (the recommended one
    marked), linked to its run and compared with its measurement; a second validation runs nothing."""
    import ddlscope.profiling.profile

    monkeypatch.setattr(ddlscope.profiling.profile, "load_or_profile", lambda *a, **k: make_profile())
    grid = ValidationGrid(name="v", datasets=["mnist"], networks=["tiny_cnn"], strategies=["single", "ddp"],
                          workers=2, batch_size=16, warmup_batches=1, measured_batches=2, threads_per_device=1,
                          synthetic_train_size=16)
    db = tmp_path / "r.db"
    run, calls = fake_run_fn(step_s=0.5)
    cells = run_validation(grid, make_cluster(), db, progress=False, run_fn=run)
    assert len(calls) == 2
    (cell,) = cells
    assert {o.strategy: o.status for o in cell.outcomes} == {"single": "completed", "ddp": "completed"}
    ddp = cell.outcome("ddp")
    assert ddp.measured_epoch_s == pytest.approx(0.5 * 60_000 / 16) and ddp.predicted_epoch_s > 0
    # the prediction and the run, part by part in one vocabulary
    assert ddp.measured_parts_s["forward_s"] == pytest.approx(0.125) and ddp.measured_parts_s["step_s"] == 0.5
    assert set(ddp.predicted_parts_s) <= set(ddp.measured_parts_s)
    with ResultsStore(db) as store:
        preds = store.predictions("v")
        assert all(p["run_id"] for p in preds)
        assert sum(json.loads(p["detail_json"])["recommended"] for p in preds) == 1
        assert {r["cell_key"] for r in store.runs("v")} == {p["cell_key"] for p in preds}
    again = run_validation(grid, make_cluster(), db, progress=False, run_fn=run)
    assert len(calls) == 2 and again[0].outcome("ddp").measured_epoch_s == ddp.measured_epoch_s
    not_run = run_validation(grid, make_cluster(), db, progress=False, run_real=False, run_fn=run)
    assert {o.status for o in not_run[0].outcomes} == {"not-run"}


def test_repeats_run_every_cell_again_interleaved_and_show_its_median_run(tmp_path, monkeypatch):
    """repeats = 3: every cell once, then again; a cell's figures are its median run's (the
    prediction linked to it), every completed repeat is kept for the spread, a failed repeat is
    named; a grid whose repeats grow runs only the new repeats."""
    import ddlscope.profiling.profile

    from ddlscope.predict.validation_report import cells_table, model_error_table, summarize

    monkeypatch.setattr(ddlscope.profiling.profile, "load_or_profile", lambda *a, **k: make_profile())
    grid = ValidationGrid(name="v", datasets=["mnist"], networks=["tiny_cnn"], strategies=["single", "ddp"],
                          workers=2, batch_size=16, warmup_batches=1, measured_batches=2, threads_per_device=1,
                          synthetic_train_size=16)
    db = tmp_path / "r.db"
    step_s = {"": 0.5, "-r2": 0.8, "-r3": 0.4}  # seconds per step of each repeat
    calls = []

    def run(cfg, *args, **kwargs):
        calls.append(cfg.run_label)
        suffix = next((k for k in ("-r2", "-r3") if cfg.run_label.endswith(k)), "")
        fail = {"single-tiny_cnn-mnist-1w-b16-r3"}
        return fake_run_fn(fail=fail, step_s=step_s[suffix])[0](cfg, *args, **kwargs)

    (one,) = run_validation(grid, make_cluster(), db, progress=False, run_fn=run)
    assert one.outcome("ddp").measured_repeats_epoch_s == [] and one.outcome("ddp").run_spread is None
    (cell,) = run_validation(grid.model_copy(update={"repeats": 3}), make_cluster(), db, progress=False, run_fn=run)
    base = ["ddp-tiny_cnn-mnist-2w-b16", "single-tiny_cnn-mnist-1w-b16"]
    assert calls == base + [k + r for r in ("-r2", "-r3") for k in base]  # the first runs were reused
    per_step_epoch = 60_000 / 16
    ddp = cell.outcome("ddp")
    assert ddp.measured_epoch_s == pytest.approx(0.5 * per_step_epoch)
    assert ddp.measured_repeats_epoch_s == pytest.approx([x * per_step_epoch for x in (0.5, 0.8, 0.4)])
    assert ddp.run_spread == pytest.approx((0.8 - 0.4) / 0.5) and ddp.reason is None
    single = cell.outcome("single")  # two completed: the faster of the middle two, and the failed repeat named
    assert single.status == "completed" and single.measured_epoch_s == pytest.approx(0.5 * per_step_epoch)
    assert single.reason.startswith("1 of 3 repeats did not complete: failed") and "boom" in single.reason
    with ResultsStore(db) as store:
        runs = {r["run_id"]: r["cell_key"] for r in store.runs("v")}
        linked = {p["strategy"]: runs[p["run_id"]] for p in store.predictions("v")}
    assert linked == {"ddp": base[0], "single": base[1]}  # the median runs
    rows = {r["model"]: r for r in cells_table([cell])}
    assert rows["ddp"]["runs"] == 3 and rows["ddp"]["run spread"] == "80.0 %" and rows["single"]["runs"] == 2
    spread = {r["prediction"]: r["run spread"] for r in model_error_table(summarize([cell]))}
    assert spread["ddp"] == "80.0 %" and spread["single"] == "46.2 %"  # 0.3 / 0.65
    with pytest.raises(ValueError, match="repeats"):
        ValidationGrid(datasets=["mnist"], networks=["tiny_cnn"], repeats=0)
    bad = _cli("validate", "tiny", "--repeats", "0", "--db", str(tmp_path / "cli.db"))
    assert bad.returncode == 2 and "--repeats" in bad.stderr and "greater than or equal to 1" in bad.stderr
    assert not (tmp_path / "cli.db").exists()


def test_profile_each_repeat_predicts_each_round_from_a_profile_taken_right_before_it(tmp_path, monkeypatch):
    """profile_each_repeat: round N is profiled (cached in profiles/repeat-N) after round N-1 ran,
    its runs are predicted from that profile and each prediction is stored under, and linked to,
    its own run; the cell shows its median run against that run's prediction."""
    import ddlscope.profiling.profile

    events = []
    per_sample_s = {"profiles": 1e-3, "repeat-2": 2e-3, "repeat-3": 3e-3}  # the machine slows down

    def profile(*args, cache_dir, refresh=False, **kwargs):
        events.append(f"profile {cache_dir.name}" + (" again" if refresh else ""))
        return make_profile(per_sample_s=per_sample_s[cache_dir.name])

    monkeypatch.setattr(ddlscope.profiling.profile, "load_or_profile", profile)
    grid = ValidationGrid(name="v", datasets=["mnist"], networks=["tiny_cnn"], strategies=["single", "ddp"],
                          workers=2, batch_size=16, warmup_batches=1, measured_batches=2, threads_per_device=1,
                          synthetic_train_size=16, repeats=3, profile_each_repeat=True)
    step_s = {"": 0.5, "-r2": 0.8, "-r3": 0.4}

    def run(cfg, *args, **kwargs):
        events.append(cfg.run_label)
        suffix = next((k for k in ("-r2", "-r3") if cfg.run_label.endswith(k)), "")
        return fake_run_fn(step_s=step_s[suffix])[0](cfg, *args, **kwargs)

    db = tmp_path / "r.db"
    (cell,) = run_validation(grid, make_cluster(), db, profile_dir=tmp_path / "profiles", progress=False, run_fn=run)
    base = ["ddp-tiny_cnn-mnist-2w-b16", "single-tiny_cnn-mnist-1w-b16"]
    assert [e.split(" ")[0] if e.startswith("profile") else e for e in events] == [
        "profile", *base, "profile", *[k + "-r2" for k in base], "profile", *[k + "-r3" for k in base]]
    assert events[0::3] == ["profile profiles", "profile repeat-2", "profile repeat-3"]
    ddp = cell.outcome("ddp")
    first, second, third = ddp.predicted_repeats_epoch_s  # in run order: profiles of 1, 2 and 3 ms per sample
    assert first < second < third
    assert ddp.predicted_epoch_s == first and ddp.measured_epoch_s == pytest.approx(0.5 * 60_000 / 16)
    with ResultsStore(db) as store:
        runs = {r["run_id"]: r["cell_key"] for r in store.runs("v")}
        linked = {p["cell_key"]: runs[p["run_id"]] for p in store.predictions("v")}
    assert linked == {k + r: k + r for k in base for r in ("", "-r2", "-r3")}  # each prediction with its own run
    # a re-render from the store profiles nothing new and runs nothing
    events.clear()
    (again,) = run_validation(grid, make_cluster(), db, profile_dir=tmp_path / "profiles", progress=False, run_fn=run)
    assert [e for e in events if not e.startswith("profile")] == []
    assert again.outcome("ddp").predicted_repeats_epoch_s == ddp.predicted_repeats_epoch_s
    # predicting alone (--predict-only) profiles once: rounds mean something only where runs follow
    events.clear()
    run_validation(grid, make_cluster(), tmp_path / "p.db", profile_dir=tmp_path / "profiles", progress=False,
                   run_real=False)
    assert events == ["profile profiles"]
    # --rerun runs every round again, each after a profile measured anew
    events.clear()
    run_validation(grid, make_cluster(), db, profile_dir=tmp_path / "profiles", progress=False, run_fn=run, rerun=True)
    assert events[0::3] == ["profile profiles again", "profile repeat-2 again", "profile repeat-3 again"]


def _validate_links(tmp_path, monkeypatch, strategies, rerun=False, network="tiny_cnn", **grid_fields):
    """run_validation of ``network`` with a stand-in profile and runs: (cells, {run label: run config})."""
    import ddlscope.profiling.profile

    monkeypatch.setattr(ddlscope.profiling.profile, "load_or_profile", lambda *a, **k: make_profile())
    grid = ValidationGrid(name="v", datasets=["mnist"], networks=[network], strategies=strategies,
                          workers=2, batch_size=16, warmup_batches=1, measured_batches=2, threads_per_device=1,
                          synthetic_train_size=16, **grid_fields)
    fake, _ = fake_run_fn(step_s=0.5)
    configs = {}

    def run(cfg, *args, **kwargs):
        configs[cfg.run_label] = cfg
        return fake(cfg, *args, **kwargs)

    return run_validation(grid, make_cluster(), tmp_path / "r.db", progress=False, run_fn=run, rerun=rerun), configs


def test_link_rates_add_emulated_cells_predicted_over_those_links(tmp_path, monkeypatch):
    (loopback, emulated), configs = _validate_links(tmp_path, monkeypatch, ["ddp", "collaborative", "dmoe"],
                                                    network="moe_cnn", bandwidths_mbit_per_s=[10.0])
    assert [o.strategy for o in loopback.outcomes] == ["ddp", "collaborative", "dmoe"]
    # every model but single runs on emulated links (dmoe's expert servers in namespaces of their own)
    assert emulated.network == "moe_cnn @ 10 Mbit/s" and [o.strategy for o in emulated.outcomes] == \
        ["ddp", "collaborative", "dmoe"]
    # 10 Mbit/s makes the averaging round and the all-reduce dearer than loopback's link
    assert emulated.outcome("collaborative").predicted_parts_s["averaging_s"] > \
        loopback.outcome("collaborative").predicted_parts_s["averaging_s"]
    assert emulated.outcome("ddp").predicted_parts_s["comm_wait_s"] > loopback.outcome("ddp").predicted_parts_s["comm_wait_s"]
    keys = [k for k in configs if k.endswith("-10mbit")]
    assert len(keys) == 3 and all(configs[k].network.emulate and configs[k].network.bandwidth_mbit_per_s == 10.0
                                  for k in keys)
    assert not any(c.network.emulate for k, c in configs.items() if k not in keys)
    with pytest.raises(ValueError, match="rates in Mbit/s, > 0"):
        ValidationGrid(datasets=["mnist"], networks=["tiny_cnn"], bandwidths_mbit_per_s=[0.0])


def test_a_grids_bucket_reaches_its_emulated_cells(tmp_path, monkeypatch):
    from ddlscope.network.emulated import BUCKET_MS

    _, configs = _validate_links(tmp_path, monkeypatch, ["ddp"], bandwidths_mbit_per_s=[10.0], bucket_ms=1.0)
    emulated = [c for c in configs.values() if c.network.emulate]
    assert emulated and all(c.network.bucket_ms == 1.0 for c in emulated)
    _, configs = _validate_links(tmp_path / "default", monkeypatch, ["ddp"], bandwidths_mbit_per_s=[10.0])
    assert all(c.network.bucket_ms == BUCKET_MS for c in configs.values() if c.network.emulate)


def test_a_rerender_predicts_stored_runs_at_the_link_share_measured_before_them(tmp_path, monkeypatch):
    from ddlscope.experiments.validate import _stored_link_goodputs

    (first,), _ = _validate_links(tmp_path, monkeypatch, ["ddp"], bandwidths_mbit_per_s=[10.0], loopback=False)
    db = tmp_path / "r.db"
    assert first.link_goodput == 1.0 and _stored_link_goodputs(db, "v") == {("10 Mbit/s", "tiny_cnn", "mnist", 0): 1.0}
    assert _stored_link_goodputs(tmp_path / "none.db", "v") == {}
    with ResultsStore(db) as store:  # as if the links had carried 0.8 of their rate when the runs were made
        (pred,) = store.predictions("v")
        detail = json.loads(pred["detail_json"])
        assert detail["link"] == "10 Mbit/s"
        store.conn.execute("UPDATE predictions SET detail_json = ? WHERE prediction_id = ?",
                           (json.dumps({**detail, "link_goodput": 0.8}), pred["prediction_id"]))
        store.conn.commit()
    (again,), _ = _validate_links(tmp_path, monkeypatch, ["ddp"], bandwidths_mbit_per_s=[10.0], loopback=False)
    assert again.link_goodput == 0.8
    assert again.outcome("ddp").predicted_parts_s["comm_wait_s"] == pytest.approx(
        first.outcome("ddp").predicted_parts_s["comm_wait_s"] / 0.8, rel=0.05)
    (rerun,), _ = _validate_links(tmp_path, monkeypatch, ["ddp"], bandwidths_mbit_per_s=[10.0], loopback=False, rerun=True)
    assert rerun.link_goodput == 1.0  # measured again (runs stood in for: the full rate)


def test_hivemind_rounds_share_is_measured_before_each_round_and_read_back_per_round(tmp_path, monkeypatch):
    """A grid with a round per repeat probes hivemind's averaging rounds before each round (the TCP
    share once); a re-render predicts each round's runs at the share stored with them."""
    import ddlscope.experiments.validate as validate

    readings = iter([0.7, 0.75, 0.8])
    monkeypatch.setattr(validate, "averaging_goodput", lambda mbit, workers, param_bytes: next(readings))
    grid = ValidationGrid(name="v", datasets=["mnist"], networks=["tiny_cnn"], strategies=["collaborative"],
                          bandwidths_mbit_per_s=[10.0], loopback=False, repeats=3, profile_each_repeat=True)
    links = validate._Links(grid, tmp_path / "none.db", measure=True, rerun=False, progress=False)
    assert [links.averaging(10.0, 1e6, r) for r in (0, 1, 2, 1)] == [0.7, 0.75, 0.8, 0.75]  # once per round
    assert validate.ValidationGrid.model_fields["hivemind_each_repeat"].default is False  # opt-in (stop 41)
    # stored runs: each round's predictions made at their own share, predicted again at it
    fields = dict(bandwidths_mbit_per_s=[10.0], loopback=False, repeats=3, profile_each_repeat=True,
                  hivemind_each_repeat=True)
    (first,), _ = _validate_links(tmp_path, monkeypatch, ["collaborative"], **fields)
    assert first.averaging_goodput is None and first.averaging_goodput_rounds == []  # stand-in runs: not probed
    with ResultsStore(tmp_path / "r.db") as store:
        for pred in store.predictions("v"):
            share = {"-r2": 0.6, "-r3": 0.3}.get(pred["cell_key"][-3:], 0.9)  # round 1's key has no suffix
            detail = {**json.loads(pred["detail_json"]), "averaging_goodput": share}
            store.conn.execute("UPDATE predictions SET detail_json = ? WHERE prediction_id = ?",
                               (json.dumps(detail), pred["prediction_id"]))
        store.conn.commit()
    (again,), _ = _validate_links(tmp_path, monkeypatch, ["collaborative"], **fields)
    assert again.averaging_goodput == 0.9 and again.averaging_goodput_rounds == [0.9, 0.6, 0.3]
    slower = again.outcome("collaborative").predicted_repeats_epoch_s
    assert slower[0] < slower[1] < slower[2]  # the rounds' averaging at 0.9, 0.6 and 0.3 of the link
    (one,), _ = _validate_links(tmp_path, monkeypatch, ["collaborative"], **{**fields, "hivemind_each_repeat": False})
    assert one.averaging_goodput_rounds == []  # one probe per link: the first round's serves them all
    assert len(set(one.outcome("collaborative").predicted_repeats_epoch_s)) == 1


def test_uneven_links_give_each_worker_its_rate_and_loopback_can_be_left_out(tmp_path, monkeypatch):
    (uneven, even), configs = _validate_links(tmp_path, monkeypatch, ["ddp", "collaborative"],
                                              bandwidths_mbit_per_s=[[100.0, 10.0], 100.0], loopback=False)
    assert (uneven.link, even.link) == ("100/10 Mbit/s", "100 Mbit/s") and uneven.network == "tiny_cnn @ 100/10 Mbit/s"
    assert sorted(configs) == sorted(f"{m}-tiny_cnn-mnist-2w-b{b}-{link}" for m, b in (("ddp", 16), ("collaborative", 16))
                                     for link in ("100+10mbit", "100mbit"))
    cfg = configs["ddp-tiny_cnn-mnist-2w-b16-100+10mbit"]
    assert cfg.network.rates(2) == [(100.0, 100.0), (10.0, 10.0)]
    # the ring is as fast as its slowest link: the uneven pair predicts like 10 Mbit/s links, slower than 100
    assert uneven.outcome("ddp").predicted_parts_s["comm_wait_s"] > even.outcome("ddp").predicted_parts_s["comm_wait_s"]
    cl = over_links(make_cluster(), [100.0, 10.0], 2)
    assert [p.bandwidth_gb_per_s for p in cl.peers] == [100 / 8e3, 10 / 8e3]
    assert cl.intra_node.bandwidth_gb_per_s == 10 / 8e3
    # collectives' links at what they carry with both ways busy; the pipelines' point-to-point link at the rate
    busy = over_links(make_cluster(), [100.0, 10.0], 2, both_ways=0.8)
    assert busy.intra_node.bandwidth_gb_per_s == pytest.approx(8 / 8e3) and busy.p2p_link.bandwidth_gb_per_s == 10 / 8e3
    assert [p.bandwidth_gb_per_s for p in busy.peers] == pytest.approx([80 / 8e3, 8 / 8e3])
    with pytest.raises(ValueError, match="allowed"):
        over_links(make_cluster(), 10.0, 2, both_ways=0.0)
    # hivemind's rounds at what they reached on these links: the efficiency is relative to the peers' (TCP) share
    rounds = over_links(make_cluster(), [100.0, 10.0], 2, both_ways=0.8, averaging_share=0.6)
    assert rounds.averaging_efficiency == pytest.approx(0.75) and rounds.peers == busy.peers
    assert over_links(make_cluster(), 10.0, 2, both_ways=0.8, averaging_share=0.9).averaging_efficiency == 1.0
    assert busy.averaging_efficiency == 1.0  # not measured: the cluster's
    with pytest.raises(ValueError, match="averaging_share = 1.5"):
        over_links(make_cluster(), 10.0, 2, averaging_share=1.5)
    # fsdp's collectives at what gloo's unit collectives reached: a share of the slowest link's rate
    gloo = over_links(make_cluster(), [100.0, 10.0], 2, both_ways=0.8, fsdp_share=0.7)
    assert gloo.fsdp_link.bandwidth_gb_per_s == pytest.approx(7 / 8e3) and busy.fsdp_link is None
    with pytest.raises(ValueError, match="fsdp_share = 0"):
        over_links(make_cluster(), 10.0, 2, fsdp_share=0.0)
    # the pipelines' link keeps tbf's bucket: bucket_ms at the slower rate (10 ms at 10 Mbit/s: 12,500 bytes), at
    # least the smallest bucket tbf is given; the collectives' links do not (their shares are measured on the links)
    assert busy.p2p_link.burst_bytes == pytest.approx(12_500) and busy.p2p_link.burst_s == pytest.approx(0.010)
    assert busy.intra_node.burst_bytes == 0
    assert over_links(make_cluster(), 10.0, 2, bucket_ms=0.1).p2p_link.burst_bytes == BUCKET_MIN_BYTES
    assert over_links(make_cluster(), 10.0, 2, bucket_ms=None).p2p_link.burst_bytes == 0
    with pytest.raises(ValueError, match="bucket_ms = 0"):
        over_links(make_cluster(), 10.0, 2, bucket_ms=0.0)
    with pytest.raises(ValueError, match="one rate per worker"):
        ValidationGrid(datasets=["mnist"], networks=["tiny_cnn"], workers=2, bandwidths_mbit_per_s=[[1.0, 2.0, 3.0]])
    with pytest.raises(ValueError, match="leaves no cell"):
        ValidationGrid(datasets=["mnist"], networks=["tiny_cnn"], loopback=False)


def test_a_cluster_file_without_the_fits_the_grid_s_models_read_is_named_with_them():
    grid = ValidationGrid(datasets=["mnist"], networks=["tiny_cnn"], strategies=["ddp", "collaborative", "diloco"])
    bare = make_cluster()
    line = missing_fits(grid, bare, "here.toml")
    assert line.startswith("the cluster file here.toml has no hivemind fit, which collaborative reads:")
    assert "`ddlscope calibrate --hivemind --out FILE`" in line and "dmoe" not in line
    assert missing_fits(grid.model_copy(update={"strategies": ["ddp", "fsdp"]}), bare, "here.toml") is None
    with_fit = bare.model_copy(update={"hivemind": object()})  # any fit: only its presence is asked
    assert missing_fits(grid, with_fit, "here.toml") is None
    moe = ValidationGrid(datasets=["mnist"], networks=["moe_cnn"], strategies=["dmoe", "collaborative"])
    assert "no hivemind fit, which collaborative reads; no dmoe fit, which dmoe reads" in missing_fits(moe, bare, "c")
    assert "`ddlscope calibrate --hivemind --dmoe --out FILE`" in missing_fits(moe, bare, "c")


@pytest.mark.slow
def test_validate_tiny_stores_predictions_next_to_real_runs(tmp_path):
    db = tmp_path / "r" / "ddlscope.db"
    res = _cli("validate", "tiny", "--cluster", str(LOCAL), "--db", str(db), "--no-progress")
    assert res.returncode == 0, res.stderr[-3000:]
    conn = sqlite3.connect(db)
    rows = conn.execute("SELECT p.strategy, p.predicted_epoch_s, r.status FROM predictions p "
                        "JOIN runs r ON r.run_id = p.run_id").fetchall()
    assert sorted(r[0] for r in rows) == ["ddp", "gpipe", "single"]
    assert all(r[1] > 0 and r[2] == "completed" for r in rows)
    # the pipeline ran the cut that was predicted for it
    (detail, cut), = conn.execute(
        "SELECT p.detail_json, e.detail_json FROM predictions p JOIN events e ON e.run_id = p.run_id "
        "WHERE p.strategy = 'gpipe' AND e.kind = 'strategy_details' AND e.worker_index = 0").fetchall()
    assert json.loads(cut)["stage_bounds"] == json.loads(detail)["inputs"]["stage_bounds"]
    report = json.loads((db.parent / "validation" / "validation-tiny" / "validation.json").read_text())
    assert len(report["cells"]) == 1
    # a second validation reuses the completed runs
    again = _cli("validate", "tiny", "--cluster", str(LOCAL), "--db", str(db), "--no-progress")
    assert again.returncode == 0
    assert conn.execute("SELECT COUNT(*) FROM runs").fetchone()[0] == 3


@pytest.mark.parametrize("flag, rerun, each, hivemind, per_workload", [
    ([], False, False, False, True), (["--rerun"], True, False, False, True),
    (["links", "--profile-each-repeat"], False, True, False, True), (["links", "--one-profile"], False, False, False, True),
    (["links"], False, True, False, True), (["links", "--one-hivemind-fit"], False, True, False, True),
    (["links", "--hivemind-each-repeat"], False, True, True, True), (["--one-hivemind-fit-for-all"], False, False, False, False),
    (["--hivemind-per-workload"], False, False, False, True)])
def test_validate_cli_hands_rerun_to_the_runs(tmp_path, monkeypatch, flag, rerun, each, hivemind, per_workload):
    """``--rerun`` reaches :func:`run_validation` (which hands it to ``run_cells``: every cell runs again,
    tests/test_experiments.py); without it, stored runs are reused (the real test above). The grid's
    ``profile_each_repeat`` (the ``links`` preset's True) is overridden by ``--profile-each-repeat`` /
    ``--one-profile``, its ``hivemind_each_repeat`` by ``--hivemind-each-repeat`` / ``--one-hivemind-fit``, its
    ``hivemind_per_workload`` by ``--hivemind-per-workload`` / ``--one-hivemind-fit-for-all``."""
    from typer.testing import CliRunner

    from ddlscope.cli import app

    seen = {}

    def validation(spec, cluster, db_path, **kwargs):  # stops where a user's Ctrl-C would, before any cell
        seen.update(kwargs, grid=spec)
        raise KeyboardInterrupt

    monkeypatch.setattr("ddlscope.experiments.validate.run_validation", validation)
    grid = [] if flag and flag[0] == "links" else ["tiny"]
    result = CliRunner().invoke(app, ["validate", *grid, *flag, "--cluster", str(LOCAL), "--db",
                                      str(tmp_path / "r.db"), "--no-progress"])
    assert result.exit_code == 130, result.output
    # the example cluster file has no hivemind fit: the links grid's collaborative is warned of first
    assert ("warning: the cluster file" in result.output) is bool(flag and flag[0] == "links"), result.output
    assert seen["rerun"] is rerun and seen["run_real"] is True and seen["grid"].profile_each_repeat is each
    assert seen["grid"].hivemind_each_repeat is hivemind and seen["grid"].hivemind_per_workload is per_workload


def test_each_round_measures_hivemind_again_and_predicts_its_swarm_cells_with_that_fit(tmp_path, monkeypatch):
    """profile_each_repeat with a hivemind model: before each round the hivemind fit is measured
    again (cached next to the round's profile), that round's collaborative prediction reads it,
    the cell lists every round's fit, and a re-render reads the cached fits; a round whose swarms
    fail keeps the cluster's fit and says why."""
    import ddlscope.profiling.calibrate
    import ddlscope.profiling.profile
    from ddlscope.modeling.cluster import HivemindFit
    from ddlscope.profiling.calibrate import CalibrationError

    monkeypatch.setattr(ddlscope.profiling.profile, "load_or_profile", lambda *a, **k: make_profile())
    overhead_s = {"profiles": 2.0, "repeat-2": 1.5, "repeat-3": None}  # round 3's swarms fail
    calls = []

    def measure(cache_dir, refresh=False, **options):
        calls.append((cache_dir.name, refresh, options["swarm_reference"], options["swarm_batch_sizes"]))
        if overhead_s[cache_dir.name] is None:
            raise CalibrationError("calibration worker 1 failed: boom")
        return HivemindFit(epoch_overhead_s=overhead_s[cache_dir.name], overshoot_steps=0.3), False

    monkeypatch.setattr(ddlscope.profiling.calibrate, "load_or_calibrate_hivemind", measure)
    grid = ValidationGrid(name="v", datasets=["mnist"], networks=["tiny_cnn"], strategies=["collaborative", "ddp"],
                          workers=2, batch_size=16, warmup_batches=1, measured_batches=2, threads_per_device=1,
                          synthetic_train_size=16, repeats=3, profile_each_repeat=True, target_batch_size=32,
                          hivemind_each_repeat=True)
    cluster = make_cluster().model_copy(update={"hivemind": HivemindFit(epoch_overhead_s=9.0)})
    run, _ = fake_run_fn(step_s=0.5)
    db = tmp_path / "r.db"
    (cell,) = run_validation(grid, cluster, db, profile_dir=tmp_path / "profiles", progress=False, run_fn=run)
    assert calls == [(name, False, ("tiny_cnn", "mnist"), [8]) for name in ("profiles", "repeat-2", "repeat-3")]
    assert [(f["round"], f["epoch_overhead_s"]) for f in cell.hivemind_fits] == [(1, 2.0), (2, 1.5), (3, 9.0)]
    assert [f["measured"] for f in cell.hivemind_fits][:2] == ["now", "now"]
    assert "kept the cluster's fit" in cell.hivemind_fits[2]["measured"] and "boom" in cell.hivemind_fits[2]["measured"]
    with ResultsStore(db) as store:
        read = {p["cell_key"]: json.loads(p["detail_json"])["inputs"]["hivemind_epoch_overhead_s"]
                for p in store.predictions("v") if p["strategy"] == "collaborative"}
    base = min(read)
    assert read == {base: 2.0, base + "-r2": 1.5, base + "-r3": 9.0}  # each round's runs, predicted with its fit
    # without a hivemind fit in the cluster, or without a model that averages with hivemind, nothing is measured
    calls.clear()
    run_validation(grid, make_cluster(), tmp_path / "b.db", profile_dir=tmp_path / "p2", progress=False, run_fn=run)
    run_validation(grid.model_copy(update={"strategies": ["ddp"]}), cluster, tmp_path / "c.db",
                   profile_dir=tmp_path / "p3", progress=False, run_fn=run)
    assert calls == []
    # hivemind_each_repeat off: every round predicted with the cluster's fit, nothing measured
    calls.clear()
    (kept,) = run_validation(grid.model_copy(update={"hivemind_each_repeat": False}), cluster, tmp_path / "d.db",
                             profile_dir=tmp_path / "p4", progress=False, run_fn=run)
    assert calls == [] and kept.hivemind_fits == []
    # --rerun measures every round's fit again
    overhead_s["repeat-3"] = 1.0
    run_validation(grid, cluster, db, profile_dir=tmp_path / "profiles", progress=False, run_fn=run, rerun=True)
    assert [c[:2] for c in calls] == [("profiles", True), ("repeat-2", True), ("repeat-3", True)]


@pytest.mark.slow
def test_a_grid_of_several_workloads_predicts_each_one_s_swarm_cells_from_its_own_hivemind_fit(tmp_path, monkeypatch):
    """hivemind_per_workload: a fit per network and dataset at the grid's batch per peer, kept with the
    profiles, read back on a re-render; each workload's collaborative cells predicted with its own fit,
    the other models untouched; a workload whose swarms fail keeps the cluster's fit and says why."""
    import ddlscope.profiling.calibrate
    import ddlscope.profiling.profile
    from ddlscope.experiments.validate import GRID_SWARM_EPOCHS, fits_per_workload
    from ddlscope.modeling.cluster import HivemindFit
    from ddlscope.profiling.calibrate import CalibrationError

    monkeypatch.setattr(ddlscope.profiling.profile, "load_or_profile", lambda *a, **k: make_profile())
    overhead_s = {"tiny_cnn": 2.0, "mlp": 5.0, "moe_cnn": None}  # moe_cnn's swarms fail
    calls, kept = [], {}

    def measure(cache_dir, refresh=False, **options):
        calls.append((cache_dir.name, refresh, options))
        if cache_dir in kept and not refresh:
            return kept[cache_dir], True
        net = options["swarm_reference"][0]
        if overhead_s[net] is None:
            raise CalibrationError("calibration worker 1 failed: boom")
        kept[cache_dir] = HivemindFit(epoch_overhead_s=overhead_s[net], compute_overhead_s=0.1, overshoot_steps=0.3)
        return kept[cache_dir], False

    monkeypatch.setattr(ddlscope.profiling.calibrate, "load_or_calibrate_hivemind", measure)
    grid = ValidationGrid(name="v", datasets=["mnist"], networks=["tiny_cnn", "mlp", "moe_cnn"],
                          strategies=["collaborative", "ddp"], workers=2, batch_size=16, warmup_batches=1,
                          measured_batches=2, threads_per_device=1, synthetic_train_size=16, target_batch_size=32)
    assert grid.hivemind_per_workload and fits_per_workload(grid)
    cluster = make_cluster().model_copy(update={"hivemind": HivemindFit(epoch_overhead_s=9.0)})
    run, _ = fake_run_fn(step_s=0.5)
    db = tmp_path / "r.db"
    cells = run_validation(grid, cluster, db, profile_dir=tmp_path / "profiles", progress=False, run_fn=run)
    assert [(c[0], c[1]) for c in calls] == [(f"hivemind-{n}-mnist", False) for n in ("tiny_cnn", "mlp", "moe_cnn")]
    assert all(c[2] == {"workers": 2, "threads": 1, "matchmaking_time_s": grid.matchmaking_time_s,
                        "swarm_reference": (c[0].split("-")[1], "mnist"), "swarm_batch_sizes": [8],
                        "swarm_epochs": GRID_SWARM_EPOCHS, "progress": None} for c in calls), calls
    by_net = {c.network: c for c in cells}
    assert [(f["workload"], f["epoch_overhead_s"], f["measured"]) for f in by_net["mlp"].hivemind_fits] == \
        [("mlp on mnist", 5.0, "now")]  # each cell lists its own workload's fit
    failed = by_net["moe_cnn"].hivemind_fits[0]
    assert failed["epoch_overhead_s"] == 9.0 and "kept the cluster's fit" in failed["measured"] and "boom" in failed["measured"]
    with ResultsStore(db) as store:
        read = {(p["cell_key"].split("-")[1], p["strategy"]): json.loads(p["detail_json"])["inputs"]
                for p in store.predictions("v")}
    assert {net: read[(net, "collaborative")]["hivemind_epoch_overhead_s"] for net in overhead_s} == \
        {"tiny_cnn": 2.0, "mlp": 5.0, "moe_cnn": 9.0}
    assert read[("tiny_cnn", "ddp")] == read[("mlp", "ddp")]  # the same profile: ddp reads no hivemind fit
    # a re-render reads the kept fits; --rerun measures them again
    calls.clear()
    run_validation(grid, cluster, db, profile_dir=tmp_path / "profiles", progress=False, run_fn=run)
    assert [c[1] for c in calls] == [False] * 3
    calls.clear()
    run_validation(grid, cluster, db, profile_dir=tmp_path / "profiles", progress=False, run_fn=run, rerun=True)
    assert [c[1] for c in calls] == [True] * 3
    # off, one workload, no model that averages with hivemind, or no fit in the cluster: nothing measured
    calls.clear()
    for other, at in ((grid.model_copy(update={"hivemind_per_workload": False}), cluster),
                      (grid.model_copy(update={"networks": ["tiny_cnn"]}), cluster),
                      (grid.model_copy(update={"strategies": ["ddp"]}), cluster), (grid, make_cluster())):
        run_validation(other, at, tmp_path / "o.db", profile_dir=tmp_path / "o", progress=False, run_fn=run)
    assert calls == []
    assert not fits_per_workload(grid.model_copy(update={"networks": ["tiny_cnn"]}))


def test_validate_stopped_by_sigterm_says_so_and_leaves_no_process(tmp_path):
    """SIGTERM stops a validation as Ctrl-C does: the running step unwinds (its processes stopped,
    its temporary folders removed), the command says how to resume and exits 130."""
    import signal
    import time

    import psutil

    proc = subprocess.Popen([sys.executable, "-m", "ddlscope", "validate", "tiny", "--cluster", str(LOCAL), "--db",
                             str(tmp_path / "r.db")], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 120
    while not (tmp_path / "profiles").exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)  # it has started profiling
    children = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted: finished cells are stored; run the same command again to resume" in err
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]


def test_fsdp_collectives_share_is_measured_once_per_link_and_read_back(tmp_path, monkeypatch):
    """fsdp's unit collectives are probed once per link entry at the profile's unit sizes, only for a grid
    with fsdp and real runs; a re-render predicts the stored runs at the share stored with them."""
    import ddlscope.experiments.validate as validate

    calls = []
    monkeypatch.setattr(validate, "fsdp_goodput", lambda mbit, workers, units, bucket_ms: calls.append(units) or 0.7)
    grid = ValidationGrid(name="v", datasets=["mnist"], networks=["tiny_cnn"], strategies=["fsdp"],
                          bandwidths_mbit_per_s=[10.0], loopback=False)
    links = validate._Links(grid, tmp_path / "none.db", measure=True, rerun=False, progress=False)
    assert [links.fsdp(10.0, [4, 8]) for _ in range(2)] == [0.7, 0.7] and calls == [[4, 8]]
    assert validate._Links(grid, tmp_path / "none.db", measure=False, rerun=False, progress=False).fsdp(10.0, [4]) is None
    (first,), _ = _validate_links(tmp_path, monkeypatch, ["fsdp"], bandwidths_mbit_per_s=[10.0], loopback=False)
    assert first.fsdp_goodput is None and calls == [[4, 8]]  # stand-in runs: not probed
    with ResultsStore(tmp_path / "r.db") as store:
        (pred,) = store.predictions("v")
        detail = json.loads(pred["detail_json"])
        assert "fsdp_goodput" in detail
        store.conn.execute("UPDATE predictions SET detail_json = ? WHERE prediction_id = ?",
                           (json.dumps({**detail, "fsdp_goodput": 0.5}), pred["prediction_id"]))
        store.conn.commit()
    (again,), _ = _validate_links(tmp_path, monkeypatch, ["fsdp"], bandwidths_mbit_per_s=[10.0], loopback=False)
    assert again.fsdp_goodput == 0.5 and calls == [[4, 8]]
    (ddp,), _ = _validate_links(tmp_path / "ddp", monkeypatch, ["ddp"], bandwidths_mbit_per_s=[10.0], loopback=False)
    assert ddp.fsdp_goodput is None  # no fsdp cell: nothing to probe


def test_workload_shares_are_kept_per_network_and_read_back_per_network(tmp_path, monkeypatch):
    """fsdp's and hivemind's shares depend on the workload's sizes: each network of a grid is probed
    at its own and reads back its own; a prediction stored before shares were kept per network
    stands for any."""
    import ddlscope.experiments.validate as validate

    readings = iter([0.6, 0.7, 0.8, 0.9])
    monkeypatch.setattr(validate, "fsdp_goodput", lambda mbit, workers, units, bucket_ms: next(readings))
    monkeypatch.setattr(validate, "averaging_goodput", lambda mbit, workers, param_bytes: next(readings))
    grid = ValidationGrid(name="v", datasets=["mnist"], networks=["tiny_cnn", "mlp"], strategies=["fsdp", "collaborative"],
                          bandwidths_mbit_per_s=[10.0], loopback=False)
    links = validate._Links(grid, tmp_path / "none.db", measure=True, rerun=False, progress=False)
    assert links.fsdp(10.0, [4], ("tiny_cnn", "mnist")) == 0.6 and links.fsdp(10.0, [8], ("mlp", "mnist")) == 0.7
    assert links.averaging(10.0, 1e6, 0, ("tiny_cnn", "mnist")) == 0.8
    assert links.averaging(10.0, 2e6, 0, ("mlp", "mnist")) == 0.9
    assert links.fsdp(10.0, [4], ("tiny_cnn", "mnist")) == 0.6  # once per network
    db = tmp_path / "r.db"
    with ResultsStore(db) as store:
        for net, share in (("tiny_cnn", 0.5), ("mlp", 0.4)):
            store.add_prediction(f"fsdp-{net}-mnist-2w-b16-10mbit", "fsdp", 2, 16, group_name="v",
                                 detail={"link": "10 Mbit/s", "network": net, "dataset": "mnist", "fsdp_goodput": share})
        store.add_prediction("collaborative-tiny_cnn-mnist-2w-b16-10mbit", "collaborative", 2, 16, group_name="v",
                             detail={"link": "10 Mbit/s", "averaging_goodput": 0.3})  # stored before per-network keys
    monkeypatch.setattr(validate, "fsdp_goodput", lambda *a, **k: pytest.fail("probed although stored"))
    monkeypatch.setattr(validate, "averaging_goodput", lambda *a, **k: pytest.fail("probed although stored"))
    again = validate._Links(grid, db, measure=True, rerun=False, progress=False)
    assert again.fsdp(10.0, [4], ("tiny_cnn", "mnist")) == 0.5 and again.fsdp(10.0, [8], ("mlp", "mnist")) == 0.4
    assert again.averaging(10.0, 2e6, 0, ("mlp", "mnist")) == 0.3


def test_a_grid_without_strategies_leaves_out_models_that_cannot_train_its_networks():
    from ddlscope.experiments.validate import PRESETS

    local = ValidationGrid(**PRESETS["local"])  # the zoo's CNNs: dmoe trains networks with a mixture-of-experts layer
    assert "dmoe" not in local.strategies and {"ddp", "fsdp", "collaborative"} <= set(local.strategies)
    mixed = ValidationGrid(datasets=["mnist"], networks=["tiny_cnn", "moe_cnn"])
    assert "dmoe" in mixed.strategies and "dmoe" in mixed.strategies_for("moe_cnn", "mnist")
    assert "dmoe" not in mixed.strategies_for("tiny_cnn", "mnist") and "ddp" in mixed.strategies_for("tiny_cnn", "mnist")
    with pytest.raises(ValueError, match=r"strategies: dmoe cannot train resnet18 on mnist \(model = 'resnet18': the "
                                         r"dmoe model trains a network with a mixture-of-experts layer; allowed: moe_cnn"):
        ValidationGrid(datasets=["mnist"], networks=["resnet18"], strategies=["ddp", "dmoe"])
    assert ValidationGrid(**PRESETS["moe"]).strategies == ["single", "dmoe"]


def test_a_swarm_runs_overshoot_is_read_from_its_global_epochs(tmp_path):
    from ddlscope.experiments.validate import _overshoot_steps

    db = tmp_path / "r.db"
    with ResultsStore(db) as store:
        swarm = store.create_run("swarm", "collaborative", {"strategy": "collaborative", "batch_size": 32,
                                                            "collaborative": {"target_batch_size": 64}})
        plain = store.create_run("plain", "collaborative", {"strategy": "collaborative", "batch_size": 32})
        for peer in (0, 1):  # a step a second, a round every second step: 2 steps of 32 per peer per epoch
            for t in range(10):
                store.add_step(swarm, peer, dict(step=t, wall_time=1e6 + t, samples=32, step_s=1.0, warmup=0,
                                                 optimizer_stepped=1, averaging_round=int(t % 2 == 1),
                                                 global_epoch=(t + 1) // 2))
                store.add_step(plain, peer, dict(step=t, wall_time=1e6 + t, samples=32, step_s=1.0, warmup=0,
                                                 optimizer_stepped=1, averaging_round=0, global_epoch=0))
        assert _overshoot_steps(store, store.run(swarm)) == pytest.approx((128 - 64) / (2 * 32))  # a step per peer past 64
        assert _overshoot_steps(store, store.run(plain)) is None  # no target batch size, no whole global epoch
