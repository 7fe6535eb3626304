"""Calibrating dmoe: what a beam search and a remote expert call cost here (``ddlscope calibrate --dmoe``).

A ``dmoe`` trainer (Ryabinin & Gusev 2020; hivemind 1.1.12 ``hivemind.moe.RemoteMixtureOfExperts``)
pays, besides its own compute, for

1. a **beam search** over the DHT for each sample's ``k_best`` experts
   (``MoEBeamSearcher.batch_find_best_experts``: one look-up round per grid dimension but the last,
   at least one; every sample's search runs as its own coroutine in the trainer's DHT process);
2. a **forward round** of ``_RemoteCallMany``: one RPC per sample per chosen expert, ``B x k``
   calls sent from one event-loop thread (``RemoteExpertWorker``), each carrying one sample; the
   server's connection handler queues them in the expert's task pool, its Runtime thread runs
   them in batches;
3. a **backward round**: the same number of calls carrying the input and the output gradient
   back; the server re-runs the forward, computes the input gradient and steps the expert's
   optimizer.

None of this is in a profile or a gloo microbenchmark, and on CPUs its per-call cost (protobuf
serialization, ``p2pd`` on both sides, the task pools' inter-process queues) is milliseconds, far
above the wire time of a few hundred bytes. So this module measures it on this machine, with
experts that cost next to nothing to compute (``y = w x``: one scalar parameter), so that the
per-call figures are hivemind's own and the cost model adds the real experts' compute from the
profile:

* a **server** child process (``python -m ddlscope.profiling.dmoe_rpc --serve``), pinned to one
  core with one intra-op thread, runs hivemind's ``Server`` with one connection handler (as
  :mod:`ddlscope.moe.server` does) on loopback, hosting two such experts per payload size
  (:data:`PAYLOAD_HIDDEN`: 64-byte and 64-KiB samples) and declaring the ids of
  :data:`BEAM_SIDE`-wide grids of 1, 2 and 3 dimensions in its DHT (look-ups only: nothing calls
  them);
* a **client** child process (``--client``), pinned to another core, joins that DHT in client
  mode and times, after one untimed warm-up call of each configuration, :data:`REPEATS` calls of
  the beam search (each grid, :data:`BEAM_BATCHES`, ``k_best`` 1 and 2) and of forward and
  backward rounds (each payload, :data:`ROUND_BATCHES`, ``k_best`` in :data:`ROUND_K`), reading
  the CPU seconds of both process trees (their DHT, task pools, connection handler and ``p2pd``
  included) around every round from the scheduler's nanosecond counters of every thread
  (``/proc/<pid>/task/<tid>/schedstat``: the clock-tick figures of ``cpu_times`` are 10 ms
  coarse, as long as a small round);
* a **second client** (``--second``), pinned to the server's core, joins too and waits idle; at
  the end the first client runs :data:`SHARED_ROUNDS` rounds of 16 samples x ``k_best`` 2 alone,
  then as many while the second client runs as many at once (what a run on shared cores does: a
  trainer on each server's core, several trainers calling one server), reading the CPU of all
  three process trees around each block.

:func:`fit_dmoe` reduces the client's times (a 20 %-trimmed mean per configuration) to a
:class:`~ddlscope.modeling.cluster.DMoEFit`: the beam search as ``fixed + B x rounds x lookup``
(:func:`fit_beam_search`), each direction's rounds as ``fixed + C x (per_call + bytes / rate)``
(:func:`fit_rounds`), both by least squares on relative residuals (every configuration counts
alike, however long it takes), each side's CPU per round as ``units x unit + C x (per_call +
bytes / rate)`` (:func:`fit_cpu`: units are the server's batches, one per expert a round
reaches, or the client's one round), and the shared blocks' CPU per call together over alone
as ``colocated_cpu_ratio``. The whole measurement takes about 35 s on two cores; the children
die with their parent and are terminated, then killed (whole process groups: hivemind's task
pools, DHT and ``p2pd``), however it ends.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ddlscope.measure.stats import trimmed_mean
from ddlscope.modeling.cluster import DMoEFit, beam_search_rounds

PAYLOAD_HIDDEN: tuple[int, ...] = (16, 16384)
"""Widths of the reference experts' samples: 64 bytes (an ``ffn`` of hidden 16) and 64 KiB (a
``transformer`` expert's ``[1, 128, 128]`` sample), float32."""
ROUND_BATCHES: tuple[int, ...] = (4, 16, 64)
"""Samples per forward/backward round (the calls are ``B x k``)."""
ROUND_K: tuple[int, ...] = (1, 2)
"""``k_best`` of the rounds: experts each sample is sent to."""
ROUND_EXPERTS = 2
"""Reference experts per payload size (a one-dimensional grid of 2)."""
BEAM_DIMS: tuple[int, ...] = (1, 2, 3)
"""Grid dimensions of the beam searches."""
BEAM_SIDE = 4
"""Size of every dimension of the beam-search grids (4, 16 and 64 declared ids)."""
BEAM_BATCHES: tuple[int, ...] = (4, 16, 64)
BEAM_K: tuple[int, ...] = (1, 2)
BEAM_REPEATS = 9
"""Timed beam searches per configuration (they are cheap and noisy)."""
REPEATS = 5
"""Timed calls per configuration (after one untimed warm-up call); their 20 %-trimmed mean is used."""
TRIM = 0.2
CALL_TIMEOUT_S = 30.0
"""``forward_timeout`` / ``backward_timeout`` of the rounds: a call not answered by then fails the calibration."""
DEFAULT_TIMEOUT_S = 120.0
"""Seconds: the measurement fails when no progress line comes for this long (its phases took up to
23 s alone here; the whole took 65 s alone and 86 s in a busy test suite)."""
STOP_GRACE_S = 3.0
SERVER_SILENT_S = 40.0
"""Seconds the expert server may take to serve before it is killed and started once more (it starts in ~2 s)."""
UPDATE_PERIOD_S = 300.0
"""The server re-declares its experts this rarely, so that no re-declaration falls inside the measurement."""
SHARED_HIDDEN, SHARED_BATCH, SHARED_K = 16, 16, 2
"""The shared rounds: 64-byte samples, 16 samples x ``k_best`` 2 = 32 calls a round (a trainer's
mixture layer at batch 16)."""
SHARED_ROUNDS = 25
"""Rounds (forward and backward) of each block of the shared measurement."""


