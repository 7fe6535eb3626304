"""The benchmarks write their results tables into docs/validation.md (benchmarks/_docs.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from ddlscope.errors import UserError

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("benchmarks_docs", ROOT / "benchmarks" / "_docs.py")
docs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(docs)

PAGE = """# Validation

Text before, kept as is.

<!-- predictor:begin -->
old predictor table
<!-- predictor:end -->

Between the blocks.

<!-- overhead:begin -->
old overhead table
<!-- overhead:end -->
Text after.
"""

HEADER = "*Written by the test.*"


def _model(median: float, largest: float, signed: float, count: int = 6) -> dict:
    return {"count": count, "outcomes": count, "without_measurement": 0, "without_prediction": 0,
            "median_abs_error": median, "max_abs_error": largest, "median_error": signed}


def _target(name: str, value: float, threshold: float, passed: bool, comparison: str = "<=") -> dict:
    return {"name": name, "description": name, "threshold": threshold, "value": value, "passed": passed,
            "comparison": comparison}


def fake_predictor_result() -> dict:
    """A two-model predictor.json in the shape benchmarks/predictor.py writes (fractions, not %)."""
    return {
        "grid": {"name": "tiny", "datasets": ["mnist"], "networks": ["tiny_cnn"], "workers": 2, "batch_size": 16,
                 "warmup_batches": 1, "measured_batches": 2, "measured_batches_by_model": {"single": 2, "collaborative": 48},
                 "threads_per_device": 1, "matchmaking_time_s": 1.0},
        "speed": {"profile_and_predict_s": 12.5, "further_cluster_s": 0.0012, "further_strategy_s": 0.0002},
        "speed_targets_s": {"profile_and_predict_s": 60.0, "further_s": 1.0},
        "validation_wall_s": 90.0,
        "measured_at": "2030-01-02 03:04:05",
        "summary": {
            "cells": 1, "per_model": {"single": _model(0.051, 0.076, -0.02), "ddp": _model(0.123, 0.2, 0.1)},
            "per_reference": {"ddp eq5.1": _model(0.104, 0.3, 0.05)},
            "top1_correct": 1, "top1_determined": 1, "median_regret": 0.0, "tau_pooled": 0.912,
            "targets": [_target("median abs error single", 0.051, 0.1, True),
                        _target("median abs error ddp", 0.123, 0.1, False),
                        _target("top-1 rate", 1.0, 0.9, True, ">="),
                        _target("median regret", 0.0, 0.05, True)],
        },
    }


def fake_overhead_result() -> dict:
    return {"model": "tiny_cnn", "dataset": "digits", "batch_size": 16, "timed_steps": 27, "repeats": 3,
            "plain_step_ms": 10.04, "ddlscope_step_ms": 10.21, "overhead_fraction": 0.0169,
            "target_fraction": 0.03, "meets_target": True}


def _block(text: str, name: str) -> str:
    begin, end = docs.markers(name)
    return text.split(begin, 1)[1].split(end, 1)[0]


def test_block_is_replaced_and_the_rest_of_the_page_kept(tmp_path):
    page = tmp_path / "validation.md"
    page.write_text(PAGE)
    body = docs.predictor_markdown(fake_predictor_result(), header=HEADER)
    docs.update_docs_block(page, "predictor", body)
    text = page.read_text()
    assert "old predictor table" not in text
    assert _block(text, "predictor").strip() == body.strip()
    before, after = PAGE.split("<!-- predictor:begin -->")[0], PAGE.split("<!-- predictor:end -->")[1]
    assert text.startswith(before + "<!-- predictor:begin -->\n")
    assert text.endswith("<!-- predictor:end -->" + after)       # the overhead block is untouched too
    docs.update_docs_block(page, "predictor", body)               # again: the same page, nothing piles up
    assert page.read_text() == text


def test_predictor_table_shows_each_model_and_target():
    body = docs.predictor_markdown(fake_predictor_result(), header=HEADER)
    lines = body.splitlines()
    assert lines[0] == HEADER
    single = next(line for line in lines if line.startswith("| single |"))
    ddp = next(line for line in lines if line.startswith("| ddp |"))
    assert single == "| single | 6 | 5.1 % | 7.6 % | -2.0 % | – |  | <= 10.0 % | yes |"
    assert ddp == "| ddp | 6 | 12.3 % | 20.0 % | +10.0 % | – | eq5.1: 10.4 % | <= 10.0 % | **no** |"
    assert "| recommendation = measured fastest (cells) | 1 / 1 | >= 90.0 % | yes |" in lines
    assert "| Kendall tau, predicted vs. measured order (pooled) | 0.91 |  |  |" in lines
    assert "| a further cluster / a further distribution model | 0.001 s / < 0.001 s | <= 1 s | yes |" in lines
    assert "Grid `tiny`: mnist x tiny_cnn; global batch 16; 2 workers of 1 core(s) each against one" in body
    assert "(collaborative 48, target batch size 16, matchmaking time 1.0 s); 1 cells" in body
    assert "the real runs took 1.5 min." in body
    assert "each run" not in body
    reused = {**fake_predictor_result(), "validation_wall_s": 18.0, "runs_s": 1302.0}  # stored runs were reused
    assert "the real runs took 21.7 min." in docs.predictor_markdown(reused, header=HEADER)
    # a grid run 3 times per cell: said with the grid, each model's median spread in its row
    repeated = fake_predictor_result()
    repeated["grid"]["repeats"] = 3
    repeated["summary"]["per_model"]["ddp"]["median_run_spread"] = 0.187
    body = docs.predictor_markdown(repeated, header=HEADER)
    assert "1 cells, each run 3 times (interleaved; a cell shows its median run" in body
    assert "| ddp | 6 | 12.3 % | 20.0 % | +10.0 % | 18.7 % | eq5.1: 10.4 % | <= 10.0 % | **no** |" in body.splitlines()
    assert "runs' compute" not in body  # a result without the error at the runs' compute: no such column
    # with it: a column, and a line saying what it is
    repeated["summary"]["per_model"]["ddp"]["median_abs_error_at_run_compute"] = 0.031
    body = docs.predictor_markdown(repeated, header=HEADER)
    assert "| ddp | 6 | 12.3 % | 20.0 % | +10.0 % | 18.7 % | 3.1 % | eq5.1: 10.4 % | <= 10.0 % | **no** |" in body.splitlines()
    assert "| single | 6 | 5.1 % | 7.6 % | -2.0 % | – | – |  | <= 10.0 % | yes |" in body.splitlines()
    assert "*At the runs' compute*: the prediction with its forward, backward and optimizer times" in body
    assert "measured again right before each round" not in body  # no hivemind fit per round: no such line
    fits = [{"round": 1, "epoch_overhead_s": 1.84, "overhead_steps": 0.0, "overshoot_steps": 0.3, "measured": "now"},
            {"round": 2, "epoch_overhead_s": 9.0, "overhead_steps": 0.5, "overshoot_steps": 0.1,
             "measured": "kept the cluster's fit: worker 1 failed"}]
    repeated["cells"] = [{**cell, "hivemind_fits": fits} for cell in repeated.get("cells", [{}])]
    body = docs.predictor_markdown(repeated, header=HEADER)
    assert "hivemind's overhead and overshoot, measured again right before each round" in body
    # hivemind's averaging share over each link: one per link, or one per round where each round probed its own
    link = {"link": "10 Mbit/s", "averaging_goodput": 0.7, "outcomes": []}
    one = docs.predictor_markdown({**repeated, "cells": [link]}, header=HEADER)
    assert "each peer on one core (`ddlscope.network.averaging_probe`; the collaborative model's rounds run at it): " \
           "10 Mbit/s 0.700." in one
    rounds = docs.predictor_markdown({**repeated, "cells": [{**link, "averaging_goodput_rounds": [0.7, None, 0.75]}]},
                                     header=HEADER)
    assert "run at it), measured before each round of runs: 10 Mbit/s 0.700 / – / 0.750." in rounds
    assert "`ddlscope.network.collective_probe`" not in rounds  # no fsdp share measured: no such line
    gloo = docs.predictor_markdown({**repeated, "cells": [{**link, "fsdp_goodput": 0.812}]}, header=HEADER)
    assert "at the profile's unit sizes; the fsdp model's collectives run at it): 10 Mbit/s 0.812." in gloo
    two = docs.predictor_markdown({**repeated, "cells": [
        {**link, "network": "tiny_cnn @ 10 Mbit/s", "dataset": "mnist", "fsdp_goodput": 0.812},
        {**link, "network": "mlp @ 10 Mbit/s", "dataset": "mnist", "fsdp_goodput": 0.9}]}, header=HEADER)
    assert "run at it): tiny_cnn @ 10 Mbit/s on mnist 0.812, mlp @ 10 Mbit/s on mnist 0.900." in two  # per workload
    assert ("): round 1 1.84 s + 0 x step per global epoch, overshoot 0.30 steps; round 2 9 s + 0.5 x step per "
            "global epoch, overshoot 0.10 steps (kept the cluster's fit: worker 1 failed).") in body
    # a fit per workload (hivemind_per_workload): each cell lists its own, the block names each once
    own = [{"round": 1, "workload": f"{net} on mnist", "epoch_overhead_s": e, "overhead_steps": 0.0,
            "compute_overhead_s": c, "overshoot_steps": o, "measured": "now"}
           for net, e, c, o in (("vgg11", 1.26, 0.329, 0.55), ("resnet18", 1.9, 0.7, 0.4))]
    per = docs.predictor_markdown({**repeated, "cells": [{"outcomes": [], "hivemind_fits": [f]} for f in own + own[:1]]},
                                  header=HEADER)
    assert "measured again right before each round" not in per
    assert ("predicted with it): vgg11 on mnist 1.26 s + 0 x step per global epoch, 0.329 s of it in the steps, "
            "overshoot 0.55 steps; resnet18 on mnist 1.9 s + 0 x step per global epoch, 0.7 s of it in the steps, "
            "overshoot 0.40 steps.") in per
    # how far collaborative peers ran past the target batch: each run, and the prediction's
    assert "ran past the target batch" not in body
    swarm = {**link, "outcomes": [{"strategy": "collaborative", "overshoot_steps_per_run": [0.35, 0.4],
                                   "predicted_overshoot_steps": 0.3}, {"strategy": "ddp"}]}
    past = docs.predictor_markdown({**repeated, "cells": [swarm]}, header=HEADER)
    assert "each run against the prediction (the hivemind fit's overshoot): 10 Mbit/s 0.35 / 0.40 (predicted 0.30)." \
        in past
    # a repeat that did not complete: named with its reason (its log's path left out), beside the cells' medians
    assert "did not complete" not in past
    lost = {**swarm, "outcomes": [{**swarm["outcomes"][0], "status": "completed", "reason": "1 of 3 repeats did not "
                                   "complete: failed: peer 1 killed by SIGSEGV (log: /tmp/x/worker-1.log)"}]}
    lost_md = docs.predictor_markdown({**repeated, "cells": [lost]}, header=HEADER)
    assert ("Runs that did not complete (left out of their cell's median and spread): 10 Mbit/s, collaborative: "
            "1 of 3 repeats did not complete: failed: peer 1 killed by SIGSEGV.") in lost_md


def test_default_header_names_script_date_machine_and_commit():
    body = docs.predictor_markdown(fake_predictor_result())
    header = body.splitlines()[0]
    assert "`python benchmarks/predictor.py` on 2030-01-02 03:04" in header
    assert "cores (of" in header and "commit " in header
    assert docs.git_commit(ROOT) != ""


def test_overhead_table():
    body = docs.overhead_markdown(fake_overhead_result(), header=HEADER)
    # a result from before the paired reading: no interval, its own verdict
    assert "| tiny_cnn / digits, batch 16 | 27 | 3 | 10.0 | 10.2 | +1.7 % | – | < 3.0 % | yes |" in body.splitlines()
    paired = dict(fake_overhead_result(), repeats=9, overhead_interval=[-0.012, 0.041], verdict="unsettled",
                  meets_target=False)
    lines = docs.overhead_markdown(paired, header=HEADER).splitlines()
    assert "| tiny_cnn / digits, batch 16 | 27 | 9 | 10.0 | 10.2 | +1.7 % | -1.2 % .. +4.1 % | < 3.0 % | unsettled |" in lines
    missed = dict(paired, overhead_interval=[0.031, 0.05], verdict="missed")
    assert "| +3.1 % .. +5.0 % | < 3.0 % | **no** |" in docs.overhead_markdown(missed, header=HEADER)


@pytest.mark.parametrize("text, problem", [
    ("no markers here\n", "'<!-- predictor:begin -->' is missing"),
    ("<!-- predictor:begin -->\nx\n", "'<!-- predictor:end -->' is missing"),
    ("<!-- predictor:end -->\nx\n<!-- predictor:begin -->\n", "comes before"),
    ("<!-- predictor:begin -->\n<!-- predictor:end -->\n<!-- predictor:begin -->\n", "appears 2 times"),
])
def test_bad_markers_give_a_clear_error_and_leave_the_page(tmp_path, text, problem):
    page = tmp_path / "validation.md"
    page.write_text(text)
    with pytest.raises(UserError, match="docs block 'predictor'") as err:
        docs.update_docs_block(page, "predictor", "new")
    assert problem in str(err.value)
    assert page.read_text() == text


def test_missing_page_and_wrong_result_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="docs page not found"):
        docs.update_docs_block(tmp_path / "nope.md", "predictor", "new")
    with pytest.raises(UserError, match="not a benchmarks/predictor.py result: missing 'summary'"):
        docs.predictor_markdown({"grid": {}, "speed": {}})
    with pytest.raises(UserError, match="not a benchmarks/overhead.py result"):
        docs.overhead_markdown({"model": "x"})
    with pytest.raises(UserError, match="allowed: lower-case"):
        docs.markers("Predictor Block")


def test_the_docs_page_has_the_blocks_the_benchmarks_write():
    """A 15-minute benchmark must not fail at its last step: docs/validation.md has both blocks once."""
    text = docs.DOCS_PAGE.read_text()
    for name in ("predictor", "overhead", "overhead-cuda", "gpu-h100-80gb", "gpu-h200-141gb", "dmoe-overhead"):
        assert docs.replace_block(text, name, "x") != text


def fake_dmoe_overhead_result(overhead: float = 0.017, spread: float = 0.05) -> dict:
    def pair(servers, trainer, ms, vs):
        return {"servers": servers, "trainer": trainer, "step_ms": ms, "step_ms_min": ms - 0.5, "step_ms_max": ms + 1,
                "vs_plain_fraction": vs, "median_step_ms": ms - 1, "median_step_vs_plain_fraction": vs / 2,
                "server_cpu_ms_per_step": 3.21}

    return {"model": "moe_cnn", "dataset": "digits", "batch_size": 16, "expert": "ffn", "hidden_dim": 64,
            "grid_size": [2, 2], "k_best": 2, "servers": 2, "trainer_cores": [0], "server_cores": [[1], [0]],
            "steps": 40, "timed_steps": 37, "repeats": 4,
            "pairs": [pair("plain", "plain", 10.0, 0.0), pair("ddlscope", "ddlscope", 10.17, overhead)],
            "overhead_fraction": overhead, "trainer_overhead_fraction": 0.01, "server_overhead_fraction": 0.005,
            "median_step_overhead_fraction": -0.002, "paired_overhead_fractions": [0.02, -0.01],
            "plain_spread_fraction": spread, "target_fraction": 0.03, "meets_target": overhead < 0.03}


def test_dmoe_overhead_table():
    lines = docs.dmoe_overhead_markdown(fake_dmoe_overhead_result(), header=HEADER).splitlines()
    assert lines[0] == HEADER
    assert "| ddlscope | ddlscope | 10.2 | 9.7 – 11.2 | +1.7 % | 9.2 | +0.9 % | 3.2 |" in lines
    assert "| overhead: ddlscope trainer + servers vs. plain (ms/step) | +1.7 % | < 3.0 % | yes, within noise |" in lines
    assert "| of it, the trainer's / the servers' (the mixed pairings) | +1.0 % / +0.5 % |  |  |" in lines
    assert "| overhead per repeat (paired, ms/step) | +2.0 %, -1.0 % |  |  |" in lines
    assert "| noise: plain + plain repeats' ms/step, (max - min) / median | 5.0 % |  |  |" in lines
    assert any("2 x 2 grid" in line and "servers on [1], [0]" in line for line in lines)
    missed = docs.dmoe_overhead_markdown(fake_dmoe_overhead_result(0.049, 0.01), header=HEADER).splitlines()
    assert "| overhead: ddlscope trainer + servers vs. plain (ms/step) | +4.9 % | < 3.0 % | **no** |" in missed


def test_dmoe_overhead_needs_its_result():
    with pytest.raises(UserError, match="not a benchmarks/dmoe_overhead.py result: missing 'grid_size'"):
        docs.dmoe_overhead_markdown({"model": "x"})


def fake_gpu_result() -> dict:
    run = {"model": "resnet18", "dataset": "cifar10", "batch_size": 64,
           "predicted": {"step_s": 0.0121, "allocator_bytes": 479 * 2**20, "runtime_bytes": 767 * 2**20},
           "measured": {"step_s": 0.0110, "allocator_bytes": 480 * 2**20, "runtime_bytes": 769 * 2**20},
           "step_error": 0.1, "allocator_error": -0.002, "allocator_within_target": True}
    band = {"what": "cpu -> gpu", "workload": "resnet18 / cifar10", "source": "Xeon", "target": "h100-80gb", "batch_size": 64,
            "predicted_step_s": 0.0041, "measured_step_s": 0.0111, "factor": 0.0089, "low": 0.00445, "high": 0.0178,
            "measured_factor": 0.0241, "inside": False}
    big = {"model": "resnet152", "dataset": "highres", "batch_size": 128, "largest_fitting_batch_size": 64,
           "memory_available_bytes": 79 * 2**30, "measured_batch_sizes": [8, 16, 32, 64], "extrapolated": True,
           "step_s": 0.688, "predicted_peak_bytes": 112 * 2**30, "seconds": 92.0, "fit_note": "batch 128 does not fit"}
    return {"gpu": "NVIDIA H100 80GB HBM3", "kind": "h100-80gb", "runs": [run], "bands": [band], "big": big,
            "machine": "16 cores (of 16), Xeon, 1 x NVIDIA H100 80GB HBM3, Linux 6.18", "commit": "abc1234",
            "measured_at": "2030-01-02 03:04:05"}


def test_gpu_tables_give_each_part_and_the_result_s_own_machine():
    body = docs.gpu_markdown(fake_gpu_result())
    lines = body.splitlines()
    assert "on 2030-01-02 03:04; machine: 16 cores (of 16), Xeon, 1 x NVIDIA H100 80GB HBM3" in lines[0]
    assert "commit abc1234." in lines[0]
    assert "| resnet18 / cifar10, batch 64 | 12.10 | 11.00 | +10.0 % | 479 | 480 | -0.2 % | yes | 767 | 769 |" in lines
    assert "| cpu -> gpu | resnet18 / cifar10 | Xeon | h100-80gb | 64 | 4.10 | 11.10 | x0.0089 [0.00445, 0.0178] | " \
           "x0.0241 | **no** |" in lines
    older = fake_gpu_result()  # a result written before bands named their workload
    del older["bands"][0]["workload"]
    assert "| cpu -> gpu | - | Xeon | h100-80gb | 64 |" in docs.gpu_markdown(older)
    assert "largest batch that fits: 64" in body and "extrapolated at 688.0 ms/step" in body
    with pytest.raises(UserError, match="not a benchmarks/gpu.py result: missing 'bands'"):
        docs.gpu_markdown({"gpu": "x", "runs": []})
