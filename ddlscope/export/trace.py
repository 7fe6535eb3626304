"""A Chrome trace-event JSON per run, ``OUT/<run_id>.trace.json``: open it in Perfetto
(ui.perfetto.dev), ``chrome://tracing`` or Holistic Trace Analysis.

Layout (the JSON object format: ``traceEvents`` plus ``otherData``):

- one process per worker (``pid`` = worker index + 2, named ``worker <k>`` with its host and pid),
  with one track (``tid`` 1, ``phases``) holding a complete event (``"ph": "X"``) per part of
  each step: ``data_load_s``, ``forward_s``, ``backward_s``, ``comm_wait_s``, ``bubble_s``,
  ``optimizer_s`` (without averaging), ``averaging_s`` (:data:`ddlscope.measure.parts.STEP_PARTS`);
  ``args`` carry the step index, samples and loss;
- the run's events on its workers' tracks as instant events (``"ph": "i"``; averaging rounds ...);
  events of no worker (expert server started / died / killed ...) on process 1, ``run <run_id>``,
  track 1 (pid 0 is avoided: Perfetto treats it as the kernel's idle process);
- expert servers and other services on process 1, one track per service, a complete event per
  process generation from its start to its end (where both are stored).

Times are microseconds since the run was created (``otherData.origin_unix_s``). The store keeps each
step's start (``steps.wall_time``) and each part's duration, not the parts' own start times, so the
parts are laid out back to back from the step's start, in the order above (the loop's order:
load, forward, backward with its communication wait and, in pipelines, the bubble, then the optimizer
step whose averaging comes last). Parts of 0 s get no event. Should a step's recorded start fall
before the end of the previous step's parts (two clocks, rounding to microseconds), the step is laid
out from that end instead, so the parts of a track never overlap; durations are always as stored.

``torch.profiler`` traces (``profile_steps = [a, b]``, :mod:`ddlscope.measure.torch_profile`): each
worker's trace named in a ``torch_profile`` event is merged into the worker's process, one track per
profiler track (``tid`` 100, 101, ..., named ``torch.profiler <process>: <thread>``: the CPU threads,
and on CUDA the GPU streams), right under the ``phases`` track. PyTorch's clock is not the store's, so
each profiled step is used as a clock pin: the worker read the Unix time right before it opened the
step's ``ProfilerStep#<step>`` annotation (stored in the event), and the profiler has that
annotation's start on its own clock; the shift from the profiler's clock to the trace's is the median
over the profiled steps of (stored start - annotation start), applied to every profiler event
(``otherData.torch_profiles`` has it per worker, with the largest step's deviation from it: how well
they line up). Kept: the profiler's spans, instants, counters and flows (flow ids made unique per
trace); dropped: its metadata (replaced by the names above), its own ``Trace`` bookkeeping spans and
its global instants. A trace that cannot be read, or with no step annotation matching a stored step
start, is left out and named in ``otherData.torch_profiles`` with the problem.
"""

from __future__ import annotations

import gzip
import json
import statistics
from pathlib import Path
from typing import Any

from ddlscope.export.rows import RunRows, step_parts
from ddlscope.measure.torch_profile import EVENT_KIND, STEP_MARK

RUN_PID, PHASES_TID = 1, 1
PROFILER_TID_BASE = 100
"""Track (``tid``) of a worker's first torch.profiler track; the next ones follow."""
FLOW_ID_STRIDE = 1 << 32
"""Integer flow ids of the run's ``n``-th profiler trace (0-based) are shifted by ``n + 1`` times this."""


def worker_pid(worker_index: int) -> int:
    """The trace ``pid`` of worker ``worker_index``'s process."""
    return worker_index + 2


def write(runs: list[RunRows], out_dir: Path) -> list[Path]:
    """Write ``OUT/<run_id>.trace.json`` for each run; returns the files written."""
    written = []
    for rows in runs:
        path = out_dir / f"{rows.run_id}.trace.json"
        path.write_text(json.dumps(trace(rows), default=str))
        written.append(path)
    return written


