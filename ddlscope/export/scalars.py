"""One worker's measurements as scalars per step, for the experiment trackers (TensorBoard, W&B, MLflow).

The x axis is the step index (``steps.step``, the worker's micro-batch counter, warm-up steps
included). Per step of a worker:

=========================  ====================================================================
tag                        value
=========================  ====================================================================
``phase/<part>``           seconds of each step part (:data:`ddlscope.measure.parts.STEP_PARTS`,
                           disjoint: ``phase/optimizer_s`` without averaging)
``step/step_s``            the step's wall time, seconds
``step/loss``              training loss of the batch
``step/accuracy``          training-batch accuracy (fraction)
``step/samples_per_s``     throughput of the step, samples/s
``step/comm_s``            seconds with communication in flight (overlapped or not)
``step/comm_bytes``        payload bytes handed to collectives/transfers
``host/cpu_percent``       the worker's CPU % (100 = one core), last host sample taken in the step
``host/rss_bytes``         resident memory of the worker, bytes, same sample
``host/net_sent_bytes``    bytes sent by the worker so far, same sample
``host/net_recv_bytes``    bytes received so far, same sample
``eval/accuracy``          held-out accuracy of the evaluation after the step (fraction)
``eval/loss``              held-out loss of that evaluation
=========================  ====================================================================

A host sample belongs to the step that was running when it was taken (the last step started at or
before it; samples taken before the first step go to the first step). NULL values are left out.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from ddlscope.export.rows import RunRows, step_parts

STEP_TAGS = {"step_s": "step/step_s", "loss": "step/loss", "accuracy": "step/accuracy",
             "samples_per_s": "step/samples_per_s", "comm_s": "step/comm_s", "comm_bytes": "step/comm_bytes"}
HOST_TAGS = {"cpu_percent": "host/cpu_percent", "rss_bytes": "host/rss_bytes",
             "net_sent_bytes": "host/net_sent_bytes", "net_recv_bytes": "host/net_recv_bytes"}
EVAL_TAGS = {"accuracy": "eval/accuracy", "loss": "eval/loss"}


@dataclass
class StepScalars:
    """The scalars of one step of one worker: ``values`` maps a tag (see the module table) to a float."""

    step: int
    wall_time: float
    values: dict[str, float] = field(default_factory=dict)


def worker_scalars(rows: RunRows) -> dict[int, list[StepScalars]]:
    """``{worker index: [StepScalars, ...]}`` for every worker with any scalar, ascending by step.

    ``wall_time`` is the step's start (Unix seconds); a step that only an evaluation or a host sample
    names (none stored for it) gets the time of that row.
    """
    out: dict[int, list[StepScalars]] = {}
    for wi in rows.worker_indices():
        points: dict[int, StepScalars] = {}
        steps = [s for s in rows.steps if s["worker_index"] == wi]
        for s in steps:
            point = points[s["step"]] = StepScalars(s["step"], float(s["wall_time"]))
            point.values.update({f"phase/{p}": v for p, v in step_parts(s).items()})
            point.values.update({tag: float(s[col]) for col, tag in STEP_TAGS.items() if s[col] is not None})
        starts = [float(s["wall_time"]) for s in steps]
        for h in (h for h in rows.host_samples if h["worker_index"] == wi):
            at = _step_at(steps, starts, float(h["wall_time"]))
            point = points.setdefault(at, StepScalars(at, float(h["wall_time"])))
            point.values.update({tag: float(h[col]) for col, tag in HOST_TAGS.items() if h[col] is not None})
        for e in (e for e in rows.evals if e["worker_index"] == wi):
            point = points.setdefault(e["step"], StepScalars(e["step"], float(e["wall_time"])))
            point.values.update({tag: float(e[col]) for col, tag in EVAL_TAGS.items() if e[col] is not None})
        if points:
            out[wi] = [points[k] for k in sorted(points)]
    return out


def _step_at(steps: list[dict], starts: list[float], wall_time: float) -> int:
    """The step running at ``wall_time``: the last one started at or before it (the first step for an
    earlier time; 0 when the worker has no step)."""
    if not steps:
        return 0
    return steps[max(0, bisect.bisect_right(starts, wall_time) - 1)]["step"]
