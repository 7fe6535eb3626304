"""The validation report: predictions next to real runs, per cell of a grid (thesis 002 ch. 5, 6, 8).

Pure analysis over records: a :class:`ValidationCell` is one dataset x network x worker count with
one :class:`StrategyOutcome` per distribution model (the one-device ``single`` baseline included),
each holding the predicted and the measured seconds per epoch. Whoever runs the grid builds the
records; this module only computes and writes.

Definitions (all times are seconds per epoch):

- relative error ``(predicted - measured) / measured`` — positive means the predictor
  overestimates, the sign convention of thesis 002 Figures 4.1 and 5.1;
- recommended model: the lowest predicted time among the models predicted to fit in memory
  (thesis 002 ch. 8: models that do not fit are filtered out first); ``single`` is a candidate;
  the recommender's own rule (:func:`ddlscope.modeling.recommend.fastest_that_fits`);
- step parts: the prediction's parts next to the run's (:mod:`ddlscope.measure.parts`), each
  scaled to seconds per epoch by its own side's steps per epoch (:func:`epoch_parts`);
- actual fastest: the lowest measured time among the completed real runs;
- regret ``(T_recommended - T_fastest) / T_fastest``, measured times — the third line of each cell
  of thesis 002 Table 8.1 ("the relative difference in training time between these two");
- top-1 correct: recommended == actual fastest (thesis 002 Table 8.2's T/F);
- Kendall's tau (tau-b, ``scipy.stats.kendalltau``) between predicted and measured times of the
  models of one cell: 1 = the predictor orders the models exactly like the real runs.

Targets of issue 4 item 7 (:data:`TARGET_MAX_MEDIAN_ABS_ERROR`, :data:`TARGET_MIN_TOP1_RATE`,
:data:`TARGET_MAX_MEDIAN_REGRET`) are checked by :func:`summarize`.

:func:`write_validation_report` writes ``validation.md``, ``validation.html``, ``validation.json``,
``error.png`` (Figure 5.1 layout) and ``correctness.png`` (Table 8.2 as a heatmap).
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from scipy.stats import kendalltau as _scipy_kendalltau  # noqa: E402

from ddlscope.analyze.report import markdown_to_html  # noqa: E402
from ddlscope.analyze.sweep_report import markdown_table  # noqa: E402
from ddlscope.errors import UserError  # noqa: E402
from ddlscope.measure.parts import side_by_side  # noqa: E402
from ddlscope.modeling.recommend import fastest_that_fits  # noqa: E402

#: Issue 4 item 7: the median |relative error| of every distribution model must be at most this.
TARGET_MAX_MEDIAN_ABS_ERROR = 0.10
#: Issue 4 item 7: the recommended model must be the measured fastest in at least this share of cells.
TARGET_MIN_TOP1_RATE = 0.90
#: Issue 4 item 7: the median regret over cells must be at most this.
TARGET_MAX_MEDIAN_REGRET = 0.05

STATUSES = ("completed", "failed", "not-run")
COMPUTE_PARTS = ("forward_s", "backward_s", "optimizer_s")
"""The step parts that :attr:`StrategyOutcome.error_at_run_compute` takes from the run."""
#: error.png's y axis is clipped at +- this many % (clipped bars are labelled with their value).
ERROR_PLOT_LIMIT_PCT = 100.0


@dataclass
class StrategyOutcome:
    """One distribution model in one cell: the prediction and the real run.

    ``predicted_epoch_s`` / ``measured_epoch_s`` are seconds per epoch (> 0) or None (no
    prediction; the run failed or did not run). ``status`` is the real run's: "completed" (then
    ``measured_epoch_s`` is set), "failed" or "not-run" (then it is None, ``reason`` says why).
    ``reference_epoch_s`` holds the thesis's closed forms for the same setting, keyed by name
    (e.g. ``{"eq5.1": ...}`` for ddp, ``{"eq6.1+6.2": ...}`` for gpipe). ``predicted_parts_s`` is
    the prediction's ``breakdown_s`` (seconds per predicted step, by step part) and
    ``measured_parts_s`` the run's (:func:`ddlscope.measure.parts.measured_parts` of its measured
    steps: seconds per step of one worker, by part, with ``step_s``); empty when absent.
    """

    strategy: str                      # "single", "ddp", "fsdp", "gpipe", "1f1b", "collaborative"
    predicted_epoch_s: float | None    # None: no prediction (e.g. invalid setting)
    predicted_memory_bytes: int | None
    fits: bool | None                  # the prediction says it fits in memory
    measured_epoch_s: float | None     # None: the real run failed or did not run
    status: str                        # the real run: "completed", "failed", "not-run"
    reason: str | None = None          # why it failed / was not run
    reference_epoch_s: dict[str, float] = field(default_factory=dict)  # thesis closed forms
    dominant_cost: str | None = None   # the largest predicted step part, e.g. "backward_s", "comm_wait_s"
    measured_memory_bytes: int | None = None  # the real run's largest per-worker peak (CPU: peak RSS)
    predicted_parts_s: dict[str, float] = field(default_factory=dict)  # per predicted step, by step part
    measured_parts_s: dict[str, float] = field(default_factory=dict)   # per measured step, by part, + step_s
    # the largest worker's peak split as a measurement sees it (modeling.memory.peak_split_bytes): what
    # training allocates (GPU: max_memory_allocated; CPU: resident peak less the resident set at training's
    # start) and the process's memory before training (CUDA context / interpreter and libraries)
    predicted_allocator_bytes: int | None = None
    predicted_runtime_bytes: int | None = None
    measured_allocator_bytes: int | None = None
    measured_runtime_bytes: int | None = None
    # a grid with repeats > 1: every completed repeat's measured seconds per epoch in run order (the figures
    # above are the median run's), and, where each repeat had a prediction of its own (churn, a grid profiled
    # before each repeat), theirs
    measured_repeats_epoch_s: list[float] = field(default_factory=list)
    predicted_repeats_epoch_s: list[float] = field(default_factory=list)
    # averaging rounds that failed in each completed run (the median run's alone without repeats), in the order of
    # measured_repeats_epoch_s: a failed round stalls a swarm for its averaging timeout (predicted only for churn)
    failed_rounds_per_run: list[int] = field(default_factory=list)
    # hivemind's partial averaging rounds in each completed run, in the same order (None: not counted in that run)
    partial_rounds_per_run: list[int | None] = field(default_factory=list)
    # rounds that began hivemind's request_timeout late (a join request unanswered) in each completed run, same order
    join_timeouts_per_run: list[int | None] = field(default_factory=list)
    # collaborative: steps per peer per global epoch past the target batch size, as predicted (the hivemind fit's
    # overshoot, None for other models) and in each completed run (ddlscope.analyze.swarm.global_epochs), in the
    # order of measured_repeats_epoch_s; a run without a whole global epoch is left out
    predicted_overshoot_steps: float | None = None
    overshoot_steps_per_run: list[float] = field(default_factory=list)

    @property
    def measured(self) -> bool:
        """True when the real run completed with a measured time."""
        return self.status == "completed" and self.measured_epoch_s is not None

    @property
    def error(self) -> float | None:
        """:func:`relative_error` of the prediction, or None without a prediction or a measurement."""
        if self.predicted_epoch_s is None or not self.measured:
            return None
        return relative_error(self.predicted_epoch_s, self.measured_epoch_s)

    @property
    def error_at_run_compute(self) -> float | None:
        """:func:`relative_error` of the prediction with its compute parts (:data:`COMPUTE_PARTS`:
        forward, backward, optimizer) replaced by the run's, both in seconds per epoch
        (:func:`epoch_parts`); None without both sides' parts or without :attr:`error`, and for a
        model whose measured compute parts hold other work too (its registry entry's
        ``compute_parts_alone``: fsdp).

        What is left is the error of everything else the cost model predicts (communication
        waits, pipeline bubbles, averaging, data loading). A machine whose compute drifted
        between the profile and the run (another tenant, thermal state) moves :attr:`error`
        but not this one; a cost model that misjudges communication moves both.
        """
        if self.error is None or not self.predicted_parts_s or not self.measured_parts_s:
            return None
        from ddlscope import distribution

        if self.strategy in distribution.names() and not distribution.get(self.strategy).compute_parts_alone:
            return None
        compute = [(p, m) for part, p, m in epoch_parts(self) if part in COMPUTE_PARTS]  # a part neither has: 0
        if any(p is None or m is None for p, m in compute):
            return None
        held = self.predicted_epoch_s + sum(m - p for p, m in compute)
        return relative_error(held, self.measured_epoch_s) if held > 0 else None

    @property
    def memory_error(self) -> float | None:
        """:func:`relative_error` of the predicted allocator peak against the measured one (None
        without both)."""
        if not self.predicted_allocator_bytes or not self.measured_allocator_bytes:
            return None
        return relative_error(self.predicted_allocator_bytes, self.measured_allocator_bytes)

    @property
    def runtime_memory_error(self) -> float | None:
        """:func:`relative_error` of the predicted runtime memory against the measured (None without both)."""
        if not self.predicted_runtime_bytes or not self.measured_runtime_bytes:
            return None
        return relative_error(self.predicted_runtime_bytes, self.measured_runtime_bytes)

    @property
    def run_spread(self) -> float | None:
        """Run-to-run spread of the measured seconds per epoch over the cell's completed repeats:
        ``(max - min) / median``; None with fewer than 2. A prediction error well inside it cannot
        be told from noise."""
        runs = self.measured_repeats_epoch_s
        return (max(runs) - min(runs)) / statistics.median(runs) if len(runs) >= 2 else None

    @property
    def reference_errors(self) -> dict[str, float]:
        """:func:`relative_error` of every reference model (empty without a measurement)."""
        if not self.measured:
            return {}
        return {name: relative_error(v, self.measured_epoch_s) for name, v in self.reference_epoch_s.items()}


@dataclass
class ValidationCell:
    """One dataset x network x worker count, with one outcome per distribution model."""

    dataset: str
    network: str
    workers: int
    outcomes: list[StrategyOutcome]    # one per distribution model, including the one-device "single" baseline
    predict_s: float | None = None     # seconds to profile (or read the cached profile) and predict every model
    link: str | None = None            # the emulated links the cell ran on, e.g. "50 Mbit/s" (None: loopback)
    link_goodput: float | None = None  # share of their rate they carried each way with both ways busy (measured)
    averaging_goodput: float | None = None  # share of their rate hivemind's averaging rounds reached (collaborative)
    fsdp_goodput: float | None = None  # share of the slowest link's rate fsdp's unit collectives reached (gloo)
    # the hivemind fit each round was predicted with, where it was measured before each round (validate.round_hivemind_fit)
    hivemind_fits: list[dict[str, Any]] = field(default_factory=list)
    # with a round of runs per repeat: the averaging share measured before each round (averaging_goodput: the first's)
    averaging_goodput_rounds: list[float | None] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.dataset}/{self.network}/{self.workers}w"

    def outcome(self, strategy: str) -> StrategyOutcome | None:
        """The outcome of ``strategy``, or None if the cell has none."""
        return next((o for o in self.outcomes if o.strategy == strategy), None)


@dataclass
class ModelError:
    """Relative-error statistics of one prediction model over the cells (fractions, not %).

    ``count``: outcomes with both a prediction and a measurement; ``outcomes``: all outcomes of the
    model; ``without_measurement``: outcomes whose real run failed or did not run;
    ``without_prediction``: measured outcomes without a prediction. Statistics are None when
    ``count`` is 0; ``median_run_spread`` is None without outcomes measured more than once;
    ``median_abs_error_at_run_compute`` (of :attr:`StrategyOutcome.error_at_run_compute`) is None
    without outcomes whose both sides have step parts, and for reference closed forms and memory.
    """

    count: int
    outcomes: int
    without_measurement: int
    without_prediction: int
    median_abs_error: float | None
    max_abs_error: float | None
    median_error: float | None          # signed: > 0 the model overestimates on the median
    median_run_spread: float | None = None  # median StrategyOutcome.run_spread of outcomes with repeats
    median_abs_error_at_run_compute: float | None = None  # median |StrategyOutcome.error_at_run_compute|


@dataclass
class TargetResult:
    """One target of issue 4 item 7: ``passed`` is None when there is no data to check it."""

    name: str
    description: str
    threshold: float
    value: float | None
    passed: bool | None
    comparison: str = "<="             # value <= threshold passes; ">=": value >= threshold passes


@dataclass
class ValidationSummary:
    """Everything :func:`summarize` computes over the cells (fractions, not %).

    - ``per_model``: :class:`ModelError` per distribution model (strategy name);
    - ``per_reference``: the same per reference closed form, keyed ``"<strategy> <name>"``
      (e.g. ``"ddp eq5.1"``), so a model and its thesis reference can be compared;
    - ``per_link``: the same per distribution model on each emulated link of the grid, keyed
      ``"<strategy> @ <link>"`` (e.g. ``"ddp @ 50 Mbit/s"``), and ``per_link_reference`` per
      reference closed form there (``"ddp eq5.1 @ 50 Mbit/s"``): where communication dominates;
    - ``top1_correct`` / ``top1_determined``: cells whose recommendation is the measured fastest /
      cells where that could be decided (see :func:`top1_correct`); ``top1_rate`` their ratio;
    - regret statistics over ``regret_count`` cells; cells whose recommended model has no
      measurement are left out of them and counted in ``cells_recommended_unmeasured``;
    - Kendall's tau: mean and median over cells, and ``tau_pooled`` (:func:`pooled_kendall_tau`);
    - ``targets``: issue 4 item 7, one :class:`TargetResult` each;
    - ``per_model_memory`` / ``per_model_runtime_memory``: :class:`ModelError` of the predicted
      peak memory per model, its allocator part against the measured one and its runtime part
      against the measured runtime (:attr:`StrategyOutcome.memory_error`; reported, no target:
      issue 16's +-10 % is for GPUs, where the allocator part is ``max_memory_allocated``).
    """

    cells: int
    worker_counts: list[int]
    per_model: dict[str, ModelError]
    per_reference: dict[str, ModelError]
    per_link: dict[str, ModelError]
    per_link_reference: dict[str, ModelError]
    top1_correct: int
    top1_determined: int
    top1_rate: float | None
    regret_count: int
    median_regret: float | None
    max_regret: float | None
    mean_regret: float | None
    tau_count: int
    mean_tau: float | None
    median_tau: float | None
    tau_pooled: float | None
    cells_without_recommendation: int   # no model predicted to fit
    cells_without_measurement: int      # no completed real run
    cells_recommended_unmeasured: int   # the recommended model's run failed or did not run
    cells_recommended_failed: int       # ... of which failed (counted as incorrect in top-1)
    outcomes_without_measurement: int
    targets: list[TargetResult]
    per_model_memory: dict[str, ModelError] = field(default_factory=dict)
    per_model_runtime_memory: dict[str, ModelError] = field(default_factory=dict)

    @property
    def all_targets_met(self) -> bool:
        """True when every target passed (a target without data does not pass)."""
        return all(t.passed is True for t in self.targets)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "all_targets_met": self.all_targets_met}


# ---------------------------------------------------------------------------- per-cell measures

def relative_error(predicted: float, measured: float) -> float:
    """``(predicted - measured) / measured``; > 0 is an overestimate (thesis 002 Figs. 4.1, 5.1).

    Raises:
        UserError: ``measured`` is not a positive number of seconds.
    """
    if measured is None or not measured > 0 or math.isinf(measured):
        raise UserError(f"measured time = {measured!r}; allowed: a positive finite number of seconds")
    return (predicted - measured) / measured


def recommended(cell: ValidationCell) -> str | None:
    """The model with the lowest predicted seconds per epoch among those predicted to fit: the
    recommender's rule (:func:`ddlscope.modeling.recommend.fastest_that_fits`) over the cell's outcomes.

    Only outcomes with ``fits is True`` and a prediction are candidates — never one that does not
    fit or whose fit is unknown (thesis 002 ch. 8). ``single`` is a candidate like any other. Ties
    go to the first outcome in the cell's order. None when no model is predicted to fit.
    """
    best = fastest_that_fits(cell.outcomes, lambda o: o.predicted_epoch_s, lambda o: o.fits)
    return best.strategy if best else None


def actual_fastest(cell: ValidationCell) -> str | None:
    """The model with the lowest measured seconds per epoch among completed runs, or None."""
    done = [o for o in cell.outcomes if o.measured]
    return min(done, key=lambda o: o.measured_epoch_s).strategy if done else None


def regret(cell: ValidationCell) -> float | None:
    """``(T_recommended - T_fastest) / T_fastest`` over measured times (thesis 002 Table 8.1).

    0 when the recommendation is the fastest. None when nothing is recommended, nothing completed,
    or the recommended model's real run failed or did not run (:func:`summarize` counts those).
    """
    rec, fast = recommended(cell), actual_fastest(cell)
    if rec is None or fast is None:
        return None
    o_rec, o_fast = cell.outcome(rec), cell.outcome(fast)
    if not o_rec.measured:
        return None
    return (o_rec.measured_epoch_s - o_fast.measured_epoch_s) / o_fast.measured_epoch_s


def top1_correct(cell: ValidationCell) -> bool | None:
    """Is the recommendation the measured fastest? (thesis 002 Table 8.2's T/F).

    - no completed run: None (cannot be decided);
    - nothing recommended although a run completed: False;
    - the recommended model's run failed: False (the recommendation does not run);
    - the recommended model was not run: None (cannot be decided);
    - else ``recommended(cell) == actual_fastest(cell)``.
    """
    rec, fast = recommended(cell), actual_fastest(cell)
    if fast is None:
        return None
    if rec is None:
        return False
    status = cell.outcome(rec).status
    if status == "failed":
        return False
    if status != "completed":
        return None
    return rec == fast


def _tau_pairs(cell: ValidationCell) -> tuple[list[float], list[float]]:
    both = [o for o in cell.outcomes if o.predicted_epoch_s is not None and o.measured]
    return [o.predicted_epoch_s for o in both], [o.measured_epoch_s for o in both]


def kendall_tau(cell: ValidationCell) -> float | None:
    """Kendall's tau-b between predicted and measured seconds per epoch of the cell's models.

    Over the outcomes with both numbers (``scipy.stats.kendalltau``, Kendall 1938/1945); 1 = same
    order, -1 = reversed. None with fewer than two such outcomes or when either side is constant.
    """
    pred, meas = _tau_pairs(cell)
    if len(pred) < 2:
        return None
    tau = _scipy_kendalltau(pred, meas).statistic
    return None if math.isnan(tau) else float(tau)


def pooled_kendall_tau(cells: list[ValidationCell]) -> float | None:
    """Kendall's tau-b pooled over cells, comparing only models of the same cell.

    ``(C - D) / sqrt((P - T_pred) (P - T_meas))`` with C, D the concordant and discordant pairs,
    P all pairs and T_* the pairs tied in predicted / measured time, each summed over cells (a
    stratified tau-b; for one cell it equals :func:`kendall_tau`). Pairs across cells are not
    compared: the recommender only ranks models within a cell, and cross-cell pairs (a big
    dataset against a small one) would be easy and inflate the figure. None without pairs.
    """
    concordant = discordant = untied_pred = untied_meas = 0
    for cell in cells:
        pred, meas = _tau_pairs(cell)
        for i in range(len(pred)):
            for j in range(i + 1, len(pred)):
                dp = (pred[i] > pred[j]) - (pred[i] < pred[j])
                dm = (meas[i] > meas[j]) - (meas[i] < meas[j])
                concordant += dp * dm > 0
                discordant += dp * dm < 0
                untied_pred += dp != 0
                untied_meas += dm != 0
    if untied_pred == 0 or untied_meas == 0:
        return None
    return (concordant - discordant) / math.sqrt(untied_pred * untied_meas)


# ---------------------------------------------------------------------------- summary

def check_cells(cells: list[ValidationCell]) -> None:
    """Check the records are consistent.

    Raises:
        UserError: no cells; a cell with no outcomes or the same model twice (also a repeated
        dataset/network/workers cell); an unknown status; a completed run without a measured time
        or a measured time on a run that did not complete; a time that is not positive and finite.
    """
    if not cells:
        raise UserError("no validation cells; expected at least one dataset x network x workers cell")
    seen: set[tuple] = set()
    for cell in cells:
        key = (cell.dataset, cell.network, cell.workers)
        if key in seen:
            raise UserError(f"cell {cell.label} appears twice; each dataset/network/workers once")
        seen.add(key)
        if not cell.outcomes:
            raise UserError(f"cell {cell.label} has no outcomes; expected one per distribution model")
        names = [o.strategy for o in cell.outcomes]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise UserError(f"cell {cell.label}: distribution model(s) {dup} appear more than once")
        for o in cell.outcomes:
            where = f"cell {cell.label}, {o.strategy}"
            if o.status not in STATUSES:
                raise UserError(f"{where}: status = {o.status!r}; allowed: {', '.join(STATUSES)}")
            if o.status == "completed" and o.measured_epoch_s is None:
                raise UserError(f"{where}: status is 'completed' but measured_epoch_s is None")
            if o.status != "completed" and o.measured_epoch_s is not None:
                raise UserError(f"{where}: measured_epoch_s = {o.measured_epoch_s} but status is {o.status!r}; "
                                "a measured time needs status 'completed'")
            times = {"predicted_epoch_s": o.predicted_epoch_s, "measured_epoch_s": o.measured_epoch_s,
                     **{f"reference_epoch_s[{k!r}]": v for k, v in o.reference_epoch_s.items()}}
            for name, v in times.items():
                if v is not None and not (v > 0 and math.isfinite(v)):
                    raise UserError(f"{where}: {name} = {v!r}; allowed: a positive finite number of seconds")


def _model_error(outcomes: list[StrategyOutcome], errors: list[float | None], at_run_compute: bool = False
                 ) -> ModelError:
    vals = [abs(e) for e in errors if e is not None]
    held = [abs(e) for e in (o.error_at_run_compute for o in outcomes) if e is not None] if at_run_compute else []
    signed = [e for e in errors if e is not None]
    spreads = [o.run_spread for o in outcomes if o.run_spread is not None]
    return ModelError(
        count=len(vals), outcomes=len(outcomes),
        without_measurement=sum(not o.measured for o in outcomes),
        without_prediction=sum(o.measured and o.predicted_epoch_s is None for o in outcomes),
        median_abs_error=statistics.median(vals) if vals else None,
        max_abs_error=max(vals) if vals else None,
        median_error=statistics.median(signed) if signed else None,
        median_run_spread=statistics.median(spreads) if spreads else None,
        median_abs_error_at_run_compute=statistics.median(held) if held else None)


def summarize(cells: list[ValidationCell]) -> ValidationSummary:
    """Per-model errors, top-1 correctness, regret, Kendall's tau and the item-7 targets.

    See :class:`ValidationSummary` for the fields. The error target is checked for every
    distribution model present in the cells (``single`` and ``collaborative`` included), and
    again for each model on each emulated link (``per_link``: issue 14's cell groups); a group
    without any measured prediction gets ``passed=None`` ("no data"), which keeps
    :attr:`ValidationSummary.all_targets_met` False: an unchecked target is not a met one.

    Raises:
        UserError: inconsistent records (:func:`check_cells`).
    """
    check_cells(cells)
    by_model: dict[str, list[StrategyOutcome]] = defaultdict(list)
    by_ref: dict[str, list[tuple[StrategyOutcome, str]]] = defaultdict(list)
    for cell in cells:
        for o in cell.outcomes:
            by_model[o.strategy].append(o)
            for name in o.reference_epoch_s:
                by_ref[f"{o.strategy} {name}"].append((o, name))
    per_model = {s: _model_error(os, [o.error for o in os], at_run_compute=True) for s, os in by_model.items()}
    per_reference = {k: _model_error([o for o, _ in pairs], [o.reference_errors.get(n) for o, n in pairs])
                     for k, pairs in by_ref.items()}
    by_link: dict[str, list[StrategyOutcome]] = defaultdict(list)
    by_link_ref: dict[str, list[tuple[StrategyOutcome, str]]] = defaultdict(list)
    for cell in (c for c in cells if c.link is not None):
        for o in cell.outcomes:
            by_link[f"{o.strategy} @ {cell.link}"].append(o)
            for name in o.reference_epoch_s:
                by_link_ref[f"{o.strategy} {name} @ {cell.link}"].append((o, name))
    per_link = {k: _model_error(os, [o.error for o in os], at_run_compute=True) for k, os in by_link.items()}
    per_link_reference = {k: _model_error([o for o, _ in pairs], [o.reference_errors.get(n) for o, n in pairs])
                          for k, pairs in by_link_ref.items()}

    correct = [top1_correct(c) for c in cells]
    determined = [c for c in correct if c is not None]
    top1_rate = sum(determined) / len(determined) if determined else None
    regrets = [r for r in (regret(c) for c in cells) if r is not None]
    taus = [t for t in (kendall_tau(c) for c in cells) if t is not None]
    recs = [(c, recommended(c)) for c in cells]
    unmeasured = [(c, r) for c, r in recs if r is not None and not c.outcome(r).measured]
    median_regret = statistics.median(regrets) if regrets else None

    targets = []
    for s, m in [*per_model.items(), *per_link.items()]:
        targets.append(TargetResult(
            name=f"median abs error {s}", description=f"median |relative error| of {s} <= {TARGET_MAX_MEDIAN_ABS_ERROR:.0%}",
            threshold=TARGET_MAX_MEDIAN_ABS_ERROR, value=m.median_abs_error,
            passed=None if m.median_abs_error is None else m.median_abs_error <= TARGET_MAX_MEDIAN_ABS_ERROR))
    targets.append(TargetResult(
        name="top-1 rate", description=f"recommendation is the measured fastest in >= {TARGET_MIN_TOP1_RATE:.0%} of cells",
        threshold=TARGET_MIN_TOP1_RATE, value=top1_rate, comparison=">=",
        passed=None if top1_rate is None else top1_rate >= TARGET_MIN_TOP1_RATE))
    targets.append(TargetResult(
        name="median regret", description=f"median regret <= {TARGET_MAX_MEDIAN_REGRET:.0%}",
        threshold=TARGET_MAX_MEDIAN_REGRET, value=median_regret,
        passed=None if median_regret is None else median_regret <= TARGET_MAX_MEDIAN_REGRET))

    return ValidationSummary(
        cells=len(cells), worker_counts=sorted({c.workers for c in cells}),
        per_model=per_model, per_reference=per_reference, per_link=per_link, per_link_reference=per_link_reference,
        top1_correct=sum(1 for c in determined if c), top1_determined=len(determined), top1_rate=top1_rate,
        regret_count=len(regrets), median_regret=median_regret,
        max_regret=max(regrets) if regrets else None, mean_regret=statistics.fmean(regrets) if regrets else None,
        tau_count=len(taus), mean_tau=statistics.fmean(taus) if taus else None,
        median_tau=statistics.median(taus) if taus else None, tau_pooled=pooled_kendall_tau(cells),
        cells_without_recommendation=sum(r is None for _, r in recs),
        cells_without_measurement=sum(actual_fastest(c) is None for c in cells),
        cells_recommended_unmeasured=len(unmeasured),
        cells_recommended_failed=sum(c.outcome(r).status == "failed" for c, r in unmeasured),
        outcomes_without_measurement=sum(not o.measured for c in cells for o in c.outcomes),
        targets=targets,
        per_model_memory={s: _model_error(os, [o.memory_error for o in os]) for s, os in by_model.items()},
        per_model_runtime_memory={s: _model_error(os, [o.runtime_memory_error for o in os]) for s, os in by_model.items()})


# ---------------------------------------------------------------------------- (de)serialization

def cell_to_dict(cell: ValidationCell) -> dict[str, Any]:
    """The cell's record plus its derived figures (recommended, fastest, regret, correct, tau, errors)."""
    d = asdict(cell)
    for od, o in zip(d["outcomes"], cell.outcomes):
        od["error"] = o.error
        od["reference_errors"] = o.reference_errors
    d.update(recommended=recommended(cell), actual_fastest=actual_fastest(cell), regret=regret(cell),
             top1_correct=top1_correct(cell), kendall_tau=kendall_tau(cell))
    return d


def cell_from_dict(d: dict[str, Any]) -> ValidationCell:
    """Rebuild a :class:`ValidationCell` from :func:`cell_to_dict`'s output (derived keys ignored).

    Raises:
        UserError: a required key is missing.
    """
    out_fields = set(StrategyOutcome.__dataclass_fields__)
    try:
        outcomes = [StrategyOutcome(**{k: v for k, v in o.items() if k in out_fields}) for o in d["outcomes"]]
        return ValidationCell(dataset=d["dataset"], network=d["network"], workers=int(d["workers"]), outcomes=outcomes,
                              predict_s=d.get("predict_s"), link=d.get("link"), link_goodput=d.get("link_goodput"),
                              averaging_goodput=d.get("averaging_goodput"), fsdp_goodput=d.get("fsdp_goodput"),
                              hivemind_fits=d.get("hivemind_fits") or [],
                              averaging_goodput_rounds=d.get("averaging_goodput_rounds") or [])
    except (KeyError, TypeError) as e:
        raise UserError(f"validation record is missing a field or has a wrong one: {e}") from e


def load_validation(path: Path) -> list[ValidationCell]:
    """The cells stored in a ``validation.json`` written by :func:`write_validation_report`.

    Raises:
        UserError: the file is missing or is not such a report.
    """
    try:
        data = json.loads(Path(path).read_text())
        return [cell_from_dict(c) for c in data["cells"]]
    except FileNotFoundError as e:
        raise UserError(f"validation file not found: {path}") from e
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise UserError(f"{path} is not a validation.json written by ddlscope ({e})") from e


# ---------------------------------------------------------------------------- tables

def _pct(v: float | None, signed: bool = True) -> str:
    return "-" if v is None else format(100 * v, "+.1f" if signed else ".1f") + " %"


def _order(values) -> list:
    return list(dict.fromkeys(values))


def summary_table(summary: ValidationSummary) -> list[dict]:
    """The headline figures and the targets, one row each (percentages as text)."""
    def row(figure: str, value: str, target: str = "", met: str = "") -> dict:
        return {"figure": figure, "value": value, "target": target, "met": met}

    rows = [row("cells", str(summary.cells)),
            row("top-1 correct / decided", f"{summary.top1_correct} / {summary.top1_determined}")]
    rows += [row(t.name, _pct(t.value, False), f"{t.comparison} {_pct(t.threshold, False)}",
                 {True: "pass", False: "FAIL", None: "no data"}[t.passed]) for t in summary.targets]
    taus = (summary.mean_tau, summary.median_tau, summary.tau_pooled)
    unmeasured_not_run = summary.cells_recommended_unmeasured - summary.cells_recommended_failed
    rows += [row("max regret", _pct(summary.max_regret, False)),
             row("Kendall tau (mean / median / pooled)", " / ".join("-" if v is None else f"{v:.2f}" for v in taus)),
             row("cells with nothing predicted to fit", str(summary.cells_without_recommendation)),
             row("cells with no completed run", str(summary.cells_without_measurement)),
             row("cells whose recommended run failed / did not run",
                 f"{summary.cells_recommended_failed} / {unmeasured_not_run}")]
    return rows


def model_error_table(summary: ValidationSummary) -> list[dict]:
    """Per distribution model, then per reference closed form: count, median/max |error|, median
    error, the median run-to-run spread of cells measured more than once (grid ``repeats``), and the
    median |error| with the runs' own compute (:attr:`StrategyOutcome.error_at_run_compute`)."""
    rows = []
    for kind, group in (("model", summary.per_model), ("reference", summary.per_reference),
                        ("memory: allocator", summary.per_model_memory),
                        ("memory: runtime", summary.per_model_runtime_memory)):
        for name, m in group.items():
            if kind.startswith("memory") and not m.count:
                continue
            rows.append({"prediction": name, "kind": kind, "n": m.count, "median abs err": _pct(m.median_abs_error, False),
                         "max abs err": _pct(m.max_abs_error, False), "median err": _pct(m.median_error),
                         "not measured": m.without_measurement, "no prediction": m.without_prediction,
                         "run spread": _pct(m.median_run_spread, False),
                         "median abs err at the runs' compute": _pct(m.median_abs_error_at_run_compute, False)})
    return rows


def _grid(cells: list[ValidationCell], workers: int, fmt) -> list[dict]:
    sub = [c for c in cells if c.workers == workers]
    datasets, networks = _order(c.dataset for c in sub), _order(c.network for c in sub)
    by = {(c.dataset, c.network): c for c in sub}
    return [{"network": net, **{ds: (fmt(by[ds, net]) if (ds, net) in by else "-") for ds in datasets}}
            for net in networks]


def _t81(cell: ValidationCell) -> str:
    r = regret(cell)
    return f"{recommended(cell) or 'none fits'} / {actual_fastest(cell) or 'none ran'} / {_pct(r, False)}"


def _t82(cell: ValidationCell) -> str:
    return {True: "T", False: "F", None: "?"}[top1_correct(cell)]


def table_8_1(cells: list[ValidationCell], workers: int) -> list[dict]:
    """Thesis 002 Table 8.1's layout: rows networks, columns datasets, "recommended / fastest / regret"."""
    return _grid(cells, workers, _t81)


def table_8_2(cells: list[ValidationCell], workers: int) -> list[dict]:
    """Thesis 002 Table 8.2's layout (T/F, "?" undecided) plus a last row: correct share per dataset."""
    rows = _grid(cells, workers, _t82)
    sub = [c for c in cells if c.workers == workers]
    rate = {}
    for ds in _order(c.dataset for c in sub):
        dec = [x for x in (top1_correct(c) for c in sub if c.dataset == ds) if x is not None]
        rate[ds] = f"{100 * sum(dec) / len(dec):.0f} %" if dec else "-"
    return rows + [{"network": "correct", **rate}]


def epoch_parts(outcome: StrategyOutcome) -> list[tuple[str, float | None, float | None]]:
    """The outcome's step parts, predicted next to measured, in seconds per epoch.

    Rows ``(part, predicted, measured)`` of :func:`ddlscope.measure.parts.side_by_side` (parts in
    :data:`~ddlscope.measure.parts.STEP_PARTS` order, then ``"step_s"``, here the whole epoch).
    A prediction's parts are per predicted step and a run's per measured step of one worker
    (a collaborative prediction's step is a global epoch, a run's a peer's local step), so each
    side is scaled by its own steps per epoch: ``part x epoch_s / step_s``. A side without parts
    or without an epoch time is None. Empty when neither side has parts.
    """
    pred, meas = outcome.predicted_parts_s, outcome.measured_parts_s
    if not pred and not meas:
        return []
    pred_step = sum(pred.values())
    meas_step = meas.get("step_s") or sum(meas.values())
    pred_scale = outcome.predicted_epoch_s / pred_step if pred and outcome.predicted_epoch_s and pred_step > 0 else None
    meas_scale = outcome.measured_epoch_s / meas_step if meas and outcome.measured and meas_step > 0 else None
    return [(part, None if pred_scale is None else p * pred_scale,
             None if meas_scale is None or m is None else m * meas_scale) for part, p, m in side_by_side(pred, meas)]


def parts_table(cells: list[ValidationCell], only: ValidationCell | None = None) -> list[dict]:
    """One row per cell, distribution model and step part: predicted and measured seconds per epoch
    (:func:`epoch_parts`) and the part's relative difference; ``only``: the rows of one cell."""
    rows = []
    for c in cells if only is None else [only]:
        for o in c.outcomes:
            for part, p, m in epoch_parts(o):
                diff = relative_error(p, m) if p is not None and m is not None and m > 0 else None
                rows.append({"cell": c.label, "model": o.strategy, "part": "epoch" if part == "step_s" else part,
                             "predicted s/epoch": p, "measured s/epoch": m, "difference": _pct(diff)})
    return rows


def cells_table(cells: list[ValidationCell]) -> list[dict]:
    """One row per cell and distribution model: prediction, measurement, errors, memory, fit, status."""
    rows = []
    for c in cells:
        for o in c.outcomes:
            ref = ", ".join(f"{k}: {_pct(v)}" for k, v in o.reference_errors.items()) or "-"
            status = o.status if not o.reason else f"{o.status}: {o.reason}"
            stalled = sum(1 for n in o.failed_rounds_per_run if n)
            if stalled:
                status += f" ({stalled} of {len(o.failed_rounds_per_run)} runs had a failed averaging round)"
            if any(o.partial_rounds_per_run):
                status += (" (partial averaging rounds per run: "
                           + " / ".join("-" if n is None else str(n) for n in o.partial_rounds_per_run) + ")")
            if any(o.join_timeouts_per_run):
                status += (" (rounds begun late by a join timeout per run: "
                           + " / ".join("-" if n is None else str(n) for n in o.join_timeouts_per_run) + ")")
            if o.overshoot_steps_per_run:
                status += (" (peers ran " + " / ".join(f"{x:.2f}" for x in o.overshoot_steps_per_run)
                           + " steps past the target batch per global epoch"
                           + ("" if o.predicted_overshoot_steps is None else f"; predicted {o.predicted_overshoot_steps:.2f}")
                           + ")")
            rows.append({
                "dataset": c.dataset, "network": c.network, "workers": c.workers, "model": o.strategy,
                "predicted s/epoch": o.predicted_epoch_s, "measured s/epoch": o.measured_epoch_s,
                "runs": max(1, len(o.measured_repeats_epoch_s)) if o.measured else 0,
                "run spread": _pct(o.run_spread, False), "error": _pct(o.error),
                "error at the run's compute": _pct(o.error_at_run_compute), "reference error": ref,
                "memory MiB": None if o.predicted_memory_bytes is None else o.predicted_memory_bytes / 2**20,
                "memory error (allocator / runtime)": f"{_pct(o.memory_error)} / {_pct(o.runtime_memory_error)}",
                "fits": "-" if o.fits is None else ("yes" if o.fits else "no"),
                "dominant": o.dominant_cost or "-",
                "status": status.replace("|", "/").replace("\n", " "),
            })
    return rows


# ---------------------------------------------------------------------------- plots

def plot_error(cells: list[ValidationCell], path: Path) -> bool:
    """Thesis 002 Figure 5.1's layout, for every distribution model.

    One panel per distribution model (a row each; a column per worker count), datasets along x, one bar per
    network: the relative error of the prediction in %. Reference closed forms, where present, are
    the hatched, lighter bars right of their network's bar. A red x marks a cell without a
    measured prediction; dashed lines are the +-10 % target. Returns False (nothing written)
    when no cell has outcomes.
    """
    strategies = _order(o.strategy for c in cells for o in c.outcomes)
    workers = sorted({c.workers for c in cells})
    if not strategies:
        return False
    datasets, networks = _order(c.dataset for c in cells), _order(c.network for c in cells)
    refs = {s: _order(k for c in cells for o in c.outcomes if o.strategy == s for k in o.reference_epoch_s)
            for s in strategies}
    fig, axes = plt.subplots(len(strategies), len(workers), figsize=(6.0 * len(workers), 2.5 * len(strategies) + 0.6),
                             sharey=True, squeeze=False)
    slot = 0.8 / max(1, len(networks))
    hatches = ["//", "..", "xx", "\\\\"]
    drawn: list[tuple[Any, float, float]] = []  # (axes, x, error %) of every bar, to clip outliers
    for col, w in enumerate(workers):
        by = {(c.dataset, c.network): c for c in cells if c.workers == w}
        for row, s in enumerate(strategies):
            ax = axes[row][col]
            nbars = 1 + len(refs[s])
            bar = slot / nbars
            for j, net in enumerate(networks):
                for i, ds in enumerate(datasets):
                    cell = by.get((ds, net))
                    o = cell.outcome(s) if cell else None
                    if o is None:
                        continue
                    x0 = i + (j - (len(networks) - 1) / 2) * slot - slot / 2 + bar / 2
                    if o.error is not None:
                        ax.bar(x0, 100 * o.error, bar, color=f"C{j}", label=net if i == 0 else None)
                        drawn.append((ax, x0, 100 * o.error))
                    else:
                        ax.plot(x0, 0, "x", color="red", markersize=7)
                    for k, name in enumerate(refs[s]):
                        e = o.reference_errors.get(name)
                        if e is not None:
                            ax.bar(x0 + (k + 1) * bar, 100 * e, bar, color=f"C{j}", alpha=0.45,
                                   hatch=hatches[k % len(hatches)], edgecolor="black", linewidth=0.3)
                            drawn.append((ax, x0 + (k + 1) * bar, 100 * e))
            for y in (100 * TARGET_MAX_MEDIAN_ABS_ERROR, -100 * TARGET_MAX_MEDIAN_ABS_ERROR):
                ax.axhline(y, color="grey", linestyle="--", linewidth=0.8)
            ax.axhline(0, color="black", linewidth=0.6)
            ax.set_xticks(range(len(datasets)), datasets)
            ref_note = f" (hatched: {', '.join(refs[s])})" if refs[s] else ""
            ax.set_title(f"{s}, {w} workers{ref_note}", fontsize=9)
            if col == 0:
                ax.set_ylabel("rel. error (%)\n> 0: overestimate", fontsize=8)
    handles, labels = [], []
    for ax in axes.flat:  # one legend of the networks, from the first panel that has bars
        handles, labels = ax.get_legend_handles_labels()
        if handles:
            break
    if handles:
        axes[0][0].legend(handles, labels, fontsize=7)
    # one shared scale, at most +-ERROR_PLOT_LIMIT_PCT so that one outlier does not flatten every bar
    floor = 1.5 * 100 * TARGET_MAX_MEDIAN_ABS_ERROR  # the target lines always show
    hi = min(1.1 * max([v for _, _, v in drawn] + [floor]), ERROR_PLOT_LIMIT_PCT)
    lo = max(1.1 * min([v for _, _, v in drawn] + [-floor]), -ERROR_PLOT_LIMIT_PCT)
    axes[0][0].set_ylim(lo, hi)
    for ax, x, v in drawn:
        if v > hi or v < lo:
            ax.text(x, 0.9 * (hi if v > 0 else lo), f"{v:+.0f}", ha="center", va="center", fontsize=6,
                    rotation=90, bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.5})
    fig.suptitle("Prediction error per cell: (predicted - measured) / measured\n"
                 f"(x: no measurement, dashed: +-{100 * TARGET_MAX_MEDIAN_ABS_ERROR:.0f} % target, "
                 f"y axis clipped at +-{ERROR_PLOT_LIMIT_PCT:.0f} %)", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.5 / fig.get_figheight()))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_correctness(cells: list[ValidationCell], path: Path) -> bool:
    """Thesis 002 Table 8.2 as a heatmap: networks x datasets, one panel per worker count.

    Green T: the recommendation is the measured fastest; red F: it is not (the regret in % is
    written under the letter); grey ?: undecided; white: no such cell. Returns False when empty.
    """
    workers = sorted({c.workers for c in cells})
    if not workers:
        return False
    datasets, networks = _order(c.dataset for c in cells), _order(c.network for c in cells)
    fig, axes = plt.subplots(1, len(workers), figsize=(1.3 * len(datasets) * len(workers) + 1.8, 0.55 * len(networks) + 1.4),
                             squeeze=False)
    colours = {True: (0.55, 0.82, 0.55), False: (0.93, 0.5, 0.45), None: (0.82, 0.82, 0.82)}
    for ax, w in zip(axes[0], workers):
        by = {(c.dataset, c.network): c for c in cells if c.workers == w}
        img = [[(1.0, 1.0, 1.0)] * len(datasets) for _ in networks]
        for r, net in enumerate(networks):
            for q, ds in enumerate(datasets):
                cell = by.get((ds, net))
                if cell is None:
                    continue
                ok = top1_correct(cell)
                img[r][q] = colours[ok]
                text = {True: "T", False: "F", None: "?"}[ok]
                reg = regret(cell)
                if ok is False:
                    text += "\n" + (f"{100 * reg:.0f} %" if reg is not None else (recommended(cell) or "none fits"))
                ax.text(q, r, text, ha="center", va="center", fontsize=8)
        ax.imshow(img, aspect="auto")
        ax.set_xticks(range(len(datasets)), datasets, fontsize=8)
        ax.set_yticks(range(len(networks)), networks, fontsize=8)
        ax.set_title(f"{w} workers", fontsize=9)
    fig.suptitle("Recommendation correct? (T/F, regret under F)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------- report

def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def validation_markdown(cells: list[ValidationCell], summary: ValidationSummary, title: str,
                        extra: dict | None = None, images: tuple[str, ...] = ("error.png", "correctness.png")) -> str:
    """The Markdown text of the report (see :func:`write_validation_report`)."""
    verdict = "all targets met" if summary.all_targets_met else "targets NOT all met"
    md = [f"# {title}", "",
          f"{summary.cells} cells ({', '.join(f'{w} workers' for w in summary.worker_counts)}); {verdict}. "
          "Times are seconds per epoch; relative error = (predicted - measured) / measured, > 0 is an "
          "overestimate (thesis 002 Fig. 5.1); the recommended model is the fastest predicted among those "
          "predicted to fit; regret = (T_recommended - T_fastest) / T_fastest, measured (thesis 002 Table 8.1).", ""]
    if extra:
        md += [markdown_table([{"setting": k, "value": str(v).replace("|", "/")} for k, v in extra.items()]), ""]
    md += ["## Summary and targets (issue 4 item 7)", "", markdown_table(summary_table(summary)), ""]
    if summary.cells_recommended_unmeasured:
        md += [f"{summary.cells_recommended_unmeasured} cell(s) recommend a model whose real run failed or did not "
               "run: they have no regret and are left out of the regret statistics; a failed one counts as an "
               "incorrect recommendation, one not run as undecided.", ""]
    md += ["## Error per distribution model", "",
           "n: outcomes with a prediction and a measurement; reference rows are the thesis's closed forms "
           "for the same runs.", "", markdown_table(model_error_table(summary)), ""]
    if "error.png" in images:
        md += ["![error](error.png)", ""]
    for w in summary.worker_counts:
        md += [f"## Recommendations, {w} workers (Table 8.1 layout)", "",
               "Each cell: recommended / actual fastest / regret.", "", markdown_table(table_8_1(cells, w)), "",
               f"## Correctness, {w} workers (Table 8.2 layout)", "",
               "T: the recommendation is the measured fastest, F: it is not, ?: undecided (no completed run, "
               "or the recommended model was not run).", "", markdown_table(table_8_2(cells, w)), ""]
    if "correctness.png" in images:
        md += ["![correctness](correctness.png)", ""]
    parts = parts_table(cells)
    if parts:
        md += ["## Step parts, predicted vs measured", "",
               "Each side's parts of a step (ddlscope.measure.parts), scaled to seconds per epoch by its own steps "
               "per epoch; difference = (predicted - measured) / measured.", "", markdown_table(parts), ""]
    md += ["## All cells", "", markdown_table(cells_table(cells)), ""]
    return "\n".join(md)


def write_validation_report(cells: list[ValidationCell], out_dir: Path, title: str, extra: dict | None = None) -> Path:
    """Write the validation report folder; return the path of ``validation.md``.

    Files: ``validation.md`` (summary with targets, per-model errors, Tables 8.1 and 8.2 layouts
    per worker count, the step parts predicted vs measured, all cells), ``validation.html`` (the same), ``validation.json`` (title,
    ``extra``, the summary and every cell with its derived figures; :func:`load_validation` reads
    it back), ``error.png`` (:func:`plot_error`) and ``correctness.png`` (:func:`plot_correctness`).
    ``extra`` is a flat dict of settings shown at the top (e.g. the cluster, the preset).

    Raises:
        UserError: inconsistent records (:func:`check_cells`).
    """
    summary = summarize(cells)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    images = tuple(name for name, plot in (("error.png", plot_error), ("correctness.png", plot_correctness))
                   if plot(cells, out_dir / name))
    text = validation_markdown(cells, summary, title, extra, images)
    (out_dir / "validation.md").write_text(text)
    (out_dir / "validation.html").write_text(markdown_to_html(text))
    payload = {"title": title, "extra": extra or {}, "summary": summary.to_dict(),
               "cells": [cell_to_dict(c) for c in cells]}
    (out_dir / "validation.json").write_text(json.dumps(_json_safe(payload), indent=1, default=str))
    return out_dir / "validation.md"


def print_validation(cells: list[ValidationCell], console=None) -> None:
    """Compact rich tables in the terminal: summary and targets, per-model errors, Table 8.1 layout, and
    each cell's step parts, predicted vs measured (:func:`parts_table`).

    Args:
        console: a :class:`rich.console.Console`; default one on stdout at the terminal's width
            (columns wrap or fold when it is narrow).

    Raises:
        UserError: inconsistent records (:func:`check_cells`).
    """
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    summary = summarize(cells)
    console = console or Console()

    def show(title: str, rows: list[dict]) -> None:
        if not rows:
            return
        table = Table(title=escape(title))
        for i, col in enumerate(rows[0]):
            table.add_column(col, justify="left" if i == 0 else "right", overflow="fold")
        for r in rows:
            table.add_row(*("-" if v is None else format(v, ".4g") if isinstance(v, float) else escape(str(v))
                            for v in r.values()))
        console.print(table)

    show("validation summary", summary_table(summary))
    show("error per distribution model", model_error_table(summary))
    for w in summary.worker_counts:
        show(f"recommended / fastest / regret, {w} workers (Table 8.1 layout)", table_8_1(cells, w))
    for cell in cells:
        show(f"{cell.label}: step parts, predicted vs measured (s/epoch)",
             [{k: v for k, v in r.items() if k != "cell"} for r in parts_table(cells, only=cell)])