def trace(rows: RunRows) -> dict[str, Any]:
    """The trace of one run as a JSON-able dict (``{"traceEvents": [...], "otherData": {...}}``)."""
    origin = float(rows.run["created_at"])
    events = _metadata(rows)
    for wi in rows.worker_indices():
        events += _step_spans(rows, wi, origin)
    events += _service_spans(rows, origin)
    profile_events, profiles = _torch_profiles(rows, origin)
    events += profile_events
    for e in rows.events:
        pid = RUN_PID if e["worker_index"] is None else worker_pid(e["worker_index"])
        events.append({"name": e["kind"], "ph": "i", "s": "t", "pid": pid, "tid": PHASES_TID,
                       "ts": _us(float(e["wall_time"]) - origin), "args": json.loads(e["detail_json"] or "{}")})
    events.sort(key=lambda ev: (ev["ph"] != "M", ev.get("ts", 0)))
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"ddlscope_run_id": rows.run_id, "run_name": rows.run["name"],
                          "strategy": rows.run["strategy"], "status": rows.run["status"], "origin_unix_s": origin,
                          **({"torch_profiles": profiles} if profiles else {})}}


def _metadata(rows: RunRows) -> list[dict[str, Any]]:
    """Process and track names: the run's process, then each worker's."""
    workers = {w["worker_index"]: w for w in rows.workers}
    events = [_meta("process_name", RUN_PID, f"run {rows.run_id} ({rows.run['name']}, {rows.run['strategy']})"),
              _meta("process_sort_index", RUN_PID, sort_index=0), _meta("thread_name", RUN_PID, "run events")]
    for wi in rows.worker_indices():
        w = workers.get(wi, {})
        where = f" ({w.get('hostname')}, pid {w.get('pid')})" if w.get("hostname") else ""
        events += [_meta("process_name", worker_pid(wi), f"worker {wi}{where}"),
                   _meta("process_sort_index", worker_pid(wi), sort_index=wi + 1),
                   _meta("thread_name", worker_pid(wi), "phases")]
    return events


def _meta(kind: str, pid: int, name: str | None = None, sort_index: int | None = None,
          tid: int = PHASES_TID) -> dict[str, Any]:
    """A metadata event (``"ph": "M"``) naming or ordering a process or track."""
    args = {"name": name} if name is not None else {"sort_index": sort_index}
    return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": args}


def _step_spans(rows: RunRows, wi: int, origin: float) -> list[dict[str, Any]]:
    """Worker ``wi``'s parts, back to back from each step's start, never before the previous part's end."""
    spans, end_us = [], 0
    for s in (s for s in rows.steps if s["worker_index"] == wi):
        at_us = max(_us(float(s["wall_time"]) - origin), end_us)
        args = {"step": s["step"], "samples": s["samples"], "loss": s["loss"], "warmup": bool(s["warmup"])}
        for part, seconds in step_parts(s).items():
            dur_us = _us(seconds)
            if dur_us <= 0:
                continue
            spans.append({"name": part.removesuffix("_s"), "cat": "step", "ph": "X", "pid": worker_pid(wi),
                          "tid": PHASES_TID, "ts": at_us, "dur": dur_us, "args": args})
            at_us += dur_us
        end_us = at_us
    return spans


def _service_spans(rows: RunRows, origin: float) -> list[dict[str, Any]]:
    """One track per service (kind, index) on the run's process, a span per generation with a start and an end."""
    tracks: dict[tuple[str, int], int] = {}
    events = []
    for s in rows.services:
        key = (s["kind"], s["service_index"])
        if key not in tracks:
            tracks[key] = PHASES_TID + 1 + len(tracks)
            events.append(_meta("thread_name", RUN_PID, f"{s['kind']} {s['service_index']}", tid=tracks[key]))
        if s["started_at"] is None or s["ended_at"] is None:
            continue
        start_us = _us(float(s["started_at"]) - origin)
        events.append({"name": f"{s['kind']} {s['service_index']} generation {s['generation']}", "cat": "service",
                       "ph": "X", "pid": RUN_PID, "tid": tracks[key], "ts": start_us,
                       "dur": max(0, _us(float(s["ended_at"]) - origin) - start_us),
                       "args": {"status": s["status"], "reason": s["reason"], "pid": s["pid"]}})
    return events


def _us(seconds: float) -> int:
    """Seconds as whole microseconds (rounded)."""
    return round(seconds * 1e6)


