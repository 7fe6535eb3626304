"""End what a command started once the command has died (``python -m ddlscope.launch.reaper``).

The commands that run hivemind in their own process rather than under a launcher (``ddlscope
peer``, ``serve-experts`` and ``bootstrap``) fork hivemind's DHT process, which starts the p2pd
daemon, and may fork DataLoader workers. On a normal exit or a signal they can catch, the
commands end these themselves (:func:`ddlscope.launch.processes.end_children`). A SIGKILL (or
the OOM killer) gives them no chance: the DHT process and p2pd would run on, reparented to init,
holding ports and memory.

So these commands start a reaper first (:func:`ddlscope.launch.processes.reap_when_gone`). The
reaper runs in a session of its own, so that a Ctrl-C to the command's terminal does not reach
it. Every :data:`POLL_S` it notes the command's descendants. Once the command is gone, it ends
what is left: the noted descendants that still run, their own descendants, and, when the command
led its process group (a shell job), the orphans in that group born after the command (forked
between two notes). They get SIGTERM, then SIGKILL after :data:`GRACE_S`. torch's shared-memory
manager is left to end by itself once its clients are gone (it unlinks their segments in
``/dev/shm``). A killed p2pd cannot remove its Unix socket file, nor the DHT process its
client's: the reaper removes both (:func:`hivemind_socket_files`).
"""

from __future__ import annotations

import argparse
import os
import stat
import sys
import time
from pathlib import Path

import psutil

from ddlscope.launch.processes import is_shm_manager, process_gone

POLL_S = 0.2
"""Seconds between two notes of the command's descendants (and checks that it is alive)."""
GRACE_S = 3.0
"""Seconds the leftovers get after SIGTERM before SIGKILL."""


def note_descendants(owner_pid: int, noted: dict[int, float]) -> None:
    """Add the current descendants of ``owner_pid`` to ``noted`` (pid -> start time); none once it is gone."""
    try:
        children = psutil.Process(owner_pid).children(recursive=True)
    except psutil.Error:
        return
    for child in children:
        try:
            noted.setdefault(child.pid, child.create_time())
        except psutil.Error:
            continue


def leftovers(owner_pid: int, owner_started_at: float, owner_pgid: int, owner_ppid: int,
              noted: dict[int, float]) -> list[psutil.Process]:
    """The processes a dead command left: its noted descendants still running, their descendants, and (when
    the command led its process group) the orphans in that group born after it; torch's shm manager and
    this process excepted. A process of the group whose parent is the command's parent (another command
    of a shell pipeline, say ``tee``) is not the command's and is left alone.

    Args:
        owner_pid: the command's pid.
        owner_started_at: its start time (``psutil.Process.create_time``, s since the epoch).
        owner_pgid: its process group.
        owner_ppid: its parent's pid (the shell) while it lived.
        noted: its descendants noted while it lived (pid -> start time).
    """
    found: dict[int, psutil.Process] = {}
    for pid, started_at in noted.items():
        if not process_gone(pid, started_at):
            try:
                found[pid] = psutil.Process(pid)
            except psutil.Error:
                continue
    if owner_pgid == owner_pid:
        for proc in psutil.process_iter():
            try:
                if (os.getpgid(proc.pid) == owner_pgid and proc.create_time() >= owner_started_at
                        and proc.ppid() != owner_ppid and proc.status() != psutil.STATUS_ZOMBIE):
                    found.setdefault(proc.pid, proc)
            except (psutil.Error, OSError):
                continue
    for proc in list(found.values()):
        try:
            for child in proc.children(recursive=True):
                found.setdefault(child.pid, child)
        except psutil.Error:
            continue
    return [p for pid, p in found.items() if pid != os.getpid() and not is_shm_manager(pid)]


def hivemind_socket_files(procs: list[psutil.Process]) -> list[Path]:
    """The Unix socket files of the p2pd daemons among ``procs``: each daemon's own (its
    ``-listen=/unix/<path>`` argument, ``.../hivemind-p2pd-<id>.sock``) and its client's beside it
    (``.../hivemind-p2pclient-<id>.sock``, hivemind 1.1.12's names). Read them before the processes
    end; a process that is gone or unreadable gives none."""
    files = []
    for proc in procs:
        try:
            args = proc.cmdline()
        except psutil.Error:
            continue
        for arg in args:
            if arg.startswith("-listen=/unix/"):
                daemon = Path(arg[len("-listen=/unix"):])
                files.append(daemon)
                if daemon.name.startswith("hivemind-p2pd-"):
                    files.append(daemon.with_name(daemon.name.replace("hivemind-p2pd-", "hivemind-p2pclient-", 1)))
    return files


def remove_sockets(files: list[Path]) -> int:
    """Remove those of ``files`` that are Unix sockets (anything else is left alone); return how many."""
    removed = 0
    for file in files:
        try:
            if stat.S_ISSOCK(file.lstat().st_mode):
                file.unlink()
                removed += 1
        except OSError:
            continue
    return removed


def end(procs: list[psutil.Process], grace_s: float = GRACE_S) -> int:
    """SIGTERM ``procs``, SIGKILL those still running after ``grace_s``; return how many there were."""
    for proc in procs:
        try:
            proc.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=grace_s)
    return len(procs)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m ddlscope.launch.reaper")
    p.add_argument("--owner-pid", type=int, required=True)
    p.add_argument("--owner-started-at", type=float, required=True, help="the owner's start time (s since the epoch)")
    p.add_argument("--owner-pgid", type=int, required=True)
    p.add_argument("--owner-ppid", type=int, required=True)
    args = p.parse_args(argv)
    noted: dict[int, float] = {}
    while not process_gone(args.owner_pid, args.owner_started_at):
        note_descendants(args.owner_pid, noted)
        time.sleep(POLL_S)
    left = leftovers(args.owner_pid, args.owner_started_at, args.owner_pgid, args.owner_ppid, noted)
    if left:
        print(f"ddlscope: process {args.owner_pid} ended without ending what it started; ending the "
              f"{len(left)} processes it left ({', '.join(sorted(_names(left)))})", file=sys.stderr)
        sockets = hivemind_socket_files(left)
        end(left)
        remove_sockets(sockets)


def _names(procs: list[psutil.Process]) -> set[str]:
    names = set()
    for proc in procs:
        try:
            names.add(proc.name())
        except psutil.Error:
            continue
    return names


if __name__ == "__main__":
    main()
