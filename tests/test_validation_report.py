"""The validation report over hand-made records: definitions, edge cases, targets, files."""

from __future__ import annotations

import json

import pytest
from scipy.stats import kendalltau

from ddlscope.errors import UserError
from ddlscope.predict.validation_report import (
    TARGET_MAX_MEDIAN_ABS_ERROR, TARGET_MAX_MEDIAN_REGRET, TARGET_MIN_TOP1_RATE, StrategyOutcome, ValidationCell,
    actual_fastest, epoch_parts, kendall_tau, load_validation, parts_table, pooled_kendall_tau, print_validation,
    recommended, regret, relative_error, summarize, top1_correct, write_validation_report)


def out(strategy, pred, meas, fits=True, status=None, reason=None, refs=None, mem=2**20):
    """An outcome: ``meas`` None means the run failed unless ``status`` says otherwise."""
    return StrategyOutcome(strategy=strategy, predicted_epoch_s=pred, predicted_memory_bytes=mem, fits=fits,
                           measured_epoch_s=meas, status=status or ("completed" if meas is not None else "failed"),
                           reason=reason, reference_epoch_s=refs or {})


def cell(outcomes, dataset="mnist", network="resnet18", workers=4):
    return ValidationCell(dataset=dataset, network=network, workers=workers, outcomes=outcomes)


def test_relative_error_sign_and_bad_measurement():
    assert relative_error(110.0, 100.0) == pytest.approx(0.10)   # overestimate: positive
    assert relative_error(80.0, 100.0) == pytest.approx(-0.20)   # underestimate: negative
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(UserError, match="positive finite"):
            relative_error(1.0, bad)


def test_recommended_never_picks_a_model_that_does_not_fit():
    c = cell([out("single", 100.0, 100.0), out("ddp", 10.0, 30.0, fits=False),
              out("fsdp", 20.0, 40.0, fits=None), out("gpipe", 50.0, 60.0)])
    assert recommended(c) == "gpipe"          # ddp and fsdp are faster on paper but not known to fit
    assert actual_fastest(c) == "ddp"         # ... yet the real ddp run completed and was fastest
    assert regret(c) == pytest.approx((60 - 30) / 30)
    assert top1_correct(c) is False


def test_nothing_fits_means_no_recommendation():
    c = cell([out("ddp", 10.0, 30.0, fits=False), out("gpipe", 20.0, None, fits=False)])
    assert recommended(c) is None
    assert regret(c) is None
    assert top1_correct(c) is False           # a model did run, the recommender offered none
    s = summarize([c])
    assert s.cells_without_recommendation == 1 and s.regret_count == 0


def test_single_is_a_candidate_and_correct_recommendation_has_zero_regret():
    c = cell([out("single", 5.0, 6.0), out("ddp", 8.0, 9.0)])
    assert recommended(c) == actual_fastest(c) == "single"
    assert regret(c) == 0.0 and top1_correct(c) is True


def test_recommended_without_measurement_is_counted_separately():
    failed = cell([out("ddp", 10.0, None, reason="out of memory"), out("gpipe", 20.0, 25.0)], network="vgg16")
    not_run = cell([out("ddp", 10.0, None, status="not-run", reason="skipped"), out("gpipe", 20.0, 25.0)],
                   network="vgg11")
    ok = cell([out("ddp", 10.0, 11.0), out("gpipe", 20.0, 22.0)])
    assert regret(failed) is None and regret(not_run) is None
    assert top1_correct(failed) is False      # the recommendation did not run
    assert top1_correct(not_run) is None      # undecided
    s = summarize([failed, not_run, ok])
    assert (s.cells_recommended_unmeasured, s.cells_recommended_failed) == (2, 1)
    assert (s.top1_correct, s.top1_determined) == (1, 2)
    assert s.regret_count == 1 and s.median_regret == 0.0
    assert s.per_model["ddp"].without_measurement == 2 and s.per_model["ddp"].count == 1


