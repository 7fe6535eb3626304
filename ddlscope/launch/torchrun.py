"""Launching the torch.distributed distribution models with torch's elastic launcher (torchrun).

Locally the :class:`~ddlscope.launch.local.LocalLauncher` runs one torchrun agent with
``--nproc-per-node = peers`` and a c10d rendezvous on a loopback port. On a cluster the same
command runs on every node with ``--nnodes`` and a shared rendezvous endpoint
(``ddlscope run CONFIG --nnodes N --rdzv-endpoint HOST:PORT --run-id ID``). torchrun ends the
other workers when one fails (``--max-restarts 0``) and exits non-zero. The agent is started through
:mod:`ddlscope.launch.agent` so that it dies with the launcher and, locally, listens on loopback only.

Before anything starts, :func:`preflight` checks what would otherwise fail inside the workers:
the rendezvous port and, for pipelines, whether the network can be cut into that many stages.
"""

from __future__ import annotations

import errno
import os
import socket
import sys

from ddlscope.config import RunConfig
from ddlscope.errors import UserError


def rendezvous_port(cfg: RunConfig, host: str = "127.0.0.1") -> int:
    """The port for torchrun's rendezvous: ``distributed.rendezvous_port`` if free, else any free port when it is 0.

    Raises:
        UserError: the configured port is already in use (or cannot be bound) on ``host``.
    """
    port = cfg.distributed.rendezvous_port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as err:
            why = "is already in use" if err.errno == errno.EADDRINUSE else f"cannot be bound ({err.strerror})"
            raise UserError(f"distributed.rendezvous_port = {port} {why} on {host}; allowed: a free port, "
                            f"or 0 to let ddlscope pick one") from None
        return s.getsockname()[1]


def preflight(cfg: RunConfig, check_port: bool = True) -> int | None:
    """Checks before a run starts: the strategy's own (:meth:`Strategy.preflight`: e.g. whether the
    network can be cut into that many stages, or a dmoe network fits its experts) and, for a
    torch.distributed run, the rendezvous port. Returns the local rendezvous port (None for other
    launchers, or when ``check_port`` is False because a cluster endpoint was given).

    Raises:
        UserError: naming what does not fit and what is allowed.
    """
    cfg.distribution_model.strategy_class().preflight(cfg)
    if cfg.distribution_model.launcher != "torchrun":
        return None
    return rendezvous_port(cfg) if check_port else None


def torchrun_command(nproc_per_node: int, rdzv_endpoint: str, worker_args: list[str], nnodes: int = 1,
                     rdzv_id: str = "ddlscope", local_addr: str | None = None, is_host: bool | None = None) -> list[str]:
    """The command line that starts torchrun's agent for ``nproc_per_node`` ddlscope workers on this node.

    The agent runs under :mod:`ddlscope.launch.agent`, started by this process: it dies with it,
    and with a loopback endpoint (every node on this machine) every store it hosts and the
    workers' gloo pairs listen on 127.0.0.1 only; else each store listens on the address it is
    reached at (docs/network.md).

    Args:
        rdzv_endpoint: ``host:port`` of the c10d rendezvous (the first node hosts it).
        worker_args: arguments of ``python -m ddlscope.train.worker``.
        nnodes: nodes taking part; each runs this same command.
        rdzv_id: the same on every node of one run.
        local_addr: the address this node's agent is reached at (torchrun's ``--local-addr``);
            default loopback for a loopback endpoint, else torchrun's choice (the host name's).
        is_host: whether this node hosts the rendezvous store (torchrun's ``is_host``); default
            torchrun's guess from the endpoint's host name, which cannot see a namespace's address.
    """
    from ddlscope.launch.network import LOOPBACK, is_loopback

    local = is_loopback(rdzv_endpoint.rsplit(":", 1)[0].strip("[]"))  # then every node is on this machine
    agent = [sys.executable, "-m", "ddlscope.launch.agent", "--parent-pid", str(os.getpid()),
             "--bind", "loopback" if local else "reached"]
    return [*agent, f"--nnodes={nnodes}", f"--nproc-per-node={nproc_per_node}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}", f"--rdzv-id={rdzv_id}", "--max-restarts=0",
            *([f"--local-addr={local_addr or LOOPBACK}"] if local or local_addr else []),
            *([f"--rdzv-conf=is_host={str(is_host).lower()}"] if is_host is not None else []),
            "--monitor-interval=0.2", "-m", "ddlscope.train.worker", *worker_args]