def _torch_profiles(rows: RunRows, origin: float) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The events of every torch.profiler trace of the run (its ``torch_profile`` events), and a summary
    per trace for ``otherData.torch_profiles``; a worker with several traces gets tracks for each."""
    events, infos, tracks_used = [], [], {}
    for e in rows.events:
        if e["kind"] == EVENT_KIND and e["worker_index"] is not None:
            wi = e["worker_index"]
            merged, info = _torch_profile(wi, json.loads(e["detail_json"] or "{}"), origin,
                                          PROFILER_TID_BASE + tracks_used.get(wi, 0), len(infos))
            events += merged
            infos.append(info)
            tracks_used[wi] = tracks_used.get(wi, 0) + info.get("tracks", 0)
    return events, infos


def _torch_profile(wi: int, detail: dict[str, Any], origin: float, first_tid: int,
                   number: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Worker ``wi``'s torch.profiler trace (a ``torch_profile`` event's ``detail``) on its process, tracks
    from ``first_tid`` on, on the trace's clock, its integer flow ids shifted by ``number`` + 1 times
    :data:`FLOW_ID_STRIDE` (``number``: the trace's 0-based position among the run's); and what
    ``otherData.torch_profiles`` says about it (path, steps, events, tracks, clock shift and spread in
    microseconds, or the problem)."""
    path = Path(detail.get("path", ""))
    info: dict[str, Any] = {"worker": wi, "path": str(path),
                            "steps": [detail.get("first_step"), detail.get("last_step")]}
    try:
        with (gzip.open(path, "rt") if path.suffix == ".gz" else path.open()) as f:
            profile = json.load(f)
        raw = profile["traceEvents"]
    except (OSError, EOFError, ValueError, KeyError, TypeError) as err:
        return [], {**info, "problem": f"not merged: cannot read the trace ({type(err).__name__}: {err})"}
    starts = {int(s): float(t) for s, t in (detail.get("step_start_unix_s") or {}).items()}
    pins = [(starts[n] - origin) * 1e6 - float(ev["ts"]) for ev in raw
            if ev.get("ph") == "X" and (n := _step_mark(ev.get("name"))) is not None and n in starts]
    if not pins:
        return [], {**info, "problem": f"not merged: no {STEP_MARK}<step> annotation matches a stored step start"}
    shift_us = round(statistics.median(pins), 3)
    names = {(ev.get("pid"), ev.get("tid") if ev["name"] == "thread_name" else None): ev.get("args", {}).get("name")
             for ev in raw if ev.get("ph") == "M" and ev.get("name") in ("process_name", "thread_name")}
    tracks: dict[tuple[Any, Any], int] = {}
    merged, meta = [], []
    for ev in raw:
        if ev.get("ph") == "M" or ev.get("cat") == "Trace" or (ev.get("ph") in ("i", "I") and ev.get("s") == "g"):
            continue
        key = (ev.get("pid"), ev.get("tid"))
        if key not in tracks:
            tracks[key] = tid = first_tid + len(tracks)
            thread = names.get(key) or f"thread {key[1]}"
            meta += [_meta("thread_name", worker_pid(wi), f"torch.profiler {names.get((key[0], None)) or key[0]}: "
                                                          f"{thread}", tid=tid),
                     _meta("thread_sort_index", worker_pid(wi), sort_index=tid, tid=tid)]
        out = {**ev, "pid": worker_pid(wi), "tid": tracks[key]}
        if "ts" in ev:
            out["ts"] = round(float(ev["ts"]) + shift_us, 3)
        if isinstance(ev.get("id"), int):
            out["id"] = ev["id"] + (number + 1) * FLOW_ID_STRIDE
        elif "id" in ev:
            out["id"] = f"{number}:{ev['id']}"
        merged.append(out)
    return meta + merged, {**info, "events": len(merged), "tracks": len(tracks), "clock_shift_us": shift_us,
                           "alignment_spread_us": round(max(abs(p - shift_us) for p in pins), 3)}


def _step_mark(name: Any) -> int | None:
    """The step of a ``ProfilerStep#<step>`` annotation's name, else None."""
    if isinstance(name, str) and name.startswith(STEP_MARK) and name[len(STEP_MARK):].isdigit():
        return int(name[len(STEP_MARK):])
    return None