def test_kendall_tau_perfect_reversed_and_pooled():
    models = ["single", "ddp", "fsdp", "gpipe"]
    same = cell([out(m, p, p * 1.3) for m, p in zip(models, [4.0, 1.0, 2.0, 3.0])])
    rev = cell([out(m, p, 10 - p) for m, p in zip(models, [4.0, 1.0, 2.0, 3.0])], network="vgg11")
    assert kendall_tau(same) == pytest.approx(1.0)
    assert kendall_tau(rev) == pytest.approx(-1.0)
    assert pooled_kendall_tau([same, rev]) == pytest.approx(0.0)
    assert kendall_tau(cell([out("ddp", 1.0, 2.0), out("gpipe", 2.0, None)])) is None  # one pair only
    # a cell with ties: the pooled tau of one cell equals scipy's tau-b
    mixed = cell([out(m, p, q) for m, p, q in zip(models, [1.0, 1.0, 2.0, 3.0], [2.0, 1.0, 1.0, 4.0])])
    expected = kendalltau([1.0, 1.0, 2.0, 3.0], [2.0, 1.0, 1.0, 4.0]).statistic
    assert kendall_tau(mixed) == pytest.approx(expected)
    assert pooled_kendall_tau([mixed]) == pytest.approx(expected)


def _grid(error: float, wrong_cells: int, regret_frac: float) -> list[ValidationCell]:
    """10 cells; ddp predicted with relative error ``error``; ``wrong_cells`` recommend gpipe wrongly."""
    cells = []
    for i in range(10):
        m_ddp, m_gp = 10.0, 10.0 * (1 + regret_frac)
        if i < wrong_cells:   # the predictor puts gpipe first although ddp is faster
            p_ddp, p_gp = 12.0, 11.0
        else:
            p_ddp, p_gp = m_ddp * (1 + error), m_gp * (1 + error)
        cells.append(cell([out("ddp", p_ddp, m_ddp, refs={"eq5.1": 9.0}), out("gpipe", p_gp, m_gp)],
                          network=f"net{i}"))
    return cells


def test_targets_pass_and_fail():
    good = summarize(_grid(error=0.05, wrong_cells=0, regret_frac=0.5))
    assert good.all_targets_met
    assert good.top1_rate == 1.0 and good.median_regret == 0.0
    assert good.per_model["ddp"].median_abs_error == pytest.approx(0.05)
    assert good.per_reference["ddp eq5.1"].median_abs_error == pytest.approx(0.10)
    assert good.per_reference["ddp eq5.1"].median_error == pytest.approx(-0.10)

    big_error = summarize(_grid(error=0.2, wrong_cells=0, regret_frac=0.5))
    failed = {t.name for t in big_error.targets if t.passed is False}
    assert failed == {"median abs error ddp", "median abs error gpipe"} and not big_error.all_targets_met

    # 2 wrong of 10: top-1 80 % fails; the median regret is still 0 (8 correct cells)
    wrong = summarize(_grid(error=0.0, wrong_cells=2, regret_frac=0.5))
    assert wrong.top1_rate == pytest.approx(0.8) and wrong.top1_rate < TARGET_MIN_TOP1_RATE
    assert {t.name: t.passed for t in wrong.targets}["top-1 rate"] is False
    assert {t.name: t.passed for t in wrong.targets}["median regret"] is True
    assert wrong.max_regret == pytest.approx(0.5)

    # 6 wrong of 10 with 10 % regret each: median regret 10 % fails
    regretful = summarize(_grid(error=0.0, wrong_cells=6, regret_frac=0.1))
    assert regretful.median_regret == pytest.approx(0.1) and regretful.median_regret > TARGET_MAX_MEDIAN_REGRET
    assert {t.name: t.passed for t in regretful.targets}["median regret"] is False
    assert TARGET_MAX_MEDIAN_ABS_ERROR == 0.10