class DMoECalibration(BaseModel):
    """What :func:`calibrate_dmoe` measured and fitted (seconds, bytes).

    Attributes:
        fit: the fitted costs (:class:`~ddlscope.modeling.cluster.DMoEFit`).
        beam: per configuration ``{"dims", "batch", "k", "times_s"}`` (the timed repeats).
        rounds: per configuration ``{"direction", "hidden", "batch", "k", "calls", "bytes_per_call",
            "times_s", "server_cpu_s", "client_cpu_s", "answered"}`` (per repeat).
        beam_residuals / forward_residuals / backward_residuals: ``(fitted - measured) / measured``
            per configuration, in the order of ``beam`` / the rounds of that direction.
        shared: the shared rounds (:func:`_shared_rounds`): CPU seconds of the server, the client
            and the second client alone and together, per call, and their ``ratio``; None when
            this process may use only one core (no second client).
        server_core / client_core: the cores the server (and the second client) and the client
            were pinned to (the same core when this process may use only one).
        startup_s: seconds until the server answered and the clients had joined.
    """

    model_config = ConfigDict(extra="forbid")

    fit: DMoEFit
    beam: list[dict[str, Any]]
    rounds: list[dict[str, Any]]
    beam_residuals: list[float]
    forward_residuals: list[float]
    backward_residuals: list[float]
    shared: dict[str, Any] | None = None
    server_core: int
    client_core: int
    startup_s: float = Field(ge=0)
    elapsed_s: float = Field(ge=0)
    notes: list[str] = Field(default_factory=list)


# ------------------------------------------------------------------------------------ fitting
class RoundFit(BaseModel):
    """``t = fixed_s + calls x (per_call_s + bytes_per_call / (gb_per_s x 1e9))`` and its relative residuals."""

    model_config = ConfigDict(extra="forbid")

    fixed_s: float
    per_call_s: float
    gb_per_s: float | None
    residuals: list[float]


def _relative_lstsq(columns: list[list[float]], measured: list[float]) -> list[float]:
    """Least squares of ``measured ≈ sum_j coef_j x columns[j]`` on relative residuals (each row
    divided by its measured value)."""
    import numpy as np

    m = np.asarray(measured, dtype=float)
    a = np.asarray(columns, dtype=float).T / m[:, None]
    coef, *_ = np.linalg.lstsq(a, np.ones_like(m), rcond=None)
    return [float(c) for c in coef]


def _check_rows(name: str, measured: Sequence[float], needed: int) -> None:
    if len(measured) < needed:
        raise ValueError(f"{name}: {len(measured)} measurement(s); need at least {needed}")
    if any(not (t > 0) for t in measured):
        raise ValueError(f"{name}: every measured time must be > 0 s, got {list(measured)}")


def fit_beam_search(batches: Sequence[float], dims: Sequence[int], times_s: Sequence[float]) -> tuple[float, float, list[float]]:
    """Fit ``t = fixed_s + B x rounds x lookup_s`` (``rounds`` = :func:`~ddlscope.modeling.cluster.beam_search_rounds`
    of ``dims``) to beam searches of ``batches[i]`` samples over grids of ``dims[i]`` dimensions.

    Least squares on relative residuals; a negative intercept is refitted through the origin.

    Returns:
        ``(fixed_s, lookup_s, residuals)``, residuals ``(fitted - measured) / measured`` per row.

    Raises:
        ValueError: fewer than 2 rows, lengths that differ, a time <= 0, or fewer than 2
            distinct ``B x rounds`` (the two terms cannot be told apart), or a slope <= 0.
    """
    if not len(batches) == len(dims) == len(times_s):
        raise ValueError(f"beam search: {len(batches)} batches, {len(dims)} dims, {len(times_s)} times; allowed: equal")
    _check_rows("beam search", times_s, 2)
    x = [b * beam_search_rounds(d) for b, d in zip(batches, dims)]
    if len(set(x)) < 2:
        raise ValueError("beam search: need at least 2 distinct batch x rounds to fit a fixed and a per-look-up cost")
    fixed, slope = _relative_lstsq([[1.0] * len(x), x], list(times_s))
    if fixed < 0:
        fixed, (slope,) = 0.0, _relative_lstsq([x], list(times_s))
    if slope <= 0:
        raise ValueError(f"beam search: the time does not grow with batch x rounds (slope {slope:.3g} s); "
                         f"the measurements are noise")
    return fixed, slope, [(fixed + slope * xi - t) / t for xi, t in zip(x, times_s)]


def fit_rounds(calls: Sequence[float], bytes_per_call: Sequence[float], times_s: Sequence[float],
               name: str = "rounds") -> RoundFit:
    """Fit ``t = fixed_s + C x (per_call_s + bytes_per_call / (gb_per_s x 1e9))`` to rounds of ``calls[i]``
    calls moving ``bytes_per_call[i]`` bytes each.

    Least squares on relative residuals (every round counts alike). When the payload term's
    coefficient comes out <= 0 (the bytes make no measurable difference, or one payload size
    only) it is dropped (``gb_per_s`` None) and the rest refitted; a negative intercept is
    refitted as 0.

    Raises:
        ValueError: fewer than 2 rows, lengths that differ, a time <= 0, fewer than 2 distinct
            call counts, or a per-call cost <= 0 (``name`` says which fit).
    """
    if not len(calls) == len(bytes_per_call) == len(times_s):
        raise ValueError(f"{name}: {len(calls)} calls, {len(bytes_per_call)} sizes, {len(times_s)} times; allowed: equal")
    _check_rows(name, times_s, 2)
    if len(set(calls)) < 2:
        raise ValueError(f"{name}: need at least 2 distinct call counts to fit a fixed and a per-call cost")
    ones, c = [1.0] * len(calls), [float(v) for v in calls]
    cb = [ci * b for ci, b in zip(c, bytes_per_call)]
    times = list(times_s)
    use_bytes = len(set(bytes_per_call)) > 1
    fixed, per_call, per_byte = 0.0, 0.0, 0.0
    for with_fixed in (True, False):
        cols = ([ones] if with_fixed else []) + [c] + ([cb] if use_bytes else [])
        coef = _relative_lstsq(cols, times)
        fixed = coef.pop(0) if with_fixed else 0.0
        per_call = coef.pop(0)
        per_byte = coef.pop(0) if use_bytes else 0.0
        if use_bytes and per_byte <= 0:  # no measurable payload term: fit without it
            use_bytes = False
            cols = ([ones] if with_fixed else []) + [c]
            coef = _relative_lstsq(cols, times)
            fixed = coef.pop(0) if with_fixed else 0.0
            per_call, per_byte = coef.pop(0), 0.0
        if fixed >= 0:
            break
    if per_call <= 0:
        raise ValueError(f"{name}: the time does not grow with the calls (per call {per_call:.3g} s); the "
                         f"measurements are noise")
    fitted = [fixed + ci * per_call + cbi * per_byte for ci, cbi in zip(c, cb)]
    return RoundFit(fixed_s=fixed, per_call_s=per_call, gb_per_s=1 / per_byte / 1e9 if per_byte > 0 else None,
                    residuals=[(f - t) / t for f, t in zip(fitted, times)])


class CpuFit(BaseModel):
    """``cpu = units x unit_s[direction] + C x (per_call_s[direction] + bytes_per_call / (gb_per_s x 1e9))``
    per round of ``C`` calls, for one side (server: ``units`` = the batches of the round, one per
    expert it reaches; client: ``units`` = 1 round), and its relative residuals."""

    model_config = ConfigDict(extra="forbid")

    forward_unit_s: float
    backward_unit_s: float
    forward_per_call_s: float
    backward_per_call_s: float
    gb_per_s: float | None
    residuals: list[float]


def fit_cpu(directions: Sequence[str], calls: Sequence[float], bytes_per_call: Sequence[float],
            cpu_s: Sequence[float], units: Sequence[float] | None = None) -> CpuFit:
    """Fit ``cpu = units x unit_s[d] + C x (per_call_s[d] + bytes_per_call / (gb_per_s x 1e9))`` to the
    CPU seconds one side spent per round of ``calls[i]`` calls of direction ``d = directions[i]``
    (``"forward"``/``"backward"``): a cost per unit (``units[i]``, default 1 per round; for a
    server the batches of the round, one per expert it reaches: hivemind's task pools, Runtime and
    the wake-ups of its processes) and one per call.

    Non-negative least squares (``scipy.optimize.nnls``) on relative residuals, each row divided
    by its measured CPU seconds, so that every configuration counts alike however many calls and
    bytes it moves (the figures are the scheduler's nanosecond counters, :func:`_tree_cpu_s`;
    rows with no CPU measured are left out).

    Raises:
        ValueError: lengths that differ, an unknown direction, no row with CPU > 0, or no per-call
            cost in either direction (the CPU does not grow with the calls).
    """
    import numpy as np
    from scipy.optimize import nnls

    units = [1.0] * len(calls) if units is None else list(units)
    if not len(directions) == len(calls) == len(bytes_per_call) == len(cpu_s) == len(units) or not calls:
        raise ValueError("cpu fit: need equally many directions, calls, sizes, units and CPU figures, at least one")
    bad = sorted(set(directions) - {"forward", "backward"})
    if bad:
        raise ValueError(f"cpu fit: direction(s) {bad}; allowed: forward, backward")
    rows = [(d, c, b, u, t) for d, c, b, u, t in zip(directions, calls, bytes_per_call, units, cpu_s) if t > 0]
    if not rows:
        raise ValueError("cpu fit: no round with CPU seconds > 0")
    a = np.array([[u * (d == "forward"), u * (d == "backward"), c * (d == "forward"), c * (d == "backward"), c * b]
                  for d, c, b, u, _ in rows], dtype=float)
    measured = np.array([t for *_, t in rows], dtype=float)
    coef, _ = nnls(a / measured[:, None], np.ones_like(measured))
    if coef[2] <= 0 and coef[3] <= 0:
        raise ValueError("cpu fit: the CPU seconds do not grow with the calls; the measurements are noise")
    fitted = a @ coef
    return CpuFit(forward_unit_s=float(coef[0]), backward_unit_s=float(coef[1]), forward_per_call_s=float(coef[2]),
                  backward_per_call_s=float(coef[3]), gb_per_s=1 / coef[4] / 1e9 if coef[4] > 0 else None,
                  residuals=[float((f - m) / m) for f, m in zip(fitted, measured)])


def _sig(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else (float(f"{value:.{digits - 1}e}") if value else 0.0)


def fit_dmoe(beam: list[dict[str, Any]], rounds: list[dict[str, Any]],
             shared: dict[str, Any] | None = None) -> tuple[DMoEFit, dict[str, list[float]]]:
    """Reduce the client's measurements (:data:`DMoECalibration.beam`, ``.rounds``, ``.shared``)
    to a :class:`~ddlscope.modeling.cluster.DMoEFit` (see the module docstring).

    Each configuration's repeats become their 20 %-trimmed mean, its CPU seconds too
    (:func:`fit_cpu`); ``colocated_cpu_ratio`` is ``shared["ratio"]`` (1 without shared rounds).

    Returns:
        the fit (4 significant digits) and the residuals ``{"beam": [...], "forward": [...],
        "backward": [...]}`` per configuration.

    Raises:
        ValueError: a fit that cannot be made (:func:`fit_beam_search`, :func:`fit_rounds`), or a
            direction without rounds.
    """
    b_fixed, b_lookup, b_res = fit_beam_search([r["batch"] for r in beam], [r["dims"] for r in beam],
                                               [trimmed_mean(r["times_s"], TRIM) for r in beam])
    fits: dict[str, RoundFit] = {}
    for direction in ("forward", "backward"):
        mine = [r for r in rounds if r["direction"] == direction]
        if not mine:
            raise ValueError(f"no {direction} rounds were measured")
        fits[direction] = fit_rounds([r["calls"] for r in mine], [r["bytes_per_call"] for r in mine],
                                     [trimmed_mean(r["times_s"], TRIM) for r in mine], direction)
    f, b = fits["forward"], fits["backward"]
    cpu = {side: fit_cpu([r["direction"] for r in rounds], [r["calls"] for r in rounds],
                         [r["bytes_per_call"] for r in rounds],
                         [trimmed_mean(r[f"{side}_cpu_s"], TRIM) for r in rounds],
                         [r.get("experts", ROUND_EXPERTS) if side == "server" else 1 for r in rounds])
           for side in ("server", "client")}
    hidden = sorted({r["hidden"] for r in rounds})
    fit = DMoEFit(
        beam_search_fixed_s=_sig(b_fixed), beam_search_lookup_s=_sig(b_lookup),
        forward_fixed_s=_sig(f.fixed_s), forward_per_call_s=_sig(f.per_call_s), forward_gb_per_s=_sig(f.gb_per_s),
        backward_fixed_s=_sig(b.fixed_s), backward_per_call_s=_sig(b.per_call_s), backward_gb_per_s=_sig(b.gb_per_s),
        **{f"{side}_{d}_{what}": _sig(getattr(cpu[side], f"{d}_{part}"))
           for side in ("server", "client") for d in ("forward", "backward")
           for what, part in ((f"{'batch' if side == 'server' else 'round'}_cpu_s", "unit_s"),
                              ("cpu_s", "per_call_s"))},
        server_cpu_gb_per_s=_sig(cpu["server"].gb_per_s), client_cpu_gb_per_s=_sig(cpu["client"].gb_per_s),
        max_abs_residual=_sig(max(abs(x) for x in f.residuals + b.residuals)),
        colocated_cpu_ratio=_sig(shared["ratio"]) if shared else 1.0,
        reference=(f"hivemind Server, 1 core, 1 connection handler, loopback; {ROUND_EXPERTS} experts y = w x per "
                   f"payload of {'/'.join(str(4 * h) for h in hidden)} B per sample; rounds of batch "
                   f"{'/'.join(map(str, sorted({r['batch'] for r in rounds})))} x k_best "
                   f"{'/'.join(map(str, sorted({r['k'] for r in rounds})))}; beam search over {BEAM_SIDE}-wide grids of "
                   f"{'/'.join(map(str, sorted({r['dims'] for r in beam})))} dimensions"
                   + (f"; shared: a second client on the server's core, {shared['rounds']} rounds of "
                      f"{shared['batch']} x k_best {shared['k']} each at once" if shared else "")))
    return fit, {"beam": b_res, "forward": f.residuals, "backward": b.residuals}


# ------------------------------------------------------------------------------------ children
def _write_json(path: str, data: Any) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def _child_setup(core: int, parent_pid: int) -> threading.Event:
    """Die with the parent, pin to ``core`` with one thread; SIGTERM/SIGINT (also sent when the
    parent dies) end this child and every process hivemind forked for it at once."""
    from ddlscope.launch.processes import die_with_parent, end_children

    die_with_parent(signal.SIGTERM)
    if os.getppid() != parent_pid:  # the parent died before PR_SET_PDEATHSIG took effect
        os._exit(1)
    os.sched_setaffinity(0, [core])
    import torch

    torch.set_num_threads(1)
    stop = threading.Event()

    def die(*_) -> None:  # the parent stops us (or died): no measurement is left to save
        stop.set()
        end_children()
        os._exit(143)

    signal.signal(signal.SIGTERM, die)
    signal.signal(signal.SIGINT, die)
    return stop


def _scale_expert():
    """The reference expert: ``y = w x`` with one scalar parameter ``w`` (compute next to nothing)."""
    import torch
    from torch import nn

    class ScaleExpert(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(()))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.w

    return ScaleExpert()


def beam_uids(dims: int, side: int = BEAM_SIDE) -> list[str]:
    """Every id of the ``side``-wide beam-search grid of ``dims`` dimensions (prefix ``beam<dims>.``)."""
    uids = [f"beam{dims}"]
    for _ in range(dims):
        uids = [f"{u}.{i}" for u in uids for i in range(side)]
    return uids


def _serve(folder: str, core: int, parent_pid: int) -> int:
    """The server child: hivemind ``Server`` with the reference experts; writes ``server.json``, runs until stopped."""
    stop = _child_setup(core, parent_pid)
    import hivemind
    import torch
    from hivemind.moe.server import ModuleBackend, Server, declare_experts
    from hivemind.utils import get_dht_time
    from hivemind.utils.tensor_descr import BatchTensorDescriptor

    from ddlscope.launch.network import p2p_options

    dht = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True, **p2p_options())
    backends = {}
    for hidden in PAYLOAD_HIDDEN:
        for i in range(ROUND_EXPERTS):
            expert = _scale_expert()
            uid = f"rpc{hidden}.{i}"
            backends[uid] = ModuleBackend(name=uid, module=expert, args_schema=(BatchTensorDescriptor(hidden),),
                                          optimizer=torch.optim.SGD(expert.parameters(), lr=1e-6), max_batch_size=4096)
    Server(dht, backends, num_connection_handlers=1, update_period=UPDATE_PERIOD_S, expiration=2 * UPDATE_PERIOD_S,
           start=True)
    declare_experts(dht, [u for d in BEAM_DIMS for u in beam_uids(d)], expiration_time=get_dht_time() + 2 * UPDATE_PERIOD_S)
    _write_json(os.path.join(folder, "server.json"), {"pid": os.getpid(),
                                                       "maddrs": [str(a) for a in dht.get_visible_maddrs()]})
    while not stop.wait(0.2):
        if os.getppid() != parent_pid:
            break
    return 0


def _task_cpu_s(pid: int) -> float | None:
    """CPU seconds every live thread of process ``pid`` has run, from the scheduler's nanosecond
    counters (``/proc/<pid>/task/<tid>/schedstat``, first field); None where they cannot be read."""
    total, read = 0, False
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
            read = True
        except (OSError, ValueError, IndexError):
            continue
    return total / 1e9 if read else None


def _tree_cpu_s(proc) -> float:
    """CPU seconds of a psutil process and all its live descendants (their DHT, task pools,
    connection handlers and ``p2pd``), each from the scheduler's nanosecond counters
    (:func:`_task_cpu_s`), else from ``cpu_times`` (user + system, in clock ticks of 10 ms)."""
    import psutil

    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        ns = _task_cpu_s(p.pid)
        if ns is not None:
            total += ns
            continue
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            continue
    return total


def _round_call(hidden: int, batch: int, k: int, dht):
    """A function running one forward and one backward round of ``batch`` samples of width
    ``hidden`` x ``k_best`` calls to the reference experts (what a trainer's mixture layer sends),
    returning ``(forward s, backward s, cpu marks)``; and the calls per round and the experts
    they reach (the server's batches per round)."""
    import hivemind
    import torch
    from hivemind.moe.client.expert import DUMMY
    from hivemind.moe.client.moe import _RemoteCallMany

    moe = hivemind.moe.RemoteMixtureOfExperts(in_features=hidden, grid_size=(ROUND_EXPERTS,), dht=dht,
                                              uid_prefix=f"rpc{hidden}.", k_best=k)
    x = torch.randn(batch, hidden, requires_grad=True)
    with torch.no_grad():
        scores = [s.numpy() for s in moe.proj(x).split_with_sizes(moe.beam_search.grid_size, dim=-1)]
    experts = moe.beam_search.batch_find_best_experts(scores, k)
    calls = sum(len(row) for row in experts)
    if calls != batch * k:
        raise RuntimeError(f"beam search found {calls} experts for {batch} samples x k_best {k}")
    reached = len({e.uid for row in experts for e in row})
    info = moe.info

    def one(mark: Callable[[], Any] = lambda: None) -> tuple[float, float, list[Any]]:
        x.grad = None
        marks = [mark()]
        t0 = time.perf_counter()
        mask, *outputs = _RemoteCallMany.apply(DUMMY, experts, 1, 1, CALL_TIMEOUT_S, CALL_TIMEOUT_S, CALL_TIMEOUT_S,
                                               False, False, info, x)
        t1 = time.perf_counter()
        marks.append(mark())
        loss = outputs[0].sum()
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        marks.append(mark())
        answered = int(mask.sum())
        if answered != calls or x.grad is None:
            raise RuntimeError(f"a forward round of {calls} calls got {answered} answers (payload "
                               f"{4 * hidden} B, batch {batch}, k_best {k})")
        return t1 - t0, t3 - t2, marks

    return one, calls, reached


