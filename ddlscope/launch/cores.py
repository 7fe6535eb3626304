"""Core leases: concurrent runs on one machine pin themselves to different cores, or say they cannot.

A run pins each worker to its own cores (:meth:`ddlscope.config.RunConfigBase.core_sets`). Without
a lease two runs started side by side would both take cores 0, 1, ... and measure each other. So
the launcher takes a lease first, :func:`lease_cores`: one lock file per core in a machine-wide
folder (:func:`lease_dir`: ``$DDLSCOPE_LEASE_DIR``, default ``/tmp/ddlscope-<uid>/cores``), each
held with an exclusive ``flock`` for as long as the launcher lives. A second run gets the cores
no one holds, if its workers fit on them, else one clear error line naming the run and pid that
hold them, before it creates anything. The kernel drops a lock when its holder's process ends,
however it ends, so a dead run's cores are free again at once (no stale lease to clean up).

Sharing instead: ``DDLSCOPE_SHARE_CORES=1`` (or ``share=True``) takes no lease and pins as if the
run were alone; both runs' measurements then include the other's load.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING

from ddlscope.errors import UserError

if TYPE_CHECKING:
    from ddlscope.config import RunConfig

SHARE_ENV = "DDLSCOPE_SHARE_CORES"
DIR_ENV = "DDLSCOPE_LEASE_DIR"


def lease_dir() -> Path:
    """The folder of the per-core lock files: ``$DDLSCOPE_LEASE_DIR`` or ``/tmp/ddlscope-<uid>/cores``.

    Not under ``$TMPDIR``: runs started with different temporary folders (each run's processes get
    a private one) must still see each other's leases."""
    return Path(os.environ.get(DIR_ENV) or Path("/tmp") / f"ddlscope-{os.getuid()}" / "cores")


@dataclass
class CoreLease:
    """The cores one run holds, and its workers' core sets on them.

    Attributes:
        core_sets: one list of core ids per worker on this host (what ``RunConfig.core_sets`` gives).
        shared: True when no lease was taken (sharing asked for).
    """

    core_sets: list[list[int]]
    shared: bool = False
    _files: dict[int, IO[str]] = field(default_factory=dict, repr=False)

    @property
    def cores(self) -> list[int]:
        """The leased core ids, sorted (empty when shared)."""
        return sorted(self._files)

    def name_run(self, run_id: str) -> None:
        """Record the run id in the lease (once the run row exists), for the error other runs print."""
        for f in self._files.values():
            _write_owner(f, run_id)

    def release(self) -> None:
        """Give the cores back (also happens when this process ends)."""
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self) -> "CoreLease":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def lease_cores(cfg: "RunConfig", run_label: str, local_workers: int | None = None, cores: list[int] | None = None,
                share: bool | None = None, folder: Path | None = None) -> CoreLease:
    """Take the cores this run's workers pin to, among those no other run holds.

    With ``vcpus_per_peer`` set each worker gets that many free cores; unset, the workers share
    the free cores equally (as ``RunConfig.core_sets`` does with all of them).

    Args:
        cfg: the validated run config.
        run_label: names the run in other runs' error lines until :meth:`CoreLease.name_run`.
        local_workers: workers started on this host (default ``cfg.peers``).
        cores: the cores ddlscope may use (default: this process's affinity).
        share: take no lease (default: ``$DDLSCOPE_SHARE_CORES`` is 1/true/yes).
        folder: the lock files' folder (default :func:`lease_dir`).

    Returns:
        The lease; keep it until the run's processes are gone, then :meth:`CoreLease.release`.

    Raises:
        UserError: the workers do not fit on the free cores (names the holders), or not on this
            machine's cores at all (``RunConfig.core_sets``'s error).
    """
    from ddlscope.config import available_cores

    cores = sorted(cores if cores is not None else available_cores())
    n = local_workers or cfg.peers
    if share is None:
        share = os.environ.get(SHARE_ENV, "").strip().lower() in ("1", "true", "yes")
    if share:
        return CoreLease(cfg.core_sets(cores=cores, local_workers=n), shared=True)
    cfg.core_sets(cores=cores, local_workers=n)  # fits on the machine at all? (else its own error)
    folder = Path(folder) if folder is not None else lease_dir()
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    with open(folder / "leases.lock", "a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # one launcher at a time picks and locks its cores
        held, owners = {}, {}
        for core in cores:
            f = open(folder / f"core-{core}.lock", "a+")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held[core] = f
            except BlockingIOError:
                owners[core] = _read_owner(f)
                f.close()
        free = sorted(held)
        per_peer = cfg.vcpus_per_peer or (len(free) // n)
        fits = per_peer >= 1 and per_peer * n <= len(free)
        shares = cfg.share_cores and 0 < (cfg.vcpus_per_peer or 1) <= len(free)  # peers share the free cores
        if fits or shares:
            sets = cfg.core_sets(cores=free, local_workers=n)
            keep = {c for s in sets for c in s}
            for core in free:
                if core not in keep:
                    held.pop(core).close()
            for f in held.values():
                _write_owner(f, run_label)
            return CoreLease(sets, _files=held)
        for f in held.values():
            f.close()
    need = f"{cfg.vcpus_per_peer} x {n}" if cfg.vcpus_per_peer else f"at least 1 x {n}"
    raise UserError(f"{_describe(owners)}; this run needs {need} free cores and {len(free)} are free "
                    f"({_ranges(free) or 'none'}); wait for them to end, lower vcpus_per_peer or peers, "
                    f"or set {SHARE_ENV}=1 to share cores (each run then measures the other's load too)")


def _write_owner(f: IO[str], run: str) -> None:
    f.seek(0)
    f.truncate()
    f.write(json.dumps({"run": run, "pid": os.getpid(), "since": time.time()}))
    f.flush()


def _read_owner(f: IO[str]) -> dict:
    f.seek(0)
    try:
        return json.loads(f.read() or "{}")
    except ValueError:
        return {}


def _describe(owners: dict[int, dict]) -> str:
    """``cores 0-1 are used by run abc (pid 12)`` for each holder."""
    by_holder: dict[tuple, list[int]] = {}
    for core, o in owners.items():
        by_holder.setdefault((o.get("run", "?"), o.get("pid", "?")), []).append(core)
    parts = [f"core{'s' if len(cs) > 1 else ''} {_ranges(cs)} {'are' if len(cs) > 1 else 'is'} used by run {run} "
             f"(pid {pid})" for (run, pid), cs in by_holder.items()]
    return "; ".join(parts) or "no core is free"


def _ranges(cores: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    ordered, out, start = sorted(cores), [], None
    for i, c in enumerate(ordered):
        if start is None:
            start = c
        if i + 1 == len(ordered) or ordered[i + 1] != c + 1:
            out.append(f"{start}-{c}" if c != start else f"{c}")
            start = None
    return ",".join(out)