def test_model_without_measurement_has_no_data_target():
    c = cell([out("ddp", 10.0, 10.0), out("collaborative", 5.0, None, status="not-run", reason="no peers")])
    s = summarize([c])
    targets = {t.name: t.passed for t in s.targets}
    assert targets["median abs error collaborative"] is None and targets["median abs error ddp"] is True
    assert not s.all_targets_met


@pytest.mark.parametrize("cells, message", [
    ([], "no validation cells"),
    ([cell([out("ddp", 1.0, 1.0), out("ddp", 2.0, 2.0)])], r"\['ddp'\] appear more than once"),
    ([cell([out("ddp", 1.0, 1.0, status="crashed")])], "status = 'crashed'; allowed: completed, failed, not-run"),
    ([cell([out("ddp", 1.0, None, status="completed")])], "measured_epoch_s is None"),
    ([cell([out("ddp", 1.0, 2.0, status="failed")])], "a measured time needs status 'completed'"),
    ([cell([out("ddp", -1.0, 2.0)])], "predicted_epoch_s = -1.0"),
    ([cell([out("ddp", 1.0, 2.0)]), cell([out("ddp", 1.0, 2.0)])], "appears twice"),
    ([cell([])], "has no outcomes"),
])
def test_bad_records(cells, message):
    with pytest.raises(UserError, match=message):
        summarize(cells)


def test_report_files(tmp_path, capsys):
    cells = [
        cell([out("single", 40.0, 42.0), out("ddp", 11.0, 10.0, refs={"eq5.1": 8.0}),
              out("gpipe", 12.0, 15.0, refs={"eq6.1+6.2": 13.0})], dataset="mnist", network="resnet18"),
        cell([out("single", 90.0, 80.0), out("ddp", 20.0, None, fits=False, reason="out of memory | 3 GiB"),
              out("gpipe", 30.0, 33.0)], dataset="cifar10", network="resnet18"),
        cell([out("single", 40.0, 42.0), out("ddp", 11.0, 14.0), out("gpipe", 10.0, 12.0)],
             dataset="mnist", network="vgg11"),
    ]
    md_path = write_validation_report(cells, tmp_path / "rep", "Validation test", extra={"cluster": "local"})
    rep = tmp_path / "rep"
    for name in ("validation.md", "validation.html", "validation.json", "error.png", "correctness.png"):
        assert (rep / name).stat().st_size > 0, name
    md = md_path.read_text()
    # Table 8.1 layout: rows networks, columns datasets
    assert "| network | mnist | cifar10 |" in md
    assert "| resnet18 | ddp / ddp / 0.0 % | gpipe / gpipe / 0.0 % |" in md
    assert "| vgg11 | gpipe / gpipe / 0.0 % | - |" in md
    # Table 8.2 layout and the per-cell table (the reason's '|' must not break the table)
    assert "| resnet18 | T | T |" in md
    assert "failed: out of memory / 3 GiB" in md
    assert "eq5.1: -20.0 %" in md and "+10.0 %" in md
    assert "ddp eq5.1" in md and "gpipe eq6.1+6.2" in md
    assert "<table>" in (rep / "validation.html").read_text()
    data = json.loads((rep / "validation.json").read_text())
    assert data["summary"]["cells"] == 3 and data["extra"] == {"cluster": "local"}
    assert data["cells"][0]["recommended"] == "ddp"
    again = load_validation(rep / "validation.json")
    assert again == cells
    print_validation(cells)
    shown = capsys.readouterr().out
    assert "validation summary" in shown and "Table 8.1" in shown


def test_load_validation_bad_file(tmp_path):
    with pytest.raises(UserError, match="not found"):
        load_validation(tmp_path / "missing.json")
    (tmp_path / "v.json").write_text("{}")
    with pytest.raises(UserError, match="not a validation.json"):
        load_validation(tmp_path / "v.json")


