"""``torch.profiler`` traces of chosen training steps (``profile_steps = [a, b]`` in the run config).

A worker keeps one :class:`StepProfiler`. It runs :class:`torch.profiler.profile` (CPU activities, plus
CUDA on a CUDA device) from the start of step ``a`` to the end of step ``b`` (the worker's 0-based step
indices, both included), marks each of those steps with a ``ProfilerStep#<step>`` annotation (the name
PyTorch's own step markers have, with the worker's step index as the number) and, when closed, writes
one Chrome trace per worker, ``<out_dir>/worker<k>.pt.trace.json.gz`` (gzip; Perfetto, TensorBoard's
profiler plugin and Holistic Trace Analysis open it as it is).

Right before it opens ``ProfilerStep#<step>`` it reads the Unix time (:func:`time.time`); these step
start times go into the run's ``torch_profile`` event (:func:`record_profile`) and are how
``ddlscope export --to trace`` puts the profiler's events on the run's clock
(:mod:`ddlscope.export.trace`).

Where the files go: :func:`profile_dir`, next to the run's logs (``<db folder>/logs/<run id>/torch_profile/``),
so that deleting a run (``ddlscope delete``) removes them too.

The profiled steps are slower than the others (the profiler records every operator); their stored
timings include that overhead. Stopping the profiler and writing the file happen outside the steps:
stopping after step ``b`` ends, writing in :meth:`StepProfiler.close`. Without ``profile_steps`` a
:class:`StepProfiler` does nothing (each call returns at once; torch.profiler is not even imported).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

TRACE_SUFFIX = ".pt.trace.json.gz"
"""Suffix of a worker's trace file: ``worker<k>.pt.trace.json.gz``."""
EVENT_KIND = "torch_profile"
"""``events.kind`` of the row :func:`record_profile` writes."""
STEP_MARK = "ProfilerStep#"
"""Name prefix of the annotation spanning each profiled step (``ProfilerStep#<step>``)."""


def check_profile_steps(profile_steps: Any, steps: int | None = None) -> tuple[int, int] | None:
    """``profile_steps`` as ``(a, b)``, or None when it is None.

    Args:
        profile_steps: None, or two ints ``[a, b]``: the first and last step to profile (0-based, both included).
        steps: the number of steps each worker trains, where known; then ``b`` must be below it.

    Raises:
        ValueError: not two ints, ``a < 0``, ``a > b``, or ``b >= steps``; the message says what is allowed.
    """
    if profile_steps is None:
        return None
    allowed = "two step indices [a, b] with 0 <= a <= b (0-based, both profiled)"
    try:
        a, b = profile_steps
    except (TypeError, ValueError):
        raise ValueError(f"profile_steps = {profile_steps!r}: expected {allowed}") from None
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (a, b)):
        raise ValueError(f"profile_steps = {list(profile_steps)!r}: expected {allowed}, as integers")
    if a < 0 or a > b:
        raise ValueError(f"profile_steps = [{a}, {b}]: expected {allowed}")
    if steps is not None and b >= steps:
        raise ValueError(f"profile_steps = [{a}, {b}]: the run trains {steps} step(s) per worker, "
                         f"so the last profiled step must be at most {steps - 1}")
    return a, b


def profile_dir(db_path: Path | str, run_id: str) -> Path:
    """The folder for run ``run_id``'s profiler traces: ``<db folder>/logs/<run id>/torch_profile``."""
    return Path(db_path).parent / "logs" / run_id / "torch_profile"


