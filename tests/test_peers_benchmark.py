"""The pure parts of benchmarks/peers.py: its settings, run configs, wall-clock window and docs block.

No process is started and no figure is measured here: the inputs are synthetic step rows and results.
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from pathlib import Path

import pytest

from ddlscope.config import load_config
from ddlscope.errors import UserError
from ddlscope.experiments.results import swarm_window

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import _docs  # noqa: E402
import peers  # noqa: E402


def _args(**kw) -> argparse.Namespace:
    values = dict(workload="tiny_cnn:digits:32", warmup=5, steps=30, device="cpu", microbatches=4)
    return argparse.Namespace(**{**values, **kw})


def test_parse_models_keeps_order_and_drops_repeats():
    assert peers.parse_models("1f1b, ddp,1f1b") == ["1f1b", "ddp"]


@pytest.mark.parametrize("text", ["ddp,single", "", "dmoe"])
def test_parse_models_names_what_is_allowed(text):
    with pytest.raises(UserError, match="allowed: a comma-separated list of ddp, fsdp, gpipe, 1f1b, collaborative"):
        peers.parse_models(text)


@pytest.mark.parametrize("model", peers.MODELS)
def test_run_configs_are_valid_and_train_the_same_steps(model, tmp_path):
    """The TOML written for ``ddlscope run`` parses back to the same tables, and ddlscope accepts it with
    warm-up + measured steps per worker, the plain scripts' learning rate and momentum, one core each."""
    bounds = [0, 2, 4] if model in ("gpipe", "1f1b") else None
    tables = peers.run_tables(model, _args(), bounds)
    path = tmp_path / "run.toml"
    path.write_text(peers.toml_text(tables))
    assert tomllib.loads(path.read_text()) == tables
    cfg = load_config(path)
    assert (cfg.strategy, cfg.peers, cfg.vcpus_per_peer, cfg.loader_workers) == (model, 2, 1, 1)
    assert cfg.max_steps_per_peer() == 35 and cfg.warmup_steps == 5 and not cfg.final_eval
    assert (cfg.learning_rate, cfg.momentum, cfg.optimizer) == (peers.LEARNING_RATE, peers.MOMENTUM, "sgd")
    if bounds:
        assert cfg.distributed.stage_bounds == bounds and cfg.distributed.microbatches == 4
    if model == "collaborative":
        assert cfg.collaborative.target_batch_size == 10 * 2 * 32
        assert cfg.collaborative.matchmaking_time_s == peers.MATCHMAKING_TIME_S


def test_toml_text_refuses_what_it_cannot_write():
    with pytest.raises(ValueError, match="allowed: str, int, float, bool, lists"):
        peers.toml_text({"run": {"x": None}})


def _row(worker: int, step: int, start: float, seconds: float, samples: int = 32) -> dict:
    return dict(worker_index=worker, step=step, wall_time=start, step_s=seconds, samples=samples)


def test_wall_window_of_lockstep_workers_spans_earliest_start_to_latest_end():
    steps = [_row(0, 5, 100.0, 0.5), _row(1, 5, 100.1, 0.4), _row(0, 6, 100.5, 0.5), _row(1, 6, 100.5, 0.7)]
    seconds, samples = peers.wall_window(steps, per_step=64, lockstep=True)
    assert seconds == pytest.approx(101.2 - 100.0)
    assert samples == 2 * 64


def test_wall_window_of_a_swarm_is_the_time_every_peer_trained():
    steps = [_row(0, 5, 10.0, 1.0), _row(0, 6, 11.0, 1.0), _row(1, 5, 10.5, 1.0), _row(1, 6, 11.5, 1.0)]
    assert peers.wall_window(steps, per_step=64, lockstep=False) == swarm_window(steps)


def test_wall_window_says_when_there_is_nothing_to_measure():
    with pytest.raises(ValueError, match="no measured steps"):
        peers.wall_window([], per_step=64, lockstep=True)
    apart = [_row(0, 5, 10.0, 1.0), _row(1, 5, 20.0, 1.0)]
    with pytest.raises(ValueError, match="do not overlap"):
        peers.wall_window(apart, per_step=64, lockstep=False)