def test_step_parts_print_side_by_side_per_epoch(tmp_path, capsys):
    # predicted: 2 s per step, 10 steps per epoch; measured: 4 s per step of one worker, 5 steps per epoch
    o = out("ddp", 20.0, 20.0)
    o.predicted_parts_s = {"forward_s": 0.5, "backward_s": 1.0, "comm_wait_s": 0.5, "bubble_s": 0.0}
    o.measured_parts_s = {"forward_s": 1.0, "backward_s": 2.0, "comm_wait_s": 0.5, "optimizer_s": 0.25,
                          "step_s": 4.0}
    rows = {part: (p, m) for part, p, m in epoch_parts(o)}
    assert "bubble_s" not in rows  # a part neither side has is left out
    assert rows["forward_s"] == pytest.approx((5.0, 5.0)) and rows["backward_s"] == pytest.approx((10.0, 10.0))
    assert rows["comm_wait_s"] == pytest.approx((5.0, 2.5)) and rows["optimizer_s"] == pytest.approx((0.0, 1.25))
    assert rows["step_s"] == pytest.approx((20.0, 20.0))  # each side scaled to its own seconds per epoch
    c = cell([o, out("single", 30.0, None)])
    table = parts_table([c])
    assert [r["part"] for r in table] == ["forward_s", "backward_s", "comm_wait_s", "optimizer_s", "epoch"]
    assert table[2]["difference"] == "+100.0 %"
    path = write_validation_report([c], tmp_path / "v", "t")
    assert "## Step parts, predicted vs measured" in path.read_text()
    assert load_validation(tmp_path / "v" / "validation.json")[0].outcomes[0].measured_parts_s == o.measured_parts_s
    print_validation([c])
    assert "step parts, predicted vs measured" in capsys.readouterr().out
    # a run that failed: its predicted parts only
    failed = out("gpipe", 10.0, None)
    failed.predicted_parts_s = {"forward_s": 1.0, "bubble_s": 1.0}
    assert [(p, m) for _, p, m in epoch_parts(failed)] == [(5.0, None), (5.0, None), (10.0, None)]
    assert epoch_parts(out("single", 1.0, 1.0)) == []