def _wait_file(path: str, parent_pid: int) -> None:
    """Wait for ``path`` while the parent lives (the parent's watchdog stops a calibration that stalls)."""
    while not os.path.exists(path):
        if os.getppid() != parent_pid:
            raise RuntimeError(f"gave up waiting for {os.path.basename(path)}: the calibration's parent is gone")
        time.sleep(0.005)


def _client(folder: str, core: int, parent_pid: int) -> int:
    """The client child: times beam searches and rounds against the server, then (when the
    second client runs) the shared rounds; writes ``result.json``."""
    _child_setup(core, parent_pid)
    started = time.monotonic()
    import hivemind
    import numpy as np
    import psutil
    import torch
    from hivemind.moe.client.beam_search import MoEBeamSearcher

    from ddlscope.launch.network import p2p_options

    with open(os.path.join(folder, "server.json")) as f:
        server = json.load(f)
    progress = open(os.path.join(folder, "progress.log"), "a", buffering=1)
    me, server_proc = psutil.Process(), psutil.Process(server["pid"])
    dht = hivemind.DHT(initial_peers=server["maddrs"], client_mode=True, start=True, **p2p_options())
    second = None
    if os.path.exists(os.path.join(folder, "second.expected")):  # let the second client join before timing
        _wait_file(os.path.join(folder, "second.json"), parent_pid)
        with open(os.path.join(folder, "second.json")) as f:
            second = psutil.Process(json.load(f)["pid"])
    startup_s = time.monotonic() - started
    rng = np.random.default_rng(0)
    torch.manual_seed(0)

    beam = []
    for dims in BEAM_DIMS:
        searcher = MoEBeamSearcher(dht, f"beam{dims}.", [BEAM_SIDE] * dims)
        for batch in BEAM_BATCHES:
            for k in BEAM_K:
                times = []
                for rep in range(BEAM_REPEATS + 1):
                    scores = [rng.standard_normal((batch, BEAM_SIDE)).astype(np.float32) for _ in range(dims)]
                    t0 = time.perf_counter()
                    found = searcher.batch_find_best_experts(scores, k)
                    elapsed = time.perf_counter() - t0
                    if any(len(row) != k for row in found):
                        raise RuntimeError(f"beam search over grid {[BEAM_SIDE] * dims} found "
                                           f"{sorted({len(r) for r in found})} experts per sample, not {k}")
                    if rep:
                        times.append(elapsed)
                beam.append({"dims": dims, "batch": batch, "k": k, "times_s": times})
        progress.write(f"dmoe: beam search over {dims}-dimensional grids timed\n")

    def cpu_marks() -> tuple[float, float]:
        return _tree_cpu_s(server_proc), _tree_cpu_s(me)

    rounds = []
    for hidden in PAYLOAD_HIDDEN:
        for batch in ROUND_BATCHES:
            for k in ROUND_K:
                one, calls, reached = _round_call(hidden, batch, k, dht)
                rows = {d: {"direction": d, "hidden": hidden, "batch": batch, "k": k, "calls": calls,
                            "experts": reached,
                            "bytes_per_call": (2 if d == "forward" else 3) * 4 * hidden, "times_s": [],
                            "server_cpu_s": [], "client_cpu_s": [], "answered": []}
                        for d in ("forward", "backward")}
                for rep in range(REPEATS + 1):
                    fwd_s, bwd_s, (c0, c1, c2) = one(cpu_marks)
                    if rep:
                        for d, t, a, b in (("forward", fwd_s, c0, c1), ("backward", bwd_s, c1, c2)):
                            rows[d]["times_s"].append(t)
                            rows[d]["server_cpu_s"].append(b[0] - a[0])
                            rows[d]["client_cpu_s"].append(b[1] - a[1])
                            rows[d]["answered"].append(calls)
                rounds += rows.values()
        progress.write(f"dmoe: forward and backward rounds of {4 * hidden}-byte samples timed\n")

    shared = None
    if second is not None:
        shared = _shared_rounds(folder, parent_pid, dht, server_proc, me, second)
        progress.write(f"dmoe: {SHARED_ROUNDS} rounds alone, then with a second client on the server's core: "
                       f"CPU per call x{shared['ratio']:.2f}\n")
    _write_json(os.path.join(folder, "result.json"), {"beam": beam, "rounds": rounds, "startup_s": startup_s,
                                                       "shared": shared})
    return 0


def _shared_rounds(folder: str, parent_pid: int, dht, server_proc, me, second) -> dict[str, Any]:
    """:data:`SHARED_ROUNDS` rounds (forward and backward) alone, then as many while the second
    client, on the server's core, runs as many at once; the CPU seconds per call of all the
    processes (server, this client, the second client) in each block, and their ratio."""
    one, calls, _ = _round_call(SHARED_HIDDEN, SHARED_BATCH, SHARED_K, dht)
    one()  # warm-up
    procs = [server_proc, me, second]

    def cpu() -> list[float]:
        return [_tree_cpu_s(p) for p in procs]

    c0, t0 = cpu(), time.perf_counter()
    for _ in range(SHARED_ROUNDS):
        one()
    c1, t1 = cpu(), time.perf_counter()
    _write_json(os.path.join(folder, "go.json"), {})
    for _ in range(SHARED_ROUNDS):
        one()
    _wait_file(os.path.join(folder, "second_done.json"), parent_pid)
    c2, t2 = cpu(), time.perf_counter()
    alone = [b - a for a, b in zip(c0, c1)]
    together = [b - a for a, b in zip(c1, c2)]
    alone_per_call = sum(alone) / (2 * calls * SHARED_ROUNDS)
    together_per_call = sum(together) / (4 * calls * SHARED_ROUNDS)
    return {"hidden": SHARED_HIDDEN, "batch": SHARED_BATCH, "k": SHARED_K, "rounds": SHARED_ROUNDS,
            "calls_per_round": calls, "alone_cpu_s": dict(zip(("server", "client", "second"), alone)),
            "together_cpu_s": dict(zip(("server", "client", "second"), together)),
            "alone_s": t1 - t0, "together_s": t2 - t1, "alone_cpu_per_call_s": alone_per_call,
            "together_cpu_per_call_s": together_per_call, "ratio": together_per_call / alone_per_call}


