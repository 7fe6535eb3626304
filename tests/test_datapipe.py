"""Tests for ddlscope.datapipe: strategies and caches, loader timing, verdicts, the CLI command.

Small data (the session's digits PNG folder and synthetic MNIST), one torch thread. No assertion
depends on how fast anything ran.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

from ddlscope.datapipe import DatapipeOptions, parse_workers, run_datapipe
from ddlscope.datapipe import caches
from ddlscope.datapipe.caches import (
    CACHED_DECODED_DISK,
    CACHED_DECODED_MEMORY,
    DECODE_EVERY_STEP,
    PREPROCESSED,
    STRATEGIES,
    prepare_strategies,
    subset_indices,
)
from ddlscope.datapipe.measure import compute_step_from_run, loader_samples_per_s, measure_compute_step
from ddlscope.datapipe.report import markdown, write_report
from ddlscope.datapipe.verdict import (
    OptionResult,
    expected_training_samples_per_s,
    is_input_bound,
    recommend,
    training_samples_per_s,
)
from ddlscope.errors import DatasetError, UserError
from ddlscope.store.db import ResultsStore
from ddlscope.workloads.datasets import MARKER_NAME, decode_image, open_dataset
from ddlscope.workloads.preprocessing import eval_transform

PIXELS = 1 * 28 * 28


def _prepare(data_root, cache_dir, name="digits", max_samples=48, augment=False):
    source, spec = open_dataset(name, data_root, "train")
    indices = subset_indices(len(source), max_samples)
    return source, spec, indices, prepare_strategies(source, spec, indices, cache_dir, STRATEGIES, augment)


# ------------------------------------------------------------------ strategies and caches
@pytest.mark.parametrize("name", ["digits", "mnist"])
def test_without_augmentation_every_strategy_gives_the_same_pixels(data_root, tmp_path, name):
    source, spec, indices, prepared = _prepare(data_root, tmp_path / "cache", name)
    assert [d.strategy for d in prepared] == list(STRATEGIES)
    transform = eval_transform(spec)
    for k in (0, 7, len(indices) - 1):
        raw, label = source[indices[k]]
        expected = transform(raw)
        for data in prepared:
            image, got_label = data.dataset[k]
            assert image.dtype == torch.float32 and image.shape == (1, 28, 28), data.strategy
            assert torch.equal(image, expected), data.strategy
            assert got_label == label, data.strategy


def test_online_augmentation_is_the_same_transform_in_every_strategy(data_root, tmp_path):
    _, _, _, prepared = _prepare(data_root, tmp_path / "cache", augment=True)
    by_name = {d.strategy: d for d in prepared}
    assert [d.online_augmentation for d in prepared] == [True, True, True, False]
    for k in (3, 11):
        outputs = []
        for name in (DECODE_EVERY_STEP, CACHED_DECODED_MEMORY, CACHED_DECODED_DISK):
            torch.manual_seed(k)  # RandomCrop draws from the global generator
            outputs.append(by_name[name].dataset[k][0])
        assert all(torch.equal(outputs[0], other) for other in outputs[1:])
    unaugmented = by_name[PREPROCESSED].dataset[3][0]
    crops = {by_name[CACHED_DECODED_MEMORY].dataset[3][0].numpy().tobytes() for _ in range(20)}
    assert len(crops) > 1 and unaugmented.shape == (1, 28, 28)


def test_storage_bytes_and_cache_files(data_root, tmp_path):
    source, _, indices, prepared = _prepare(data_root, tmp_path / "cache", max_samples=40)
    storage = {d.strategy: (d.storage_bytes, d.storage_location) for d in prepared}
    png_bytes = sum(Path(source.samples[i][0]).stat().st_size for i in indices)
    assert storage == {DECODE_EVERY_STEP: (png_bytes, "disk"), CACHED_DECODED_MEMORY: (40 * PIXELS, "memory"),
                       CACHED_DECODED_DISK: (40 * PIXELS, "disk"), PREPROCESSED: (4 * 40 * PIXELS, "disk")}
    decoded = np.load(tmp_path / "cache" / caches.DECODED_FOLDER / caches.IMAGES_FILE, mmap_mode="r")
    floats = np.load(tmp_path / "cache" / caches.PREPROCESSED_FOLDER / caches.IMAGES_FILE, mmap_mode="r")
    assert (decoded.dtype, decoded.shape) == (np.uint8, (40, 1, 28, 28))
    assert (floats.dtype, floats.shape) == (np.float32, (40, 1, 28, 28))
    first = decode_image(Path(source.samples[indices[1]][0]), 1, 28, 28)
    assert np.array_equal(decoded[1], first.numpy())
    builds = {d.strategy: d.build_s for d in prepared}
    assert builds[DECODE_EVERY_STEP] == 0.0
    decoded_marker = json.loads((tmp_path / "cache" / caches.DECODED_FOLDER / MARKER_NAME).read_text())
    pre_marker = json.loads((tmp_path / "cache" / caches.PREPROCESSED_FOLDER / MARKER_NAME).read_text())
    assert builds[CACHED_DECODED_MEMORY] == decoded_marker["decode_s"] > 0
    assert builds[CACHED_DECODED_DISK] == decoded_marker["decode_s"] + decoded_marker["write_s"]
    assert builds[PREPROCESSED] == decoded_marker["decode_s"] + pre_marker["transform_write_s"]


def test_in_memory_reader_counts_decoded_bytes_in_memory(data_root, tmp_path):
    _, _, _, prepared = _prepare(data_root, tmp_path / "cache", name="mnist", max_samples=32)
    assert (prepared[0].storage_bytes, prepared[0].storage_location) == (32 * PIXELS, "memory")


def test_rerun_reuses_the_cache_and_its_build_time(data_root, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    *_, first = _prepare(data_root, cache)
    marker = (cache / caches.DECODED_FOLDER / MARKER_NAME).read_text()

    def no_decoding(*args, **kwargs):
        raise AssertionError("the cache should have been reused")

    monkeypatch.setattr(caches, "_decode_all", no_decoding)
    *_, second = _prepare(data_root, cache)
    assert [d.build_s for d in second] == [d.build_s for d in first]
    assert (cache / caches.DECODED_FOLDER / MARKER_NAME).read_text() == marker
    monkeypatch.undo()
    *_, other = _prepare(data_root, cache, max_samples=24)  # another subset: rebuilt, in place
    assert other[1].storage_bytes == 24 * PIXELS
    assert np.load(cache / caches.DECODED_FOLDER / caches.IMAGES_FILE).shape[0] == 24
    assert sorted(p.name for p in cache.iterdir()) == [caches.DECODED_FOLDER, caches.PREPROCESSED_FOLDER]


def test_interrupted_build_leaves_nothing_and_foreign_folders_are_kept(data_root, tmp_path, monkeypatch):
    cache = tmp_path / "cache"

    def disk_full(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(caches.np, "save", disk_full)
    with pytest.raises(OSError):
        _prepare(data_root, cache)
    assert list(cache.iterdir()) == []
    monkeypatch.undo()
    (cache / caches.DECODED_FOLDER).mkdir()
    (cache / caches.DECODED_FOLDER / "mine.txt").write_text("user data")
    with pytest.raises(DatasetError, match="not a ddlscope datapipe cache"):
        _prepare(data_root, cache)
    assert (cache / caches.DECODED_FOLDER / "mine.txt").read_text() == "user data"


def test_subset_indices_are_evenly_spread():
    assert subset_indices(5, None) == [0, 1, 2, 3, 4]
    assert subset_indices(5, 9) == [0, 1, 2, 3, 4]
    assert subset_indices(101, 3) == [0, 50, 100]


# ------------------------------------------------------------------ measurements
@pytest.mark.parametrize("workers", [0, 2])
def test_loader_timing_counts_whole_batches_and_ends_its_workers(data_root, tmp_path, workers):
    *_, prepared = _prepare(data_root, tmp_path / "cache", max_samples=40)
    timing = loader_samples_per_s(prepared[1].dataset, batch_size=8, workers=workers, samples=50)
    assert timing.timed_samples == 56  # 7 batches of 8 after the warm-up batch, crossing an epoch (5 batches)
    assert timing.samples_per_s == pytest.approx(timing.timed_samples / timing.timed_s)
    assert psutil.Process().children(recursive=True) == []
    with pytest.raises(ValueError, match="batch_size"):
        loader_samples_per_s(prepared[1].dataset, batch_size=41, workers=0, samples=8)


def _store_run(db: Path, batch_size: int, steps: list[tuple[int, float, float]]) -> str:
    with ResultsStore(db) as store:
        run_id = store.create_run("r", "single", {"batch_size": batch_size, "model": "tiny_cnn", "dataset": "digits"})
        for step, (warmup, step_s, data_load_s) in enumerate(steps):
            store.add_step(run_id, 0, dict(step=step, wall_time=0.0, samples=batch_size, step_s=step_s,
                                           data_load_s=data_load_s, warmup=warmup, optimizer_stepped=1))
    return run_id


def test_step_time_from_a_stored_run_is_the_median_compute_time(tmp_path):
    db = tmp_path / "r.db"
    run_id = _store_run(db, 16, [(1, 9.0, 0.0), (0, 0.30, 0.10), (0, 0.50, 0.05), (0, 0.40, 0.30)])
    step, config = compute_step_from_run(db, run_id)
    assert step.compute_step_s == pytest.approx(0.20)  # median of 0.20, 0.45, 0.10
    assert (step.batch_size, step.steps, step.source, step.model) == (16, 3, f"run {run_id}", "tiny_cnn")
    empty = _store_run(db, 8, [(1, 1.0, 0.5)])
    assert compute_step_from_run(db, empty) == (None, config | {"batch_size": 8})
    with pytest.raises(UserError, match="no such run"):
        compute_step_from_run(db, "nope")
    with pytest.raises(UserError, match="no results database"):
        compute_step_from_run(tmp_path / "missing.db", run_id)
    assert not (tmp_path / "missing.db").exists()


def test_measured_compute_step_uses_the_requested_batch(data_root):
    _, spec = open_dataset("digits", data_root, "train")
    step = measure_compute_step("tiny_cnn", spec, batch_size=4, steps=2)
    assert step.compute_step_s > 0 and (step.batch_size, step.steps, step.source) == (4, 2, "measured tiny_cnn")
    with pytest.raises(UserError, match="resnet9000"):
        measure_compute_step("resnet9000", spec, 4)


# ------------------------------------------------------------------ verdicts
def _option(strategy, workers, samples_per_s, augment=True):
    return OptionResult(strategy, workers, samples_per_s, 1000, "disk", 1.5, augment and strategy != PREPROCESSED)


def test_training_rate_and_input_bound_rule():
    assert training_samples_per_s(32, 0.4) == pytest.approx(80.0)
    assert is_input_bound(79.9, 80.0) and not is_input_bound(80.0, 80.0)
    assert expected_training_samples_per_s(240.0, 80.0, workers=0) == pytest.approx(60.0)
    assert expected_training_samples_per_s(240.0, 80.0, workers=1) == 80.0
    assert expected_training_samples_per_s(40.0, 80.0, workers=2) == 40.0
    for bad in ((0, 0.4), (32, 0.0), (32, -1.0)):
        with pytest.raises(ValueError):
            training_samples_per_s(*bad)


def test_recommend_prefers_no_preparation_when_it_keeps_up():
    options = [_option(DECODE_EVERY_STEP, 0, 90.0), _option(DECODE_EVERY_STEP, 1, 200.0),
               _option(CACHED_DECODED_MEMORY, 0, 5000.0), _option(PREPROCESSED, 0, 9000.0)]
    rec = recommend(options, training_samples_per_s=80.0)
    assert (rec.strategy, rec.workers, rec.input_bound) == (DECODE_EVERY_STEP, 0, False)
    assert "no cache or preprocessed copy" in rec.explanation and "about 42 samples/s" in rec.explanation
    assert [o.input_bound for o in options] == [False, False, False, False]


def test_recommend_takes_the_cheapest_cache_that_keeps_up():
    options = [_option(DECODE_EVERY_STEP, 0, 50.0), _option(DECODE_EVERY_STEP, 2, 70.0),
               _option(CACHED_DECODED_MEMORY, 0, 60.0), _option(CACHED_DECODED_MEMORY, 2, 90.0),
               _option(CACHED_DECODED_DISK, 2, 300.0), _option(CACHED_DECODED_DISK, 1, 120.0),
               _option(PREPROCESSED, 0, 900.0)]
    rec = recommend(options, training_samples_per_s=100.0)
    assert (rec.strategy, rec.workers, rec.input_bound) == (CACHED_DECODED_DISK, 1, False)
    assert rec.explanation.startswith("The cheaper cached-decoded-memory reaches at most 90 samples/s")
    assert "keeps up (120 samples/s) for 0.0 MB in disk and 1.5 s to build." in rec.explanation
    assert [o.input_bound for o in options] == [True, True, True, True, False, False, False]
    options[3].samples_per_s = 100.0  # exactly what training consumes: keeps up, and is cheaper
    assert (recommend(options, 100.0).strategy, recommend(options, 100.0).workers) == (CACHED_DECODED_MEMORY, 2)
    rec = recommend(options[:2] + options[6:], training_samples_per_s=100.0)
    assert (rec.strategy, rec.workers) == (PREPROCESSED, 0)
    assert "gives up online augmentation" in rec.explanation and "at most 70 samples/s" in rec.explanation


def test_recommend_when_every_option_is_input_bound_picks_the_fastest():
    options = [_option(DECODE_EVERY_STEP, 0, 50.0), _option(CACHED_DECODED_DISK, 2, 70.0), _option(PREPROCESSED, 1, 60.0)]
    rec = recommend(options, training_samples_per_s=100.0)
    assert (rec.strategy, rec.workers, rec.input_bound) == (CACHED_DECODED_DISK, 2, True)
    assert "No option keeps up" in rec.explanation
    with pytest.raises(ValueError):
        recommend([], 1.0)


# ------------------------------------------------------------------ whole analysis and CLI
def test_run_datapipe_takes_step_time_and_batch_from_a_run(data_root, tmp_path):
    db = tmp_path / "r.db"
    run_id = _store_run(db, 16, [(1, 1.0, 0.5), (0, 2.5, 0.5)])
    opts = DatapipeOptions("digits", workers=(0,), samples=16, max_samples=64, run_id=run_id, db=db,
                           data_root=data_root)
    result = run_datapipe(opts, tmp_path / "cache")
    assert (result.batch_size, result.compute.compute_step_s, result.training_samples_per_s) == (16, 2.0, 8.0)
    assert [(o.strategy, o.workers) for o in result.options] == [(s, 0) for s in STRATEGIES]
    assert [o.input_bound is not None for o in result.options] == [True] * 4
    report = write_report(result, tmp_path / "out")
    assert (tmp_path / "out" / "throughput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "out" / "datapipe.json").read_text())["batch_size"] == 16
    assert report.read_text() == markdown(result, "throughput.png")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["datapipe.json", "datapipe.md", "throughput.png"]
    with pytest.raises(UserError, match="--batch-size 32 differs"):
        run_datapipe(DatapipeOptions("digits", workers=(0,), batch_size=32, run_id=run_id, db=db,
                                     data_root=data_root), tmp_path / "cache")


@pytest.mark.parametrize("text, expected", [("0,1,2", (0, 1, 2)), ("2, 0,2", (0, 2)), ("64", (64,))])
def test_parse_workers(text, expected):
    assert parse_workers(text) == expected


@pytest.mark.parametrize("text", ["", "-1,0", "a", "0,,1", "65"])
def test_parse_workers_rejects_bad_lists(text):
    with pytest.raises(UserError, match="--loader-workers"):
        parse_workers(text)


def _cli(*args: str, cwd: Path, data_root: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, DDLSCOPE_DATA=str(data_root), PYTHONPATH=str(Path(__file__).parents[1]))
    return subprocess.run([sys.executable, "-m", "ddlscope", "datapipe", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120, env=env)


@pytest.mark.parametrize("args, expected", [
    (["digits", "--loader-workers", "-1,0"], "error: --loader-workers '-1,0': allowed: comma-separated loader worker counts"),
    (["digits", "--loader-workers", ""], "error: --loader-workers '': allowed"),
    (["digits", "--batch-size", "0"], "error: --batch-size 0: allowed: >= 1"),
    (["digits", "--step-time-s", "0"], "error: --step-time-s 0.0: allowed: > 0 seconds"),
    (["digits", "--batch-size", "5000", "--step-time-s", "1"], "error: --batch-size 5000 is larger than the 1438"),
    (["nosuchset"], "error: unknown dataset 'nosuchset'; allowed: cifar10, digits"),
    (["./no/such/folder"], "no such dataset folder"),
])
def test_cli_rejects_bad_options_with_one_line_and_writes_nothing(tmp_path, data_root, args, expected):
    result = _cli(*args, cwd=tmp_path, data_root=data_root)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("error: ") and expected in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and list(tmp_path.iterdir()) == []


def test_cli_json_and_report(tmp_path, data_root):
    result = _cli("digits", "--loader-workers", "1,0", "--step-time-s", "1000", "--samples", "32", "--max-samples", "96",
                  "--json", "--no-progress", cwd=tmp_path, data_root=data_root)
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    assert [(o["strategy"], o["workers"]) for o in payload["options"]] == [(s, w) for s in STRATEGIES for w in (0, 1)]
    assert payload["training_samples_per_s"] == pytest.approx(32 / 1000)
    assert payload["recommendation"]["strategy"] == DECODE_EVERY_STEP and payload["recommendation"]["workers"] == 0
    assert [o["storage_bytes"] for o in payload["options"][2:]] == [96 * PIXELS] * 4 + [4 * 96 * PIXELS] * 2
    out = tmp_path / "ddlscope-results" / "datapipe" / "digits"
    assert json.loads((out / "datapipe.json").read_text()) == payload
    assert (out / "cache" / caches.DECODED_FOLDER / MARKER_NAME).exists()
    assert "**Recommended:** decode-every-step, 0 loader worker(s)" in (out / "datapipe.md").read_text()


def test_the_options_are_checked_without_torch():
    """The CLI refuses a bad option at once (about 0.4 s, not the 3 s of importing torch first)."""
    code = ("import sys; from ddlscope.datapipe import DatapipeOptions, parse_workers; "
            "DatapipeOptions('digits', parse_workers('0,1')).check(); print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr
