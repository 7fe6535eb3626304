"""Remove an emulated network once the process that owns it has died (``python -m ddlscope.network.reaper``).

:class:`ddlscope.network.emulated.EmulatedNetwork` starts one reaper per network, in a session of
its own so that no signal meant for the run reaches it. It checks every 0.2 s whether the owner
(the same process: pid and start time) is alive; when the owner is gone without removing the
network (SIGKILL, OOM kill) it ends what runs in the namespaces (SIGTERM, then SIGKILL after
:data:`GRACE_S`) and removes them and the bridge.
The owner kills the reaper when it removes the network itself.
"""

from __future__ import annotations

import argparse
import time

import psutil

from ddlscope.launch.processes import process_gone
from ddlscope.network.emulated import remove_network

POLL_S = 0.2
GRACE_S = 5.0
"""Seconds the processes in the namespaces get after SIGTERM (to record why they stop) before SIGKILL."""


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m ddlscope.network.reaper")
    p.add_argument("--owner-pid", type=int, required=True)
    p.add_argument("--peers", type=int, required=True)
    args = p.parse_args(argv)
    try:
        started_at = psutil.Process(args.owner_pid).create_time()
    except psutil.NoSuchProcess:
        started_at = float("nan")  # the owner died before this started: remove at once
    while not process_gone(args.owner_pid, started_at):
        time.sleep(POLL_S)
    remove_network(f"{args.owner_pid:x}", args.peers, grace_s=GRACE_S)


if __name__ == "__main__":
    main()