def _second_client(folder: str, core: int, parent_pid: int) -> int:
    """The second client child, on the server's core: joins, waits idle for ``go.json``, runs
    :data:`SHARED_ROUNDS` rounds at once with the first client, writes ``second_done.json``."""
    _child_setup(core, parent_pid)
    import hivemind
    import torch

    from ddlscope.launch.network import p2p_options

    with open(os.path.join(folder, "server.json")) as f:
        server = json.load(f)
    dht = hivemind.DHT(initial_peers=server["maddrs"], client_mode=True, start=True, **p2p_options())
    torch.manual_seed(1)
    one, _, _ = _round_call(SHARED_HIDDEN, SHARED_BATCH, SHARED_K, dht)
    one()  # warm-up, before the first client times anything
    _write_json(os.path.join(folder, "second.json"), {"pid": os.getpid()})
    _wait_file(os.path.join(folder, "go.json"), parent_pid)
    for _ in range(SHARED_ROUNDS):
        one()
    _write_json(os.path.join(folder, "second_done.json"), {})
    while os.getppid() == parent_pid and not os.path.exists(os.path.join(folder, "result.json")):
        time.sleep(0.1)  # stay up (an idle DHT peer) until the first client is done
    return 0


# ------------------------------------------------------------------------------------ parent
def _children_cores() -> tuple[int, int]:
    from ddlscope.config import available_cores

    cores = available_cores()
    return cores[0], cores[1 % len(cores)]


def measure(progress: Callable[[str], None] | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
    """Start the server, the client and (when the two may use different cores) the second
    client on the server's core; relay the client's progress, return its raw measurements
    (``beam``, ``rounds``, ``startup_s``, ``shared``: None without a second client) plus
    ``server_core`` and ``client_core``.

    Raises:
        ddlscope.profiling.calibrate.CalibrationError: a child failed or died, or no progress
            came for ``timeout_s`` seconds (a progress line of the client, or the server ready).
            Every child (its whole process group) is stopped before this returns or raises.
    """
    from ddlscope.launch.processes import log_tail, signal_group, start_process, stop_processes
    from ddlscope.launch.processes import sigterm_as_interrupt, stop_signals_held
    from ddlscope.profiling.calibrate import CalibrationError, ProgressWatchdog

    say = progress or (lambda msg: None)
    server_core, client_core = _children_cores()
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {"PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH", "")) if p)}
    watchdog = ProgressWatchdog(timeout_s)
    procs, roles = [], []
    with tempfile.TemporaryDirectory(prefix="ddlscope-dmoe-rpc-") as tmp:
        def start(role: str, core: int):
            cmd = [sys.executable, "-m", "ddlscope.profiling.dmoe_rpc", f"--{role}", "--dir", tmp, "--core", str(core),
                   "--parent-pid", str(os.getpid())]
            # TMPDIR: hivemind's multiprocessing folders (pymp-*) go with this one, also from a killed child
            with stop_signals_held():
                procs.append(start_process(cmd, os.path.join(tmp, f"{role}.log"), 1, env_extra={**env, "TMPDIR": tmp}))
                roles.append(role)
            return procs[-1]

        seen = [0]

        def relay() -> None:  # the client's progress lines not yet passed on
            progress_path = os.path.join(tmp, "progress.log")
            if os.path.exists(progress_path):
                with open(progress_path) as f:
                    lines = f.read().splitlines()
                for line in lines[seen[0]:]:
                    say(line)
                    watchdog.progress()
                seen[0] = len(lines)

        def wait_for(path: str, what: str, limit_s: float | None = None) -> bool:
            """True once ``path`` exists (progress); False when ``limit_s`` passed first (None: until the watchdog)."""
            until = time.monotonic() + limit_s if limit_s is not None else float("inf")
            while not os.path.exists(path):
                if time.monotonic() > until:
                    return False
                relay()
                for role, p in zip(roles, procs):
                    if p.poll() is not None and not os.path.exists(path):
                        tail = log_tail(os.path.join(tmp, f"{role}.log"))
                        who = {"serve": "server", "client": "client", "second": "second client"}[role]
                        raise CalibrationError(f"dmoe calibration: the {who} "
                                               f"exited with code {p.returncode} before {what}"
                                               + (f": {tail}" if tail else ""))
                if watchdog.expired():
                    logs = "; ".join(f"{r}: {log_tail(os.path.join(tmp, f'{r}.log')) or '(empty log)'}" for r in roles)
                    raise CalibrationError(f"dmoe calibration made no progress for {timeout_s:g} s (waiting for "
                                           f"{what}; {logs})")
                time.sleep(0.1)
            watchdog.progress()
            return True

        with sigterm_as_interrupt():  # a SIGTERM stops the roles and removes the folder, as Ctrl-C does
            try:
                say(f"dmoe: expert server on core {server_core}, client on core {client_core} (hivemind over loopback)")
                server = start("serve", server_core)
                if not wait_for(os.path.join(tmp, "server.json"), "it served its experts", SERVER_SILENT_S):
                    # hivemind's Server start now and then never gets ready (docs/validation.md): once more
                    say(f"dmoe: the expert server did not start within {SERVER_SILENT_S:g} s; starting it once more")
                    signal_group(server.pid, signal.SIGKILL)
                    server.wait()
                    del roles[procs.index(server)], procs[procs.index(server)]  # its -9 is ours, not a failure
                    start("serve", server_core)
                    wait_for(os.path.join(tmp, "server.json"), "it served its experts")
                if server_core != client_core:  # the shared rounds need the server's core to differ from the client's
                    _write_json(os.path.join(tmp, "second.expected"), {})
                    start("second", server_core)
                start("client", client_core)
                wait_for(os.path.join(tmp, "result.json"), "its measurements were written")
                relay()
                with open(os.path.join(tmp, "result.json")) as f:
                    raw = json.load(f)
                return {**raw, "server_core": server_core, "client_core": client_core}
            finally:
                stop_processes(procs, STOP_GRACE_S)


