"""``dmoe``: a trainer of the Decentralized Mixture-of-Experts (Ryabinin & Gusev 2020; hivemind 1.1.12).

The trainer's network (:func:`ddlscope.moe.networks.build_moe_network`) holds a trunk, a gate and a
mixture-of-experts layer. With ``dmoe.placement = "remote"`` the layer is hivemind's
``RemoteMixtureOfExperts``: the experts live on the run's expert servers (:mod:`ddlscope.moe.server`),
found through the DHT; ``local`` keeps the same experts in-process and ``dense`` replaces the
mixture by one expert (the baselines). The trunk and gate train with the run's optimizer; the
remote experts train on their servers.

What is measured per step, beyond the loop's timings (hivemind's client functions are wrapped in
this process; nothing in hivemind is changed):

- ``beam_search_s``: the DHT look-ups of the beam search that chooses each sample's experts;
- ``expert_forward_s`` / ``expert_backward_s``: wall time of the remote forward and backward
  rounds (``_RemoteCallMany``: every call sent, answers awaited up to ``k_min`` per sample plus
  ``timeout_after_k_min_s``, or the timeout);
- per expert, direction and answering server (``moe_calls``): calls, failures (errors, and
  calls cancelled at the timeout), summed and largest latency, payload bytes sent and received;
- ``samples_dropped``: samples no chosen expert answered (their mixture output is zero).

In the common step vocabulary the remote part is communication: ``comm_wait_s = beam_search_s +
expert_forward_s + expert_backward_s`` (the trainer is blocked on it), ``forward_s`` and
``backward_s`` keep only the trainer's own compute, ``comm_bytes`` is the payload both ways.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from typing import Any

import torch

from ddlscope.distribution.dmoe import UID_PREFIX
from ddlscope.errors import UserError
from ddlscope.strategies.base import BatchResult, StepOutcome, Strategy

SHUTDOWN_S = 5.0


class _StepLog:
    """What the wrapped hivemind functions saw during one step (thread-safe: calls finish on
    hivemind's RemoteExpertWorker thread)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self.lock:
            self.beam_search_s = self.forward_s = self.backward_s = 0.0
            self.samples_dropped = self.experts_chosen = 0
            # (expert, direction, peer) -> [calls, failed, latency sum, latency max, bytes sent, bytes received]
            self.calls: dict[tuple[str, str, str | None], list] = defaultdict(lambda: [0, 0, 0.0, 0.0, 0, 0])

    def add_call(self, expert: str, direction: str, peer: str | None, latency_s: float, ok: bool, sent: int,
                 received: int) -> None:
        with self.lock:
            c = self.calls[(expert, direction, peer)]
            c[0] += 1
            c[1] += 0 if ok else 1
            c[2] += latency_s
            c[3] = max(c[3], latency_s)
            c[4] += sent
            c[5] += received


_ACTIVE = _StepLog()
_INSTALLED = False


def _nbytes(tensors) -> int:
    return sum(t.element_size() * t.nelement() for t in tensors if isinstance(t, torch.Tensor))


def _install_hooks() -> None:
    """Wrap hivemind 1.1.12's per-call coroutines and its ``_RemoteCallMany`` (once per process)."""
    global _INSTALLED
    if _INSTALLED:
        return
    import hivemind.moe.client.moe as moe_module

    def timed(inner, direction: str):
        async def call(uid, tensors, serialized, stub):
            t0, ok, out = time.perf_counter(), False, None
            try:
                out = await inner(uid, tensors, serialized, stub)
                ok = True
                return out
            finally:  # errors and cancellation at the timeout count as failed calls
                peer = getattr(stub, "_peer", None)
                _ACTIVE.add_call(uid, direction, peer.to_base58() if peer is not None else None,
                                 time.perf_counter() - t0, ok, _nbytes(tensors), _nbytes(out or ()))

        return call

    moe_module.expert_forward = timed(moe_module.expert_forward, "forward")
    moe_module.expert_backward = timed(moe_module.expert_backward, "backward")
    base = moe_module._RemoteCallMany

    class MeasuredCallMany(base):
        @classmethod
        def forward(cls, ctx, *args):
            t0 = time.perf_counter()
            try:
                out = super().forward(ctx, *args)
            finally:
                _ACTIVE.forward_s += time.perf_counter() - t0
            mask = out[0]  # [samples, max experts]: which chosen experts answered
            dropped = ~mask.any(dim=1)
            _ACTIVE.samples_dropped += int(dropped.sum())
            _ACTIVE.experts_chosen += sum(len(row) for row in args[1])
            if dropped.any():  # hivemind would softmax all -inf (NaN); keep one zero answer: output 0
                mask = mask.clone()
                mask[dropped, 0] = True
                out = (mask, *out[1:])
            return out

        @classmethod
        def backward(cls, ctx, *grads):
            t0 = time.perf_counter()
            try:
                return super().backward(ctx, *grads)
            finally:
                _ACTIVE.backward_s += time.perf_counter() - t0

    moe_module._RemoteCallMany = MeasuredCallMany
    _INSTALLED = True


class _Tolerant(torch.nn.Module):
    """hivemind's remote mixture, except that a batch none of whose calls was answered (hivemind
    raises: fewer than ``k_min`` answers in all) gives the mixture output of a dropped sample, zeros
    of the input's shape (the experts map their input to its own shape), and counts every sample as
    dropped. Training and evaluation then go on while servers are gone; the step's ``moe_steps``
    row says what was lost. In the backward pass (``backward_k_min = 0``) an expert that died after
    answering the forward gives zero gradients; its failed call is in ``moe_calls``. A CI run lost
    its trainer to hivemind's "Backward pass: less than 1 experts responded" when a server was
    killed between a step's forward and backward."""

    def __init__(self, remote: torch.nn.Module):
        super().__init__()
        self.remote = remote

    def forward(self, x: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
        try:
            return self.remote(x, *args)
        except (TimeoutError, RuntimeError) as e:
            if "responded within timeout" not in str(e) and "No responding experts" not in str(e):
                raise
            _ACTIVE.samples_dropped += len(x)
            return torch.zeros_like(x)


def join_experts(d, peers: list[str], need: int, who: str):
    """Join the expert servers' DHT (client mode: a trainer makes calls, it takes none) and wait
    until ``need`` of the grid's experts are announced; returns the running ``hivemind.DHT``.

    Raises:
        UserError: no initial peers, none reachable, or fewer than ``need`` experts of the grid
            found within ``dmoe.join_timeout_s`` (names the grid, what was found and the peers).
    """
    import hivemind
    from hivemind.moe.server.dht_handler import get_experts

    from ddlscope.launch.network import p2p_options

    if not peers:
        raise UserError("dmoe: no expert servers to join (no initial peers); allowed: let ddlscope start "
                        "dmoe.servers, or give dmoe.initial_peers of running servers")
    try:
        dht = hivemind.DHT(initial_peers=peers, client_mode=True, start=True, startup_timeout=d.join_timeout_s,
                           **p2p_options(d.nat_traversal))
    except hivemind.p2p.P2PDaemonError as e:
        raise UserError(f"dmoe: {who} could not reach the expert servers at {peers} within join_timeout_s = "
                        f"{d.join_timeout_s:g} s: {e}") from None
    uids = d.expert_uids()
    deadline, found = time.monotonic() + d.join_timeout_s, 0
    while time.monotonic() < deadline:
        found = sum(e is not None for e in get_experts(dht, uids))
        if found >= need:
            return dht
        time.sleep(0.25)
    _shutdown(dht)
    raise UserError(f"dmoe: {who} found {found} of the {len(uids)} experts of grid_size = {d.grid_size} "
                    f"(ids {uids[0]} .. {uids[-1]}) within join_timeout_s = {d.join_timeout_s:g} s, needed {need}; "
                    f"do the servers at {peers} host this grid?")


def _shutdown(dht) -> None:
    closer = threading.Thread(target=dht.shutdown, daemon=True)
    closer.start()
    closer.join(SHUTDOWN_S)


class DMoEStrategy(Strategy):
    """One dmoe trainer. See the module docstring for what it runs and measures."""

    name = "dmoe"
    uses_network = True

    def __init__(self, cfg, ctx):
        super().__init__(cfg, ctx)
        self.dht = None
        self.mixture = None
        self._step = 0

    @classmethod
    def preflight(cls, cfg) -> None:
        """The network fits the dataset and the expert, the expert maps its input to the same
        shape (a user factory is imported and called once), and servers given by
        ``dmoe.initial_peers`` are reachable and host the grid — before any process starts.

        Raises:
            UserError: naming ``model`` / ``dmoe.expert`` and what is allowed.
        """
        from ddlscope.moe.experts import check_expert
        from ddlscope.moe.networks import network_family_ok
        from ddlscope.workloads.datasets import default_data_root, open_dataset

        _, spec = open_dataset(cfg.dataset, cfg.data_root or default_data_root(), "test")
        why = network_family_ok(cfg.model, spec.family, cfg.dmoe.expert)
        if why:
            raise UserError(why)
        check_expert(cfg.dmoe.expert, cfg.dmoe.hidden_dim)
        d = cfg.dmoe
        if d.placement == "remote" and d.initial_peers:  # servers someone else runs: reachable, with this grid?
            from ddlscope.launch.processes import private_hivemind_sockets

            with private_hivemind_sockets():
                _shutdown(join_experts(d, d.initial_peers, d.k_best, "ddlscope"))

    # ------------------------------------------------------------------ network
    def build_model(self, name: str, family: str, num_classes: int) -> torch.nn.Module:
        from ddlscope.moe.networks import build_moe_network

        d = self.cfg.dmoe
        if d.placement != "remote":  # experts start as the servers' would (the same seeds)
            return build_moe_network(name, family, num_classes, d, seed=self.cfg.seed)
        from hivemind.moe import RemoteMixtureOfExperts

        self._join()
        _install_hooks()
        remote = RemoteMixtureOfExperts(
            in_features=d.hidden_dim, grid_size=tuple(d.grid_size), dht=self.dht, uid_prefix=UID_PREFIX,
            # backward_k_min 0: experts that answered the forward and died before the backward (a killed
            # server) give zero gradients for their samples instead of failing the step (hivemind raises
            # TimeoutError with any k_min > 0); their failed calls are counted in moe_calls, as in the forward
            k_best=d.k_best, k_min=d.k_min, backward_k_min=0, forward_timeout=d.forward_timeout_s,
            backward_timeout=d.backward_timeout_s, timeout_after_k_min=d.timeout_after_k_min_s)
        search = remote.beam_search.batch_find_best_experts

        def timed_search(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return search(*args, **kwargs)
            finally:
                _ACTIVE.beam_search_s += time.perf_counter() - t0

        remote.beam_search.batch_find_best_experts = timed_search
        self.mixture = _Tolerant(remote)
        return build_moe_network(name, family, num_classes, d, mixture=self.mixture, seed=self.cfg.seed)

    def _join(self) -> None:
        d = self.cfg.dmoe
        late = {ev.server for ev in d.server_events if ev.start_at_s > 0}
        need = (sum(len(d.server_uids(s)) for s in range(d.servers) if s not in late)
                if not d.initial_peers else d.k_best)
        self.dht = join_experts(d, self.ctx.initial_peers or d.initial_peers, need, f"trainer {self.ctx.worker_index}")

    # ------------------------------------------------------------------ steps
    def forward_backward(self, model, x, y, loss_fn, loss_scale: float = 1.0, sync: bool = True) -> BatchResult:
        _ACTIVE.reset()
        res = super().forward_backward(model, x, y, loss_fn, loss_scale, sync).resolve()  # compared with host times
        log = _ACTIVE
        remote_forward = log.beam_search_s + log.forward_s
        res.forward_s = max(0.0, res.forward_s - remote_forward)
        res.backward_s = max(0.0, res.backward_s - log.backward_s)
        res.comm_wait_s = res.comm_s = remote_forward + log.backward_s
        calls = dict(log.calls)
        res.comm_bytes = sum(c[4] + c[5] for c in calls.values())
        self._record(res.samples, log, calls, model)
        self._step += 1
        return res

    def _record(self, samples: int, log: _StepLog, calls: dict, model) -> None:
        store = self.ctx.writer or self.ctx.store  # the loop's batched writer while it trains
        if store is None:
            return
        run_id, wi, step = self.ctx.run_id, self.ctx.worker_index, self._step
        if self.mixture is None:  # local placement: the load each in-process expert got
            load = getattr(getattr(model, "moe", None), "last_load", None) or {}
            calls = {(uid, "forward", None): [n, 0, None, None, None, None] for uid, n in load.items()}
        by_dir = defaultdict(int)
        for (_, direction, _), c in calls.items():
            by_dir[direction] += c[0]
        store.add_rows("moe_steps", [dict(
            run_id=run_id, worker_index=wi, step=step, wall_time=time.time(), samples=samples,
            beam_search_s=log.beam_search_s if self.mixture is not None else None,
            expert_forward_s=log.forward_s if self.mixture is not None else None,
            expert_backward_s=log.backward_s if self.mixture is not None else None,
            forward_calls=by_dir["forward"], backward_calls=by_dir["backward"] if self.mixture is not None else None,
            failed_calls=sum(c[1] for c in calls.values()) if self.mixture is not None else None,
            samples_dropped=log.samples_dropped if self.mixture is not None else None,
            bytes_sent=sum(c[4] for c in calls.values()) if self.mixture is not None else None,
            bytes_received=sum(c[5] for c in calls.values()) if self.mixture is not None else None,
            experts_chosen=log.experts_chosen if self.mixture is not None else None)])
        store.add_rows("moe_calls", [dict(
            run_id=run_id, worker_index=wi, step=step, expert=uid, direction=direction, peer_id=peer, calls=c[0],
            failed=c[1], latency_s_sum=c[2], latency_s_max=c[3], bytes_sent=c[4], bytes_received=c[5])
            for (uid, direction, peer), c in calls.items()])

    def step(self, samples: int) -> StepOutcome:
        self.optimizer.step()
        return StepOutcome()

    def details(self) -> dict[str, Any]:
        d = self.cfg.dmoe
        return {"placement": d.placement, "expert": d.expert, "grid_size": d.grid_size, "k_best": d.k_best,
                "k_min": d.k_min, "experts": d.num_experts}

    def close(self) -> None:
        if self.dht is not None:
            _shutdown(self.dht)
