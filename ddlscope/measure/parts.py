"""The one vocabulary of a training step's parts, shared by the loop, the store, the cost models,
the reports and the validation.

A step's wall time ``step_s`` is split into disjoint parts, each a column of the store's ``steps``
table (seconds per step of one worker) and a key of a prediction's ``breakdown_s``. So a run and a
prediction of the same cell can be printed side by side, part by part
(:func:`side_by_side`). What a distribution model does not have is 0 (``bubble_s`` of ``ddp``),
never a different name.

===============  ===========================================================================
part             seconds of the step spent ...
===============  ===========================================================================
data_load_s      blocked waiting for the batch (loading and preprocessing not hidden by prefetch)
forward_s        in the forward pass and the loss
backward_s       in the backward pass, including compute slowed by communication that overlaps it
comm_wait_s      blocked on communication after the compute was done (ddp/fsdp: the tail of the
                 last collectives; pipelines: the stage's sends and receives)
bubble_s         idle waiting for a neighbouring pipeline stage (the schedule's bubble)
optimizer_s      in the optimizer step, averaging excluded
averaging_s      averaging with other peers or workers in an averaging round (collaborative:
                 hivemind's rounds, matchmaking included, and its own background work; diloco:
                 the outer round, i.e. the pseudo-gradient all-reduce and the outer step)
===============  ===========================================================================

In the store ``optimizer_s`` of a step *includes* its ``averaging_s`` (the strategy's step is
timed as one); :func:`measured_parts` separates them, so the parts of a stored step add up to its
compute, communication and waiting exactly as a prediction's do.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

STEP_PARTS: tuple[str, ...] = ("data_load_s", "forward_s", "backward_s", "comm_wait_s", "bubble_s", "optimizer_s",
                               "averaging_s")
"""Every part of a step, in the order reports print them."""

PART_LABELS: dict[str, str] = {
    "data_load_s": "data loading", "forward_s": "forward", "backward_s": "backward",
    "comm_wait_s": "communication wait", "bubble_s": "pipeline bubble", "optimizer_s": "optimizer",
    "averaging_s": "averaging",
}
"""Human names of the parts (reports, verdicts)."""


def empty_parts() -> dict[str, float]:
    """``{part: 0.0}`` for every part, in :data:`STEP_PARTS` order."""
    return {p: 0.0 for p in STEP_PARTS}


def check_parts(parts: Mapping[str, float]) -> None:
    """Raise ``ValueError`` if ``parts`` has a key that is not a step part (a cost model's bug)."""
    unknown = sorted(set(parts) - set(STEP_PARTS))
    if unknown:
        raise ValueError(f"unknown step part(s) {unknown}; allowed: {', '.join(STEP_PARTS)}")


def measured_parts(steps: Iterable[Mapping[str, float | None]]) -> dict[str, float]:
    """Mean seconds per step of each part over stored step rows (warm-up rows should be left out).

    ``optimizer_s`` is reported without the ``averaging_s`` it contains in the store. Missing
    (NULL) values count as 0 for parts a model does not have.

    Returns:
        ``{part: mean seconds}`` for every part in :data:`STEP_PARTS`, plus ``step_s`` (the mean
        wall time), or ``{}`` when there are no rows.
    """
    rows = list(steps)
    if not rows:
        return {}
    out = empty_parts()
    for r in rows:
        for p in STEP_PARTS:
            out[p] += float(r.get(p) or 0.0)
    out["optimizer_s"] = max(0.0, out["optimizer_s"] - out["averaging_s"])
    out = {p: v / len(rows) for p, v in out.items()}
    out["step_s"] = sum(float(r.get("step_s") or 0.0) for r in rows) / len(rows)
    return out


def side_by_side(predicted: Mapping[str, float], measured: Mapping[str, float]) -> list[tuple[str, float, float | None]]:
    """Rows ``(part, predicted s, measured s or None)`` for every part either side has, in
    :data:`STEP_PARTS` order, then ``step_s``; for printing a prediction next to a run."""
    rows = [(p, float(predicted.get(p, 0.0)), measured.get(p)) for p in STEP_PARTS
            if predicted.get(p) or measured.get(p)]
    rows.append(("step_s", float(sum(predicted.get(p, 0.0) for p in STEP_PARTS)), measured.get("step_s")))
    return rows