class StepProfiler:
    """Profiles steps ``a`` .. ``b`` of one worker with ``torch.profiler`` and writes a Chrome trace.

    Call :meth:`step_started` right before each step's work, :meth:`step_ended` right after it, and
    :meth:`close` once training stops (normally or not): it stops the profiler if it still runs and
    writes what was recorded. A run that stops before step ``a`` writes nothing; one that stops between
    ``a`` and ``b`` writes the steps it got to (the last one perhaps cut short).

    Args:
        profile_steps: ``(a, b)``, the first and last step to profile (0-based, both included), or None
            to profile nothing.
        out_dir: folder for the trace (created when the trace is written), e.g. :func:`profile_dir`.
        worker: the worker's index; the file is ``out_dir / f"worker{worker}.pt.trace.json.gz"``.
        device: the worker's device, ``"cpu"`` or ``"cuda"`` (``"cuda:N"``); CUDA activities are
            recorded on a CUDA device.

    Raises:
        ValueError: ``profile_steps`` is not two ints with ``0 <= a <= b`` (:func:`check_profile_steps`).
    """

    def __init__(self, profile_steps: tuple[int, int] | None, out_dir: Path, worker: int, device: str):
        self.steps_asked = check_profile_steps(profile_steps)
        self.path = Path(out_dir) / f"worker{worker}{TRACE_SUFFIX}"
        self.worker = worker
        self.cuda = str(device).startswith("cuda")
        self.step_start_unix_s: dict[int, float] = {}
        """Unix time right before ``ProfilerStep#<step>`` opened, per profiled step."""
        self._prof = None
        self._open_step: tuple[int, Any] | None = None  # (step, its record_function)
        self._running = self._done = False
        self._written: Path | None = None
        self.recorded = False
        """Whether :func:`record_profile` stored the trace's event (it does so once)."""

    @property
    def profiled_steps(self) -> tuple[int, int] | None:
        """First and last step that was (at least partly) profiled, or None before any."""
        if not self.step_start_unix_s:
            return None
        return min(self.step_start_unix_s), max(self.step_start_unix_s)

    def step_started(self, step: int) -> None:
        """Step ``step`` (0-based) begins: starts the profiler at the first step in ``[a, b]`` and marks the step."""
        if self.steps_asked is None or self._done:
            return
        a, b = self.steps_asked
        if not a <= step <= b:
            return
        from torch.profiler import ProfilerActivity, profile, record_function

        if not self._running:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            self._prof = profile(activities=activities)
            self._prof.start()
            self._running = True
        self._end_open_step()
        mark = record_function(f"{STEP_MARK}{step}")
        self.step_start_unix_s[step] = time.time()
        mark.__enter__()
        self._open_step = (step, mark)

    def step_ended(self, step: int) -> None:
        """Step ``step`` is over: closes its mark; after step ``b`` stops the profiler (:meth:`close` writes it)."""
        if not self._running:
            return
        if self._open_step is not None and self._open_step[0] == step:
            self._end_open_step()
        if step >= self.steps_asked[1]:
            self._stop()

    def close(self) -> Path | None:
        """Stop profiling if it still runs and write the trace; calling it again changes nothing.

        Returns:
            the trace written (``out_dir/worker<k>.pt.trace.json.gz``), or None when no step was profiled
            (profiling off, or the worker stopped before step ``a``).

        Raises:
            OSError: the trace cannot be written (e.g. the disk is full).
        """
        if self._running:
            self._end_open_step()
            self._stop()
        if self._prof is not None and self._written is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._prof.export_chrome_trace(str(self.path))
            self._written = self.path
            self._prof = None  # frees what the profiler collected
        return self._written

    def _end_open_step(self) -> None:
        if self._open_step is not None:
            self._open_step[1].__exit__(None, None, None)
            self._open_step = None

    def _stop(self) -> None:
        self._prof.stop()
        self._running, self._done = False, True


def record_profile(store, run_id: str, worker_index: int, profiler: StepProfiler) -> bool:
    """Record a written trace in the run's events: kind ``torch_profile``, detail ``path`` (absolute),
    ``first_step``, ``last_step`` and ``step_start_unix_s`` (``{"<step>": Unix seconds}``).

    Args:
        store: the run's :class:`~ddlscope.store.db.ResultsStore`.
        profiler: a closed :class:`StepProfiler`.

    Returns:
        whether a row was written: False when the profiler wrote no trace, or its row is stored already
        (calling it again, e.g. from an error path, adds nothing).

    Raises:
        OSError: the trace cannot be written; sqlite3.Error: the row cannot be stored.
    """
    if profiler.recorded or profiler.close() is None:
        return False
    first, last = profiler.profiled_steps
    starts = {str(s): t for s, t in sorted(profiler.step_start_unix_s.items())}
    store.add_event(run_id, worker_index, EVENT_KIND, path=str(profiler.path.resolve()), first_step=first,
                    last_step=last, step_start_unix_s=starts)
    profiler.recorded = True
    return True