def calibrate_dmoe(progress: Callable[[str], None] | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> DMoECalibration:
    """Measure beam searches and remote expert calls here and fit them (see the module docstring).

    Raises:
        ddlscope.profiling.calibrate.CalibrationError: a child failed or timed out, or the
            measurements cannot be fitted.
    """
    from ddlscope.profiling.calibrate import CalibrationError

    started = time.monotonic()
    raw = measure(progress, timeout_s)
    try:
        fit, residuals = fit_dmoe(raw["beam"], raw["rounds"], raw.get("shared"))
    except ValueError as e:
        raise CalibrationError(f"dmoe calibration: cannot fit the measurements: {e}") from None
    notes = []
    if raw["server_core"] == raw["client_core"]:
        notes.append(f"dmoe: the server and the client shared core {raw['server_core']} (this process may use one "
                     f"core): the per-call figures include their competition for it")
    return DMoECalibration(fit=fit, beam=raw["beam"], rounds=raw["rounds"], beam_residuals=residuals["beam"],
                           forward_residuals=residuals["forward"], backward_residuals=residuals["backward"],
                           shared=raw.get("shared"), server_core=raw["server_core"], client_core=raw["client_core"],
                           startup_s=raw["startup_s"],
                           elapsed_s=time.monotonic() - started, notes=notes)


def describe(fit: DMoEFit) -> str:
    """One line for people: the fitted figures in milliseconds."""
    def rate(v: float | None) -> str:
        return "" if v is None else f" + bytes at {v:.3g} GB/s"

    return (f"beam search {fit.beam_search_fixed_s * 1e3:.2f} ms + {fit.beam_search_lookup_s * 1e3:.3f} ms per sample "
            f"per look-up round; forward {fit.forward_fixed_s * 1e3:.2f} ms + {fit.forward_per_call_s * 1e3:.3f} ms per "
            f"call{rate(fit.forward_gb_per_s)}; backward {fit.backward_fixed_s * 1e3:.2f} ms + "
            f"{fit.backward_per_call_s * 1e3:.3f} ms per call{rate(fit.backward_gb_per_s)}; server CPU "
            f"{fit.server_forward_batch_cpu_s * 1e3:.2f} / {fit.server_backward_batch_cpu_s * 1e3:.2f} ms per "
            f"forward / "
            f"backward batch + {fit.server_forward_cpu_s * 1e3:.3f} / {fit.server_backward_cpu_s * 1e3:.3f} ms per call"
            f"{rate(fit.server_cpu_gb_per_s)}, client CPU {fit.client_forward_round_cpu_s * 1e3:.2f} / "
            f"{fit.client_backward_round_cpu_s * 1e3:.2f} ms per round + {fit.client_forward_cpu_s * 1e3:.3f} / "
            f"{fit.client_backward_cpu_s * 1e3:.3f} ms{rate(fit.client_cpu_gb_per_s)}; with a client on the "
            f"server's core x{fit.colocated_cpu_ratio:.2f} CPU per call; max |residual| {fit.max_abs_residual:.0%}")


def _main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m ddlscope.profiling.dmoe_rpc")
    role = p.add_mutually_exclusive_group(required=True)
    role.add_argument("--serve", action="store_true")
    role.add_argument("--client", action="store_true")
    role.add_argument("--second", action="store_true")
    p.add_argument("--dir", required=True)
    p.add_argument("--core", type=int, required=True)
    p.add_argument("--parent-pid", type=int, required=True)
    args = p.parse_args(argv)
    from ddlscope.launch.processes import route_hivemind_sockets

    route_hivemind_sockets(args.dir)  # hivemind's socket files go with the calibration's folder
    try:
        role = _serve if args.serve else _client if args.client else _second_client
        return role(args.dir, args.core, args.parent_pid)
    except Exception as e:  # the parent reads the log's last lines
        import traceback

        traceback.print_exc()
        who = "server" if args.serve else "client" if args.client else "second client"
        print(f"dmoe calibration {who} failed: {type(e).__name__}: {e}",
              file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    code = _main()
    sys.stdout.flush()
    sys.stderr.flush()
    from ddlscope.launch.processes import end_children

    end_children()
    os._exit(code)  # no interpreter teardown: hivemind's background threads and processes can hang it
