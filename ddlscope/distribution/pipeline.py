"""``gpipe`` and ``1f1b``: pipeline parallelism, one stage per worker (``torch.distributed.pipelining``).

Every stage sees the same batch, split into micro-batches: the workers are not data parallel, so
the global batch is the batch size. GPipe runs every micro-batch's forward before any backward
(Huang et al. 2019); 1F1B interleaves them and holds at most ``stages - s`` micro-batches on stage
``s`` (Narayanan et al. 2021, PipeDream-flush).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ddlscope.distribution import DistributionModel, register
from ddlscope.errors import UserError
from ddlscope.modeling.cluster import ClusterSpec, LinkSpec
from ddlscope.modeling.collectives import busy_per_node, contention, exposed_loading_s
from ddlscope.modeling.memory import MemoryEstimate, activation_bytes
from ddlscope.modeling.prediction import Prediction, Setting, make_prediction
from ddlscope.modeling.profile import WorkloadProfile

if TYPE_CHECKING:
    from ddlscope.config import RunConfig


def check_microbatches(cfg: "RunConfig") -> None:
    """The batch splits into ``distributed.microbatches`` micro-batches, and 1F1B has one per stage.

    Raises:
        ValueError: micro-batches that do not divide the batch, or (1f1b) fewer than the stages.
    """
    mb = cfg.distributed.microbatches
    if cfg.batch_size % mb:
        divisors = [d for d in range(1, cfg.batch_size + 1) if cfg.batch_size % d == 0]
        raise ValueError(f"distributed.microbatches = {mb} does not divide batch_size = {cfg.batch_size}; "
                         f"allowed: a divisor of the batch size ({', '.join(map(str, divisors[:12]))}"
                         f"{', ...' if len(divisors) > 12 else ''})")
    if cfg.strategy == "1f1b" and mb < cfg.peers:
        raise ValueError(f"distributed.microbatches = {mb} is fewer than the {cfg.peers} stages; 1f1b keeps "
                         f"every stage busy only with at least one micro-batch per stage; allowed: microbatches >= peers")


DEFAULT_MICROBATCHES = 4
"""Micro-batches of a pipeline when none are given (``DistributedConfig.microbatches``' default)."""


def microbatches_of(s: Setting) -> int:
    """The setting's micro-batches, or :data:`DEFAULT_MICROBATCHES` when it gives none."""
    return s.microbatches or DEFAULT_MICROBATCHES


def balanced_partition(costs: list[float], stages: int) -> list[int]:
    """Contiguous split of layers into ``stages`` non-empty stages minimising the largest stage cost.

    A pipeline runs as fast as its slowest stage; this is the classic linear-partition problem,
    solved exactly by dynamic programming in O(S x L^2). GPipe's own partitioner balanced by
    profiled layer times too (thesis 002 ch. 3.4.2). The strategy cuts its stages with it, and
    the cost and memory models predict the same cut.

    Args:
        costs: cost of each layer, in order (seconds, or any non-negative unit), length L.
        stages: number of stages S, 1 <= S <= L.

    Returns:
        boundaries ``[0, b1, ..., L]`` of length S + 1: stage s holds layers ``b[s]:b[s+1]``.

    Raises:
        UserError: more stages than layers (each stage needs at least one layer).
    """
    n = len(costs)
    if not 1 <= stages <= n:
        raise UserError(f"cannot split a network with {n} top-level layers into {stages} pipeline stages; "
                        f"allowed: 1 <= stages (workers) <= {n}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[s][i]: minimal largest-stage cost of splitting the first i layers into s stages
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for i in range(s, n - (stages - s) + 1):
            for j in range(s - 1, i):
                cand = max(best[s - 1][j], prefix[i] - prefix[j])
                if cand < best[s][i]:
                    best[s][i], cut[s][i] = cand, j
    bounds = [n]
    for s in range(stages, 0, -1):
        bounds.append(cut[s][bounds[-1]])
    return bounds[::-1]


def balanced_stage_bounds(profile: WorkloadProfile, stages: int, microbatch: float) -> list[int]:
    """Stage boundaries as the pipeline strategies cut them: :func:`balanced_partition` of the
    per-layer forward + backward seconds at the micro-batch."""
    fwd, bwd = profile.layer_times_s(microbatch)
    return balanced_partition([f + b for f, b in zip(fwd, bwd)], stages)


def stage_bounds_of(profile: WorkloadProfile, s: Setting) -> list[int]:
    """The setting's stage cut: ``s.stage_bounds``, or :func:`balanced_stage_bounds` at its micro-batch."""
    if s.stage_bounds is not None:
        return list(s.stage_bounds)
    return balanced_stage_bounds(profile, s.workers, math.ceil(s.batch_size / microbatches_of(s)))


def check_pipeline_setting(profile: WorkloadProfile, s: Setting) -> None:
    """A pipeline setting's own checks: micro-batches that divide the batch, at most one stage per
    layer, and a valid ``stage_bounds`` when one is given.

    Raises:
        UserError: the first problem, naming the field and what is allowed.
    """
    mb, b, layers = microbatches_of(s), s.batch_size, len(profile.layers)
    if isinstance(mb, bool) or not isinstance(mb, int) or not 1 <= mb <= b or b % mb:
        raise UserError(f"{s.strategy}: microbatches = {mb!r} does not divide batch_size = {b}; allowed: an integer "
                        f"in 1..batch_size ({b}) that divides it")
    if s.workers > layers:
        raise UserError(f"{s.strategy}: {s.workers} stages but the network has {layers} layers ({profile.network}: "
                        f"{layers} top-level layers, at least one per stage); allowed: workers <= {layers}")
    bounds = s.stage_bounds
    if bounds is not None and (len(bounds) != s.workers + 1 or bounds[0] != 0 or bounds[-1] != layers
                               or any(b1 <= b0 for b0, b1 in zip(bounds, bounds[1:]))):
        raise UserError(f"stage_bounds {list(bounds)}: allowed: {s.workers + 1} strictly increasing layer indices "
                        f"from 0 to {layers} (one stage per worker)")


def pipeline_candidate(s: Setting, global_batch_size: int, options: dict[str, Any]) -> Setting:
    """A pipeline's candidate for a job: the global batch split into ``options["microbatches"]``
    micro-batches (default ``2 x workers``), reduced until it divides the batch."""
    m = options.get("microbatches") or 2 * s.workers
    while global_batch_size % m:
        m -= 1
    return replace(s, microbatches=m)


def boundary_link(cluster: ClusterSpec, boundary: int) -> LinkSpec:
    """The link between pipeline stage ``boundary`` and the next (stages placed node-major): the
    inter-node link where the boundary crosses nodes, else the point-to-point link of a node."""
    if (boundary + 1) % cluster.devices_per_node == 0 and cluster.inter_node is not None:
        return cluster.inter_node
    return cluster.p2p_link or cluster.intra_node


def pipeline_ops(schedule: str, stage: int, stages: int, microbatches: int) -> list[tuple[str, int]]:
    """The order in which one stage runs its forward (``"F"``) and backward (``"B"``) passes.

    gpipe: every forward, then every backward (Huang et al. 2019). 1f1b: ``min(M, S - s - 1)``
    warm-up forwards, then one forward and one backward alternately, then the remaining
    backwards (Narayanan et al. 2019, PipeDream-Flush), as torch's ``Schedule1F1B`` runs them: the
    compute of :func:`stage_program`.

    Returns:
        ``[(kind, microbatch), ...]`` of length ``2 * microbatches``.
    """
    return [(op, m) for op, m in stage_program(schedule, stage, stages, microbatches) if op in ("F", "B")]


def stage_program(schedule: str, stage: int, stages: int, microbatches: int) -> list[tuple[str, Any]]:
    """What one stage does in one step under torch's ``ScheduleGPipe`` / ``Schedule1F1B``, in order:
    its :func:`pipeline_ops` with the point-to-point operations torch posts and waits for around them.

    Instructions: ``("F", m)`` / ``("B", m)`` compute; ``("send", t)`` / ``("recv", t)`` post a
    transfer without waiting; ``("wait", [t, ...])`` wait until those transfers have arrived. A
    transfer ``t`` is ``(kind, boundary, m)``: ``("F", b, m)`` moves micro-batch ``m``'s activation
    from stage ``b`` to ``b + 1``, ``("B", b, m)`` its gradient from ``b + 1`` to ``b``.

    gpipe: each receive is posted and waited for just before the op that needs it; sends are waited
    for only at the end of the forward phase and of the step. 1f1b (torch's ``Schedule1F1B``, from
    its source): warm-up forwards each wait for the previous forward's send; in the steady phase
    a stage posts its forward's send together with the next backward's receive and waits for both,
    and its backward's send together with the next forward's receive, waiting for both; in the
    cool-down each backward waits for the previous backward's send. A send has arrived only once the
    receiver has posted its receive (gloo's send/recv is a rendezvous), so under 1F1B a stage cannot
    run ahead of its neighbour.
    """
    first, last = stage == 0, stage == stages - 1

    def fwd_send(m: int) -> list[tuple[str, int, int]]:
        return [] if last else [("F", stage, m)]

    def fwd_recv(m: int) -> list[tuple[str, int, int]]:
        return [] if first else [("F", stage - 1, m)]

    def bwd_send(m: int) -> list[tuple[str, int, int]]:
        return [] if first else [("B", stage - 1, m)]

    def bwd_recv(m: int) -> list[tuple[str, int, int]]:
        return [] if last else [("B", stage, m)]

    prog: list[tuple[str, Any]] = []

    def exchange(sends: list[tuple[str, int, int]], recvs: list[tuple[str, int, int]], wait: bool = True) -> None:
        prog.extend([("send", t) for t in sends] + [("recv", t) for t in recvs])
        if wait and sends + recvs:
            prog.append(("wait", sends + recvs))

    if schedule == "gpipe":
        for kind, recv, send in (("F", fwd_recv, fwd_send), ("B", bwd_recv, bwd_send)):
            pending = []
            for m in range(microbatches):
                exchange([], recv(m))
                prog.append((kind, m))
                exchange(send(m), [], wait=False)
                pending += send(m)
            if pending:
                prog.append(("wait", pending))
        return prog
    warm = min(microbatches, stages - stage)
    in_flight: list[tuple[str, int, int]] = []
    deferred: list[tuple[str, int, int]] = []
    for m in range(warm):
        exchange([], fwd_recv(m))
        prog.append(("F", m))
        if in_flight:
            prog.append(("wait", in_flight))
            in_flight = []
        if m < warm - 1:
            exchange(fwd_send(m), [], wait=False)
            in_flight = fwd_send(m)
        else:
            deferred = fwd_send(m)  # posted with the first backward's receive
    f, b = warm, 0
    while True:
        exchange(deferred, bwd_recv(b))
        prog.append(("B", b))
        deferred, b = bwd_send(b), b + 1
        if f == microbatches:
            break
        exchange(deferred, fwd_recv(f))
        prog.append(("F", f))
        deferred, f = fwd_send(f), f + 1
    exchange(deferred, [], wait=False)
    in_flight = deferred
    while b < microbatches:
        exchange([], bwd_recv(b))
        prog.append(("B", b))
        if in_flight:
            prog.append(("wait", in_flight))
        exchange(bwd_send(b), [], wait=False)
        in_flight, b = bwd_send(b), b + 1
    if in_flight:
        prog.append(("wait", in_flight))
    return prog


def simulate_pipeline(schedule: str, fwd_s: list[float], bwd_s: list[float], transfer_s: list[float],
                      microbatches: int, send_block_s: list[float] | None = None,
                      bucket_s: list[float] | None = None, fixed_s: list[float] | None = None) -> tuple[float, list[float]]:
    """Event simulation of one pipeline step, with point-to-point transfers as gloo makes them.

    Args:
        fwd_s / bwd_s: forward / backward seconds of one micro-batch on each stage (length S).
        transfer_s: seconds to move one micro-batch's activation (forward) or its gradient
            (backward) across the boundary after stage s (length S - 1).
        send_block_s: seconds of the *sending* stage's own time per send (default 0), added to the
            op that produces it.
        bucket_s: the boundary's token bucket, in seconds of its wire time (default 0: none): a
            stream idle that long lets that much of a transfer through at once (tc ``tbf``'s burst
            on emulated links, :attr:`~ddlscope.modeling.cluster.LinkSpec.burst_s`).
        fixed_s: the part of each boundary's ``transfer_s`` that a bucket cannot shorten (latency and
            per-message costs; default 0).

    Returns:
        ``(step_s, busy_s per stage)``: the time the last stage finishes, and each stage's compute.

    Each stage runs its :func:`stage_program`. A boundary is two byte streams, one per direction
    (gloo's TCP connection between the two stages), each carrying what is written to it in order.
    gloo's send/recv is a rendezvous: posting a receive writes a ready-to-receive notice to the
    sender into the *reverse* stream, and a send's data is written once the sender has posted it and
    holds that notice. So the data starts at ``max(send posted, notice arrived)``, after the data
    already in its stream, and takes ``transfer_s``; the receiver's wait ends when it has arrived,
    the sender's when it was handed to the connection (its socket buffers hold it). A stream's bucket
    refills at one second of wire time per second while the stream is idle, up to ``bucket_s``, and
    a transfer uses what it holds (tbf; with a 10 ms bucket this took 14-18 % of the measured step
    off 1F1B's and GPipe's simulated steps at 200 Mbit/s and 8-10 % at 50 Mbit/s, at the runs' own
    compute). A notice posted
    while the reverse stream carries data arrives behind that data. Measured with torch's gloo over
    emulated links on one core per stage (``benchmarks/p2p_links.py``, docs/validation.md, stop 62):
    a send waits for the receive to be posted, not for the wire; an exchange whose two receives
    were both posted before any data moved took one transfer time, not two; and under 1F1B, whose
    stages post a send before the receive that goes with it, a stage's notice follows the data its
    neighbour is sending, so the two directions take turns (stop 43 saw 1F1B take its compute plus
    every transfer one after another over 200/20 Mbit/s). These rules are gloo's over TCP; NCCL's
    point-to-point between GPUs follows the same schedule but was not measured (no multi-GPU host).

    Raises:
        RuntimeError: the programs deadlock (cannot happen for torch's schedules).
    """
    n = len(fwd_s)
    send_block_s = send_block_s or [0.0] * max(0, n - 1)
    bucket_s, fixed_s = bucket_s or [0.0] * max(0, n - 1), fixed_s or [0.0] * max(0, n - 1)
    programs = [stage_program(schedule, s, n, microbatches) for s in range(n)]
    pc, clock = [0] * n, [0.0] * n
    stream_free: dict[tuple[int, str], float] = {}  # (boundary, direction of its data) -> when its bytes are through
    tokens: dict[tuple[int, str], float] = {}  # stream -> its bucket (wire seconds) when its last transfer ended
    send_posted: dict[tuple[str, int, int], float] = {}  # transfer -> when its sender posted it
    notice_at: dict[tuple[str, int, int], float] = {}  # transfer -> when the receiver's notice reached the sender
    done: dict[tuple[int, tuple[str, int, int]], float] = {}  # (stage, transfer) -> when that stage's end completed
    blocked: dict[int, list[tuple[str, int, int]]] = {}  # stage -> the transfers its wait needs
    events = [(0.0, s, s) for s in range(n)]
    heapq.heapify(events)
    seq = n

    def resume(stage: int, at: float) -> None:
        nonlocal seq
        heapq.heappush(events, (at, seq, stage))
        seq += 1

    def write_data(t: tuple[str, int, int]) -> None:
        """Both ends have posted and the notice has arrived: the data goes into its stream."""
        kind, boundary, _ = t
        sender, receiver = (boundary, boundary + 1) if kind == "F" else (boundary + 1, boundary)
        handed = max(send_posted[t], notice_at[t])
        stream = (boundary, kind)
        start = max(handed, stream_free.get(stream, 0.0))
        idle = start - stream_free.get(stream, -math.inf)
        held = min(bucket_s[boundary], tokens.get(stream, 0.0) + idle)
        wire = max(0.0, transfer_s[boundary] - fixed_s[boundary])
        tokens[stream] = held - min(held, wire)
        stream_free[stream] = done[(receiver, t)] = start + transfer_s[boundary] - min(held, wire)
        done[(sender, t)] = handed
        for other, needs in list(blocked.items()):
            if all((other, x) in done for x in needs):
                del blocked[other]
                resume(other, max([clock[other], *(done[(other, x)] for x in needs)]))

    # a discrete-event simulation: stages resume in time order, so each stream carries its writes in time order
    while events:
        t, _, s = heapq.heappop(events)
        clock[s] = max(clock[s], t)
        while pc[s] < len(programs[s]):
            op, arg = programs[s][pc[s]]
            if op == "send":
                send_posted[arg] = clock[s]
                if arg in notice_at:
                    write_data(arg)
            elif op == "recv":  # the notice travels back behind the data already in the reverse stream
                notice_at[arg] = max(clock[s], stream_free.get((arg[1], "B" if arg[0] == "F" else "F"), 0.0))
                if arg in send_posted:
                    write_data(arg)
            elif op == "wait":
                if not all((s, x) in done for x in arg):
                    blocked[s] = list(arg)
                    break
                until = max([clock[s], *(done[(s, x)] for x in arg)])
                if until > clock[s]:  # resume when the last of them has completed, after what happens before
                    pc[s] += 1
                    resume(s, until)
                    break
            else:
                step = (fwd_s[s] + (send_block_s[s] if s < n - 1 else 0.0)) if op == "F" \
                    else (bwd_s[s] + (send_block_s[s - 1] if s > 0 else 0.0))
                pc[s] += 1
                resume(s, clock[s] + step)  # the op runs; others act meanwhile
                break
            pc[s] += 1
    if blocked or any(pc[s] < len(programs[s]) for s in range(n)):
        raise RuntimeError(f"pipeline simulation deadlocked ({schedule}, {n} stages, {microbatches} micro-batches)")
    busy = [microbatches * (fwd_s[s] + bwd_s[s]) for s in range(n)]
    return max(clock), busy


def predict_pipeline(profile: WorkloadProfile, cluster: ClusterSpec, s: Setting, scale: float = 1.0) -> Prediction:
    """GPipe or 1F1B: the schedule simulated with per-stage micro-batch times and activation transfers
    (thesis 002 ch. 6).

    Stages are cut like the strategies cut them (:func:`balanced_stage_bounds`, or the setting's
    ``stage_bounds``); a stage's micro-batch forward/backward time is the sum of its layers'
    profiled times at the micro-batch size (times contention). Each boundary moves ``microbatch *
    output_bytes_per_sample`` bytes per micro-batch each way at ``p2p_fixed_s + latency + bytes /
    bandwidth``, as gloo's rendezvous moves them over one stream per direction, less what the link's
    token bucket lets through at once (``LinkSpec.burst_bytes``: emulated links), each stage running
    torch's schedule with its waits (:func:`stage_program`, :func:`simulate_pipeline`); the sender
    spends ``p2p_fixed_s`` of its own time per send. Over emulated links of 200, 50 and 200/20
    Mbit/s (2 one-core stages, 4 micro-batches of MobileNetV2) the simulation with the runs' own
    per-stage compute came within -4.0 to +2.6 % of all 18 runs' steps, where the previous one (one
    transfer at a time per boundary, no bucket) was +0.9 to +19.8 % (docs/validation.md, stop 62).
    The step ends when the slowest stage has run its :func:`pipeline_ops`, then every stage steps
    its optimizer on its share of the parameters. ``forward_s`` and ``backward_s`` are the busiest
    stage's own micro-batch forwards and backwards (its profiled split), ``bubble_s`` the step
    minus that stage's compute.
    """
    w, m = s.workers, microbatches_of(s)
    mb = s.batch_size / m
    slow = contention(cluster, busy_per_node(cluster, w)) * scale
    bounds = stage_bounds_of(profile, s)
    fwd, bwd = profile.layer_times_s(mb)
    f_stage = [sum(fwd[a:b]) * slow for a, b in zip(bounds, bounds[1:])]
    b_stage = [sum(bwd[a:b]) * slow for a, b in zip(bounds, bounds[1:])]
    transfer, block, bucket, fixed = [], [], [], []
    for k in range(w - 1):
        nbytes = mb * profile.layers[bounds[k + 1] - 1].output_bytes_per_sample
        link = boundary_link(cluster, k)
        wire = link.transfer_s(nbytes) - link.latency_s
        transfer.append(cluster.p2p_fixed_s + link.latency_s + wire)
        block.append(cluster.p2p_fixed_s)
        bucket.append(link.burst_s)
        fixed.append(cluster.p2p_fixed_s + link.latency_s)
    span, busy = simulate_pipeline(s.strategy, f_stage, b_stage, transfer, m, block, bucket, fixed)
    step = profile.step_at(s.batch_size)
    stage_params = [sum(layer.param_bytes for layer in profile.layers[a:b]) for a, b in zip(bounds, bounds[1:])]
    opt = max(step.optimizer_s * slow * p / max(1, profile.param_bytes) for p in stage_params)
    busiest = max(range(w), key=lambda k: busy[k])
    parts = {"forward_s": m * f_stage[busiest], "backward_s": m * b_stage[busiest], "bubble_s": span - busy[busiest],
             "optimizer_s": opt}
    parts["data_load_s"] = exposed_loading_s(profile, s.batch_size, s.loader_workers, sum(parts.values()))
    ref = eq_6_epoch_s(profile, cluster, s, bounds, scale)
    return make_prediction(s, parts, s.batch_size, reference_epoch_s={"eq6.1+6.2": ref},
                           inputs={"stage_bounds": bounds, "stage_forward_s": f_stage, "stage_backward_s": b_stage,
                                   "transfer_s": transfer, "bucket_s": bucket, "microbatch": mb,
                                   "busiest_stage": busiest,
                                   "contention": slow / scale, "compute_scale": scale})


def eq_6_epoch_s(profile: WorkloadProfile, cluster: ClusterSpec, s: Setting, bounds: list[int],
                 scale: float = 1.0) -> float:
    """Thesis 002 eq. 6.1 + eq. 6.2 (GPipe), per epoch — the reference model.

    eq. 6.1: ``T_comp = T_seq * (W + #mb - 1) / (W * #mb)``, with ``T_seq`` the one-device time of
    the batch as ``#mb`` micro-batches (``#mb`` x the profiled step at the micro-batch size), so
    that one micro-batch gives ``T_seq`` as the thesis says.
    eq. 6.2: ``T_comm = 2 * (sum_{i=1}^{W-2} max_{j<=i} c_j + (#mb - (W-2)) * max_j c_j
    + sum_{i=2}^{W-1} max_{j>=i} c_j)`` with ``c_j = L_j + mb * A_j / BW_j`` over the stage
    boundaries j (``A_j``: activation bytes per sample at boundary j).
    """
    w, m = s.workers, microbatches_of(s)
    mb = s.batch_size / m
    t_seq = m * profile.step_at(mb).step_s * scale
    t_comp = t_seq * (w + m - 1) / (w * m)
    c = []
    for k in range(w - 1):
        link = boundary_link(cluster, k)
        c.append(link.transfer_s(mb * profile.layers[bounds[k + 1] - 1].output_bytes_per_sample))
    fill = sum(max(c[:i]) for i in range(1, w - 1))
    full = (m - (w - 2)) * max(c)
    drain = sum(max(c[i - 1:]) for i in range(2, w))
    t_comm = 2 * (fill + full + drain)
    return (t_comp + t_comm) * s.epoch_samples / s.batch_size


def memory_pipeline(profile: WorkloadProfile, s: Setting) -> list[MemoryEstimate]:
    """Peak memory of each stage of a pipeline (notation of :mod:`ddlscope.modeling.memory`).

    ``torch.distributed.pipelining``, one stage per worker, stage ``s`` holding layers ``[k_s,
    k_(s+1))`` of the cut (:func:`stage_bounds_of`); ``M`` micro-batches of ``m = batch_size / M``
    samples, ``b`` the whole batch. ``params = sum (p_l + bf_l)``, ``grads = sum p_l`` and
    ``optimizer = O * sum p_l / P`` over the stage's own layers (the strategy frees the other
    stages' layers in place). Micro-batches in flight: GPipe runs every forward before any
    backward, so ``k = M`` (Huang et al. 2019); 1F1B holds at most ``k = min(M, S - s)``
    (Narayanan et al. 2021, PipeDream-flush). ``activations = k * m * a_s + t_s + b *
    sample_bytes``, where ``a_s = sum s_l`` (minus the first layer's saved input ``i_k``: that is
    the receive buffer, counted below, or on the first stage a slice of the input batch; plus the
    stage's output ``o_last`` when only the next stage saves it, since the stage keeps its
    outputs until their backward), ``t_s`` the transient memory of one micro-batch's backward
    (``m * (A(m) / m - sum_all s_l - sample_bytes)`` scaled by the stage's largest ``s_l`` over
    the model's largest), and ``b * sample_bytes`` the whole input batch, which every stage
    loads. ``comm = M * m * (i_in + o_out)``: torch allocates one receive buffer per micro-batch
    for the activations coming in (stages after the first, ``i_in`` = previous layer's ``o``)
    and for the gradients coming back (stages before the last, ``o_out`` = last layer's ``o``),
    and keeps them. With ``M > 1`` the stage's gradients accumulate over micro-batches: autograd
    computes a layer's weight gradients before adding them into ``.grad``, so ``grads`` adds the
    stage's largest ``p_l``.
    """
    layers, stages, microbatches = profile.layers, s.workers, microbatches_of(s)
    m = math.ceil(s.batch_size / microbatches)
    bounds = stage_bounds_of(profile, s)
    P, O, R = profile.param_bytes, profile.optimizer_state_bytes, profile.device.runtime_bytes
    saved_all = sum(layer.saved_bytes_per_sample for layer in layers)
    max_saved = max((layer.saved_bytes_per_sample for layer in layers), default=0) or 1
    # backward transient per sample of the whole model: what the step's peak holds beyond saved activations
    transient_per_sample = max(0.0, activation_bytes(profile, m) / m - saved_all - profile.sample_bytes)
    out = []
    for k in range(stages):
        lo, hi = bounds[k], bounds[k + 1]
        mine = layers[lo:hi]
        p = sum(layer.param_bytes for layer in mine)
        # the first layer's saved input is the receive buffer (or, on the first stage, the batch): counted apart
        per_sample = sum(layer.saved_bytes_per_sample for layer in mine) - mine[0].input_saved_bytes_per_sample
        if k < stages - 1 and layers[hi].input_saved_bytes_per_sample > 0:
            per_sample += mine[-1].output_bytes_per_sample  # kept for backward; only the next stage saves it
        in_flight = microbatches if s.strategy == "gpipe" else min(microbatches, stages - k)
        transient = m * transient_per_sample * max(layer.saved_bytes_per_sample for layer in mine) / max_saved
        activations = in_flight * m * per_sample + transient + s.batch_size * profile.sample_bytes
        recv_in = layers[lo - 1].output_bytes_per_sample if k > 0 else 0
        recv_grad = mine[-1].output_bytes_per_sample if k < stages - 1 else 0
        comm = microbatches * m * (recv_in + recv_grad)
        out.append(MemoryEstimate(
            worker=k, params_bytes=p + sum(layer.buffer_bytes for layer in mine),
            grads_bytes=p + (max(layer.param_bytes for layer in mine) if microbatches > 1 else 0),
            optimizer_bytes=round(O * p / P) if P else 0, activations_bytes=round(activations),
            comm_buffers_bytes=comm, runtime_bytes=R,
            notes=f"stage {k}: layers {lo}..{hi - 1} ({mine[0].name}..{mine[-1].name}), {in_flight} of "
                  f"{microbatches} micro-batches of {m} in flight"))
    return out


_COMMON = dict(
    launcher="torchrun",
    measures="per-stage bubble, activation transfer time and bytes",
    data_parallel=False,
    min_workers=2,
    check_config=check_microbatches,
    check_setting=check_pipeline_setting,
    candidate=pipeline_candidate,
    cost_model=predict_pipeline,
    memory_model=memory_pipeline,
    reference_models=("eq6.1+6.2",),
)

GPIPE = register(DistributionModel(
    name="gpipe",
    summary="pipeline: one stage per worker, all forwards then all backwards (GPipe)",
    strategy="pipeline:GPipeStrategy",
    predicts="the GPipe schedule simulated over per-stage micro-batch times (ddlscope) and eq. 6.1 + 6.2 (thesis 002)",
    order=30,
    # thesis 002, Table 3.3: GPipe's batch (micro-batches) per dataset, its own column
    table_3_3_batch={"mnist": (3072, 24), "cifar10": (2048, 32), "imagenet": (384, 12), "highres": (48, 12)},
    **_COMMON,
))

ONE_F_ONE_B = register(DistributionModel(
    name="1f1b",
    summary="pipeline: one stage per worker, one forward then one backward (1F1B, PipeDream-flush)",
    strategy="pipeline:OneFOneBStrategy",
    predicts="the 1F1B schedule simulated over per-stage micro-batch times (ddlscope) and eq. 6.1 + 6.2 (thesis 002)",
    order=40,
    min_microbatches_per_worker=1,
    **_COMMON,
))
