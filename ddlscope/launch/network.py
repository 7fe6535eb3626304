"""Where a run's processes listen: loopback for a local run, and what to ask for to go further.

Used by the torchrun agent (:mod:`ddlscope.launch.agent`) and by every place that creates a
``hivemind.DHT`` (collaborative peers, dmoe expert servers and trainers, the calibration swarms):
:func:`p2p_options` turns hivemind's network discovery off unless a run asks for it. What
listens where is documented in docs/network.md.
"""

from __future__ import annotations

import ipaddress
import socket

LOOPBACK = "127.0.0.1"


def is_loopback(host: str) -> bool:
    """True when ``host`` (an IP address or a name) is, or resolves only to, loopback addresses."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)



def check_nat_traversal(nat_traversal: bool, listen_host: str) -> None:
    """A swarm model's ``nat_traversal`` needs a ``listen_host`` other peers can reach.

    Raises:
        ValueError: ``nat_traversal`` with a loopback ``listen_host`` (the message says what is allowed).
    """
    if nat_traversal and is_loopback(listen_host):
        raise ValueError(f"nat_traversal = true needs a listen_host other peers can reach, not "
                         f"{listen_host!r}; allowed: e.g. listen_host = \"0.0.0.0\", or nat_traversal = false")


def p2p_options(nat_traversal: bool = False) -> dict[str, bool]:
    """Keyword arguments of ``hivemind.DHT`` (passed on to ``hivemind.P2P.create``) for its p2pd daemon.

    hivemind's defaults make p2pd look for NATs (UPnP/NAT-PMP port mapping, which opens a UDP
    socket on every interface; the AutoNAT service) and act as a circuit relay, which a swarm on one
    machine or one private network has no use for. ``nat_traversal=False`` turns all of that off:
    p2pd then only listens on the TCP ``host_maddrs``. ``True`` keeps hivemind's defaults (a swarm
    of peers behind NATs on public networks: the models' ``nat_traversal`` option).
    """
    if nat_traversal:
        return dict(nat_port_map=True, auto_nat=True, use_relay=True)
    return dict(nat_port_map=False, auto_nat=False, use_relay=False, use_auto_relay=False)