def test_the_error_at_the_runs_compute_takes_forward_backward_and_optimizer_from_the_run():
    # predicted: 4 s per step (10 steps per epoch); the run computed 25 % slower and waited as predicted
    o = out("ddp", 40.0, 50.0)
    o.predicted_parts_s = {"forward_s": 1.0, "backward_s": 2.0, "comm_wait_s": 1.0}
    o.measured_parts_s = {"forward_s": 1.25, "backward_s": 2.5, "comm_wait_s": 1.0, "optimizer_s": 0.25, "step_s": 5.0}
    assert o.error == pytest.approx(-0.2) and o.error_at_run_compute == pytest.approx(0.0)
    # the same, but the run also waited twice as long: the rest of the model is off
    slow = out("ddp", 40.0, 60.0)
    slow.predicted_parts_s = dict(o.predicted_parts_s)
    slow.measured_parts_s = {**o.measured_parts_s, "comm_wait_s": 2.0, "step_s": 6.0}
    assert slow.error_at_run_compute == pytest.approx(50.0 / 60.0 - 1)
    # without parts on either side, or without a measurement: unknown
    assert out("ddp", 40.0, 50.0).error_at_run_compute is None
    failed = out("ddp", 40.0, None)
    failed.predicted_parts_s = dict(o.predicted_parts_s)
    assert failed.error_at_run_compute is None
    summary = summarize([cell([o, out("single", 30.0, 30.0)]), cell([slow, out("single", 30.0, 30.0)], network="vgg11")])
    assert summary.per_model["ddp"].median_abs_error_at_run_compute == pytest.approx((0 + 1 / 6) / 2)
    assert summary.per_model["single"].median_abs_error_at_run_compute is None
    assert all(m.median_abs_error_at_run_compute is None for m in summary.per_reference.values())
    from ddlscope.predict.validation_report import cells_table

    rows = {r["network"]: r for r in cells_table([cell([o]), cell([slow], network="vgg11")])}
    assert rows["resnet18"]["error at the run's compute"] == "+0.0 %" and rows["vgg11"]["error"] == "-33.3 %"
    assert rows["resnet18"]["status"] == "completed"
    slow.failed_rounds_per_run = [0, 2, 0]  # the second of three runs stalled twice in a failed round
    [row] = cells_table([cell([slow], network="vgg11")])
    assert row["status"] == "completed (1 of 3 runs had a failed averaging round)"
    slow.overshoot_steps_per_run, slow.predicted_overshoot_steps = [0.35, 0.4, 0.42], 0.3
    [row] = cells_table([cell([slow], network="vgg11")])
    assert row["status"].endswith("(peers ran 0.35 / 0.40 / 0.42 steps past the target batch per global epoch; "
                                  "predicted 0.30)")
    slow.partial_rounds_per_run = [3, None, 0]  # the second run's peers did not count them: not 0
    [row] = cells_table([cell([slow], network="vgg11")])
    assert "(1 of 3 runs had a failed averaging round) (partial averaging rounds per run: 3 / - / 0) (peers ran" \
        in row["status"]
    slow.join_timeouts_per_run = [0, None, 2]  # rounds begun 3 s late (hivemind's request_timeout) in the third run
    [row] = cells_table([cell([slow], network="vgg11")])
    assert "(partial averaging rounds per run: 3 / - / 0) (rounds begun late by a join timeout per run: 0 / - / 2) " \
        "(peers ran" in row["status"]
    # fsdp's measured forward holds the all-gathers it waited for (on CPU): not taken at the run's compute
    sharded = out("fsdp", 40.0, 50.0)
    sharded.predicted_parts_s, sharded.measured_parts_s = dict(o.predicted_parts_s), dict(o.measured_parts_s)
    assert sharded.error is not None and sharded.error_at_run_compute is None


def test_recommended_is_the_recommenders_rule():
    from ddlscope.modeling.recommend import fastest_that_fits

    outcomes = [out("single", 5.0, 6.0, fits=None), out("ddp", 8.0, 9.0), out("fsdp", 8.0, 7.0),
                out("gpipe", 1.0, 1.0, fits=False)]
    assert recommended(cell(outcomes)) == fastest_that_fits(outcomes, lambda o: o.predicted_epoch_s,
                                                            lambda o: o.fits).strategy == "ddp"  # a tie: the first


def test_cells_on_emulated_links_get_error_groups_and_targets_of_their_own():
    loopback = cell([out("ddp", 1.0, 1.0, refs={"eq5.1": 1.0})])
    slow = [ValidationCell(dataset="mnist", network=f"{net} @ 50 Mbit/s", workers=2, link="50 Mbit/s",
                           outcomes=[out("ddp", 1.0, meas, refs={"eq5.1": 0.5})])
            for net, meas in (("resnet18", 1.25), ("vgg11", 1.5))]
    s = summarize([loopback, *slow])
    # the model's pooled error hides what the slow link does; its group there shows it
    assert s.per_model["ddp"].median_abs_error == pytest.approx(0.2)
    assert s.per_link["ddp @ 50 Mbit/s"].median_abs_error == pytest.approx((0.2 + 1 / 3) / 2)
    assert s.per_link_reference["ddp eq5.1 @ 50 Mbit/s"].count == 2
    passed = {t.name: t.passed for t in s.targets}
    assert passed["median abs error ddp @ 50 Mbit/s"] is False and "median abs error ddp" in passed
    # the link survives the report's JSON
    from ddlscope.predict.validation_report import cell_from_dict, cell_to_dict
    assert cell_from_dict(json.loads(json.dumps(cell_to_dict(slow[0])))).link == "50 Mbit/s"