def test_summarize_reads_the_lower_ratio_of_each_pair_against_the_target():
    row = peers.summarize("ddp", plain=[100.0, 90.0, 110.0], reported=[99.0, 98.0, 97.0], wall=[95.0, 96.0, 94.0])
    assert row["ratio"] == pytest.approx(0.99) and row["wall_ratio"] == pytest.approx(0.95)  # median pairs
    assert row["lower_ratio_interval"] is None and row["verdict"] == "unsettled"   # 3 pairs: no 95 % interval
    assert row["meets_target"] is False
    plain = [100.0, 90.0, 110.0, 95.0, 105.0, 100.0, 98.0]
    at_par = peers.summarize("ddp", plain, [p * 0.99 for p in plain], [p * 1.0 for p in plain])
    assert at_par["verdict"] == "met" and at_par["meets_target"] is True
    assert at_par["lower_ratio_interval"] == pytest.approx([0.99, 0.99])
    slow = peers.summarize("ddp", plain, [p * 0.9 for p in plain], [p * 0.95 for p in plain])
    assert slow["verdict"] == "missed" and slow["meets_target"] is False
    # one pair read 0.90 and the others 1.0: the median pair meets the target, the interval does not exclude 0.90
    noisy = peers.summarize("ddp", plain, [p * (0.9 if i == 0 else 1.0) for i, p in enumerate(plain)], plain)
    assert noisy["ratio"] == pytest.approx(1.0) and noisy["verdict"] == "unsettled"


def test_gpu_shortage_only_for_torchrun_models_on_cuda(monkeypatch):
    monkeypatch.setattr(peers.torch.cuda, "device_count", lambda: 1)
    assert peers.gpu_shortage("ddp", "cuda") == "2 workers need 2 GPUs, 1 visible"
    assert peers.gpu_shortage("collaborative", "cuda") is None
    assert peers.gpu_shortage("ddp", "cpu") is None


def _result() -> dict:
    return dict(device="cpu", gpu=None, model="resnet18", dataset="digits", batch_size=32, workers=2, cores_per_worker=1,
                warmup_steps=5, steps=30, repeats=3, microbatches=4, stage_bounds=[0, 6, 11], target_batch_size=640,
                matchmaking_time_s=1.0, averaging_timeout_s=30.0, measured_at="2030-01-02 03:04:05",
                models=[peers.summarize("ddp", [100.0] * 6, [99.0] * 6, [98.5] * 6),
                        peers.summarize("1f1b", [50.0] * 6, [49.0] * 6, [47.0] * 6),
                        peers.not_run("fsdp", "2 workers need 2 GPUs, 1 visible")])


def test_peers_markdown_shows_every_model_with_its_ratios_and_verdict():
    text = _docs.peers_markdown(_result(), header="*Written by the test.*")
    assert text.startswith("*Written by the test.*\n\nDevice: cpu. resnet18 / digits, batch 32 per worker")
    assert "cut at layers [0, 6, 11]" in text and "target batch size 640, matchmaking 1 s" in text
    assert "| ddp | 100.0 | 99.0 | 0.990 | 98.5 | 0.985 | 0.985 .. 0.985 | >= 0.97 | yes |" in text
    assert "| 1f1b | 50.0 | 49.0 | 0.980 | 47.0 | 0.940 | 0.940 .. 0.940 | >= 0.97 | **no** |" in text
    assert "| fsdp | – | – | – | – | – | – | >= 0.97 | – | not run: 2 workers need 2 GPUs, 1 visible |" in text
    old = dict(_result(), models=[dict(m, verdict=None, lower_ratio_interval=None) for m in _result()["models"][:1]])
    assert "| ddp | 100.0 | 99.0 | 0.990 | 98.5 | 0.985 | – | >= 0.97 | yes |" in _docs.peers_markdown(old, header="*h*")


def test_peers_markdown_rewrites_its_block_only(tmp_path):
    page = tmp_path / "validation.md"
    page.write_text("before\n<!-- peers:begin -->\nold\n<!-- peers:end -->\nafter\n")
    _docs.update_docs_block(page, "peers", _docs.peers_markdown(_result(), header="*h*"))
    text = page.read_text()
    assert text.startswith("before\n<!-- peers:begin -->\n*h*\n") and text.endswith("<!-- peers:end -->\nafter\n")
    assert "old" not in text


def test_peers_markdown_refuses_another_benchmarks_result():
    with pytest.raises(UserError, match="not a benchmarks/peers.py result"):
        _docs.peers_markdown({"workloads": []})


def test_the_docs_page_has_the_peers_block():
    _docs.check_docs_block(_docs.DOCS_PAGE, "peers")
