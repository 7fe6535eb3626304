"""The benchmark suite: definition, expansion, bad input, and one tiny real suite with a failing cell."""

from __future__ import annotations

import json

import pytest

from ddlscope.errors import UserError
from ddlscope.store.db import ResultsStore
from ddlscope.suite.runner import run_suite, suite_results
from ddlscope.suite.spec import PRESETS, TABLE_3_3_BATCH_SIZE, SuiteSpec, expand, load_suite, suite_models


def _shape(cell):
    v = cell.values
    return v["batch_size"], (v.get("distributed") or {}).get("microbatches"), v["sample_budget"]


def test_table_3_3_defaults_and_expansion():
    spec = SuiteSpec(datasets=["mnist", "imagenet"], networks=["resnet18", "vgg11"], workers=[2, 4],
                     warmup_batches=1, measured_batches=1)
    cells = expand(spec)
    # one single baseline per dataset x network, then every suite model x 2 worker counts per dataset x network
    assert len(cells) == 2 * 2 * (1 + len(suite_models()) * 2)
    assert [c.strategy for c in cells[:4]] == ["single"] * 4
    by = {(c.values["dataset"], c.values["model"], c.strategy, c.values["peers"]): c for c in cells}
    assert _shape(by["mnist", "resnet18", "single", 1]) == (TABLE_3_3_BATCH_SIZE["mnist"], None, 2 * 128)
    assert _shape(by["mnist", "resnet18", "ddp", 4]) == (128, None, 2 * 4 * 128)  # budget: 2 global batches
    assert _shape(by["imagenet", "vgg11", "gpipe", 2]) == (384, 12, 2 * 384)  # GPipe's own Table 3.3 column
    assert _shape(by["imagenet", "vgg11", "1f1b", 4])[1] == 8  # at least one per stage, 2 per stage by default
    assert by["imagenet", "vgg11", "1f1b", 4].key == by["imagenet", "vgg11", "1f1b", 4].label == "1f1b-vgg11-imagenet-4w"
    small = SuiteSpec(datasets=["mnist"], workers=[4], microbatches={"mnist": 2})
    assert {c.strategy: _shape(c)[1] for c in expand(small) if c.strategy in ("gpipe", "1f1b")} == {"gpipe": 2, "1f1b": 4}


def test_suite_models_come_from_the_registry():
    models = suite_models()
    assert {"ddp", "fsdp", "gpipe", "1f1b"} <= set(models)
    assert "single" not in models and "collaborative" not in models  # the baseline; peers stepping on their own
    assert SuiteSpec().strategies == models


def test_presets_are_valid_and_local_preset_fits_this_machine(tmp_path):
    for name in PRESETS:
        spec = load_suite(name)
        if spec.device == "cpu":  # cuda cells are checked on the cluster they are meant for
            for cell in expand(spec, tmp_path):
                assert cell.config.max_steps_per_peer() == spec.warmup_batches + spec.measured_batches
    local = load_suite("local")
    assert set(c.strategy for c in expand(local)) == {"single", *suite_models()}


@pytest.mark.parametrize("text, message", [
    ('[suite]\ndatasets = ["svhn"]', "unknown dataset(s) ['svhn']"),
    ('[suite]\nstrategies = ["horovod"]', "unknown distribution model(s) ['horovod']"),
    ('[suite]\nworkers = [1]', "allowed: integers >= 2"),
    ('[suite]\nnetworks = ["resnet9"]', "unknown network(s) ['resnet9']"),
    ('[suite]\nbatch_size = {mnist = 0}', "values >= 1"),
    ('[suite]\ncolour = "red"', "colour: unknown field"),
    ('[suite]\npreset = "huge"', "suite.preset = 'huge'; allowed: local, thesis"),
    ('[run]\nbatch_size = 1', "expected exactly one [suite] table"),
    ('[suite\n', "not valid TOML"),
])
def test_bad_suite_files(tmp_path, text, message):
    path = tmp_path / "suite.toml"
    path.write_text(text)
    with pytest.raises(UserError) as err:
        load_suite(str(path))
    assert message in str(err.value)


def test_missing_suite_file_names_presets(tmp_path):
    with pytest.raises(UserError, match="suite file not found.*local, thesis"):
        load_suite(str(tmp_path / "nope.toml"))


def test_tiny_suite_runs_stores_failures_and_skips_finished_cells(tmp_path):
    """ddp and fsdp cells train; gpipe and 1f1b cells are rejected (3 micro-batches do not divide 16)
    and stored as failed with the reason; a rerun skips the completed cells."""
    spec = SuiteSpec(name="t", datasets=["mnist"], networks=["tiny_cnn"], strategies=["ddp", "fsdp", "gpipe", "1f1b"],
                     workers=[2], warmup_batches=1,
                     measured_batches=2, batch_size={"mnist": 16}, gpipe_batch_size={"mnist": 16},
                     microbatches={"mnist": 3}, synthetic_train_size=64)
    db = tmp_path / "r" / "d.db"
    first = run_suite(spec, db, data_root=tmp_path / "data", progress=False)
    assert len(first) == 5
    with ResultsStore(db) as store:
        results = {r.strategy: r for r in suite_results(store, "t")}
        assert {s: r.status for s, r in results.items()} == {
            "single": "completed", "ddp": "completed", "fsdp": "completed", "gpipe": "failed", "1f1b": "failed"}
        assert "distributed.microbatches = 3 does not divide batch_size = 16" in results["gpipe"].reason
        single, ddp = results["single"], results["ddp"]
        assert single.speedup == pytest.approx(1.0)
        # seconds per epoch: step time x batches in the real MNIST epoch (60,000 samples)
        assert single.epoch_s == pytest.approx(single.step_s * 60_000 / 16)
        assert ddp.epoch_s == pytest.approx(ddp.step_s * 60_000 / 32)
        assert ddp.speedup == pytest.approx(single.epoch_s / ddp.epoch_s)
        assert ddp.scaling_efficiency == pytest.approx(ddp.speedup / 2)
        assert ddp.comm_bytes_per_step > 0 and ddp.breakdown_s["comm_wait_s"] >= 0
        assert results["fsdp"].comm_s > 0 and results["fsdp"].peak_memory_bytes > 0
        # CPU workers' memory split: the model and what training added, on top of the runtime before the model
        run_id = next(r["run_id"] for r in store.runs("t") if r["strategy"] == "ddp")
        for e in (json.loads(e["detail_json"]) for e in store.rows("events", run_id) if e["kind"] == "memory"):
            assert 0 < e["rss_before_model_bytes"] <= e["rss_at_train_start_bytes"] <= e["train_peak_rss_bytes"]
        completed_before = sum(1 for r in store.runs("t") if r["status"] == "completed")
    second = run_suite(spec, db, data_root=tmp_path / "data", progress=False)
    with ResultsStore(db) as store:
        assert sum(1 for r in store.runs("t") if r["status"] == "completed") == completed_before == 3
    assert second[:3] == first[:3]  # the completed cells were not run again

    from ddlscope.suite.report import write_suite_report

    with ResultsStore(db) as store:
        results = suite_results(store, "t")
    html = write_suite_report(results, tmp_path / "report", "t")
    out = html.parent
    assert (out / "speedup_2w.png").stat().st_size > 0 and (out / "breakdown.png").stat().st_size > 0
    md = (out / "suite.md").read_text()
    assert "## Failed cells" in md and "gpipe-tiny_cnn-mnist-2w" in md and "does not divide" in md
    stored = json.loads((out / "suite.json").read_text())
    assert {c["strategy"] for c in stored} == {"single", "ddp", "fsdp", "gpipe", "1f1b"}


def test_seconds_per_epoch_of_synchronous_and_collaborative_runs(tmp_path):
    """Synchronous workers: mean over steps of the slowest worker's step. Collaborative peers step
    on their own: the time every peer trained over the samples all peers processed in it."""
    from ddlscope.suite.runner import cell_result

    def stored(store, strategy, per_worker_steps):
        run_id = store.create_run(strategy, strategy, dict(strategy=strategy, model="resnet18", dataset="mnist",
                                                            peers=2, batch_size=10))
        for w, times in enumerate(per_worker_steps):
            start = 0.0
            for i, t in enumerate(times):
                store.add_step(run_id, w, dict(step=i, wall_time=start, samples=10, step_s=t, warmup=0,
                                               optimizer_stepped=1))
                start += t
        store.finish_run(run_id, "completed")
        return cell_result(store, dict(store.run(run_id)))

    with ResultsStore(tmp_path / "r.db") as store:
        ddp = stored(store, "ddp", [[1.0, 3.0], [2.0, 1.0]])
        collab = stored(store, "collaborative", [[1.0, 3.0], [2.0, 2.0]])
        # peer 1 is done after 2 steps; peer 0's last step is a 55 s wait for a round nobody joins
        tail = stored(store, "collaborative", [[2.0, 2.0, 55.0], [2.0, 2.0]])
    assert ddp.step_s == pytest.approx((2.0 + 3.0) / 2)  # slowest worker per step
    assert ddp.epoch_s == pytest.approx(2.5 * 60_000 / 20)
    # both peers trained from 0 to 4 s (peer 0: steps [0, 1] and [1, 4], peer 1: [0, 2] and [2, 4]):
    # 40 samples in 4 s, 2 s per 20-sample global batch
    assert collab.step_s == pytest.approx(2.0)
    assert collab.epoch_s == pytest.approx(4.0 * 60_000 / 40)
    # the wait after peer 1 left is not the swarm's pace: 40 samples in the 4 s both trained
    assert tail.step_s == pytest.approx(2.0)
