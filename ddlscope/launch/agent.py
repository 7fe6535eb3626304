"""torchrun's elastic agent, started so that it dies with its launcher and listens only where it must.

``python -m ddlscope.launch.agent --parent-pid PID --bind BIND <torchrun arguments>`` runs
``torch.distributed.run``'s ``main`` in this process after two changes torchrun has no option for:

- **It dies with its launcher.** It asks Linux for SIGTERM when its parent dies
  (:func:`~ddlscope.launch.processes.die_with_parent`) and exits at once if the parent ``PID``
  is already gone. On SIGTERM torchrun stops its workers (who also watch their parent, the agent)
  and exits, so a SIGKILLed ``ddlscope run`` leaves no agent or worker training on. Its last act
  then is to remove the run's private ``$TMPDIR``, where torchrun writes its ``torchelastic_*``
  logs while shutting down, after the workers removed the folder.
- **Its TCP stores listen on one address.** torch's ``TCPStore`` server listens on every
  interface whatever host it is given: the c10d rendezvous store (on the rendezvous port) and
  the store the agent shares with its workers (the "second port", any free one). Here each is
  bound first to one address and handed over (``TCPStore(master_listen_fd=...)``):

  - ``--bind loopback`` (a local run): 127.0.0.1; the workers' gloo pairs and nccl's bootstrap
    sockets are put on the loopback interface too (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``),
    unless the environment names one;
  - ``--bind reached`` (a run over several nodes): the address the store is reached at (the
    rendezvous endpoint's host, the node's ``--local-addr``) when that is an address of one of
    this machine's interfaces and not loopback; else every interface, torch's own behaviour.

See docs/network.md for what listens where.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import sys
from collections.abc import Callable

from ddlscope.launch.network import LOOPBACK
from ddlscope.launch.processes import die_with_parent, remove_run_temp_dir

BIND_MODES = ("loopback", "reached")


def local_address_for(host: str) -> str | None:
    """The address of this machine's interfaces that ``host`` resolves to (loopback excluded), else None."""
    own = {a.address.split("%")[0] for addrs in _interface_addresses().values() for a in addrs}
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return None
    for info in infos:
        ip = info[4][0].split("%")[0]
        if ip in own and not ipaddress.ip_address(ip).is_loopback:
            return ip
    return None


def loopback_interface() -> str | None:
    """The name of the interface that holds 127.0.0.1 (``lo`` on Linux), None if there is none."""
    for name, addrs in _interface_addresses().items():
        if any(a.family == socket.AF_INET and a.address == LOOPBACK for a in addrs):
            return name
    return None


def _interface_addresses() -> dict:
    import psutil

    return psutil.net_if_addrs()


def bound_listener(address: str, port: int) -> int:
    """A listening TCP socket on ``address``:``port`` (0: any free port); returns its file descriptor,
    which the caller owns (``TCPStore(master_listen_fd=...)`` takes it over).

    Raises:
        RuntimeError: it cannot be bound (e.g. the port is in use); the c10d rendezvous then
            joins the store as a client, as it does when torch's own bind fails.
    """
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((address, port))
        s.listen(socket.SOMAXCONN)
    except OSError as e:
        s.close()
        raise RuntimeError(f"cannot listen on {address}:{port}: {e.strerror}") from None
    return s.detach()


def bound_store_factory(bind: str, store_class: Callable) -> Callable:
    """A drop-in for ``torch.distributed.TCPStore(host_name, port, ..., is_master=...)`` whose server
    listens on the address ``bind`` asks for (see the module docstring); clients are unchanged.

    Args:
        bind: one of :data:`BIND_MODES`.
        store_class: ``torch.distributed.TCPStore``.
    """
    if bind not in BIND_MODES:
        raise ValueError(f"bind = {bind!r}; allowed: {', '.join(BIND_MODES)}")

    def create(host_name: str, port: int, world_size=None, is_master: bool = False, *args, **kwargs):
        if is_master and kwargs.get("master_listen_fd") is None:
            address = LOOPBACK if bind == "loopback" else local_address_for(host_name)
            if address is not None:
                kwargs["master_listen_fd"] = bound_listener(address, int(port))
                port = _fd_port(kwargs["master_listen_fd"])
        return store_class(host_name, port, world_size, is_master, *args, **kwargs)

    return create


def _fd_port(fd: int) -> int:
    s = socket.socket(fileno=fd)
    try:
        return s.getsockname()[1]
    finally:
        s.detach()


def patch_torch_stores(bind: str) -> None:
    """Make the stores torchrun's agent hosts listen as ``bind`` says: the c10d rendezvous backend's
    store and the store the dynamic rendezvous shares with the workers."""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, dynamic_rendezvous

    create = bound_store_factory(bind, dist.TCPStore)
    c10d_rendezvous_backend.TCPStore = create

    def shared_store_server(self, master_addr, master_port):
        return create(master_addr, master_port, is_master=True, multi_tenant=True)

    dynamic_rendezvous.DynamicRendezvousHandler._create_tcp_store_server = shared_store_server


def main(argv: list[str] | None = None) -> None:
    """``--parent-pid PID --bind {loopback,reached} TORCHRUN_ARGS...`` (exactly in that order)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 4 or argv[0] != "--parent-pid" or argv[2] != "--bind" or argv[3] not in BIND_MODES:
        raise SystemExit("usage: python -m ddlscope.launch.agent --parent-pid PID --bind {loopback,reached} "
                         "TORCHRUN_ARGS...")
    parent_pid, bind, torchrun_args = int(argv[1]), argv[3], argv[4:]
    die_with_parent(signal.SIGTERM)
    if os.getppid() != parent_pid:  # the launcher died before the request took effect
        raise SystemExit(f"the launcher (pid {parent_pid}) is gone; not starting")
    interface = loopback_interface() if bind == "loopback" else None
    if interface is not None:  # the workers' gloo pairs and nccl's bootstrap sockets, unless the user chose
        for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            os.environ.setdefault(variable, interface)
    patch_torch_stores(bind)
    from torch.distributed.run import main as torchrun_main

    sys.argv = ["torchrun", *torchrun_args]
    try:
        torchrun_main(torchrun_args)
    finally:
        if os.getppid() != parent_pid:  # the launcher died: nobody else removes what torchrun wrote last
            remove_run_temp_dir(os.environ.get("TMPDIR"))


if __name__ == "__main__":
    main()
