"""Core leases: two runs on one machine get different cores, or the second says who holds them.

The other run is a real second process holding a lease (``python -c``), so the locks are the
kernel's between processes, and its SIGKILL frees its cores at once.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ddlscope.config import validate_config
from ddlscope.errors import UserError
from ddlscope.launch.cores import _ranges, lease_cores
from tests.conftest import tiny_run

CORES = [0, 1, 2, 3]  # lock files only: the ids need not exist on this machine


@pytest.fixture(autouse=True)
def four_cores(monkeypatch):
    """Configs are checked against the machine's cores: make it four here (and in the holders)."""
    import ddlscope.config

    monkeypatch.setattr(ddlscope.config, "available_cores", lambda: list(CORES))


def _holder(folder: Path, peers: int, vcpus: int | None, label: str = "first") -> subprocess.Popen:
    """A second process that leases cores for a run of ``peers`` x ``vcpus`` and holds them until killed."""
    code = textwrap.dedent(f"""
        import sys, time
        import ddlscope.config
        from ddlscope.config import validate_config
        from ddlscope.launch.cores import lease_cores
        ddlscope.config.available_cores = lambda: {CORES!r}
        cfg = validate_config(dict(model="tiny_cnn", dataset="mnist", strategy="ddp", peers={peers}, vcpus_per_peer={vcpus!r}))
        lease = lease_cores(cfg, {label!r}, cores={CORES!r}, share=False, folder={str(folder)!r})
        print(",".join(map(str, lease.cores)), flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().strip()
    assert line, "the holder did not take its lease"
    proc.leased = [int(c) for c in line.split(",")]
    return proc


def _end(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(10)
    proc.stdout.close()


def _cfg(peers: int, vcpus: int | None):
    return validate_config(tiny_run(strategy="ddp", peers=peers, vcpus_per_peer=vcpus))


def test_second_run_gets_the_free_cores(tmp_path):
    first = _holder(tmp_path, peers=2, vcpus=1)
    try:
        assert first.leased == [0, 1]
        with lease_cores(_cfg(2, 1), "second", cores=CORES, share=False, folder=tmp_path) as lease:
            assert lease.core_sets == [[2], [3]] and lease.cores == [2, 3]
    finally:
        _end(first)


def test_second_run_that_does_not_fit_names_the_holder_and_takes_nothing(tmp_path):
    first = _holder(tmp_path, peers=3, vcpus=1)
    try:
        with pytest.raises(UserError) as err:
            lease_cores(_cfg(2, 1), "second", cores=CORES, share=False, folder=tmp_path)
        msg = str(err.value)
        assert f"cores 0-2 are used by run first (pid {first.pid})" in msg and "1 are free (3)" in msg, msg
        assert "\n" not in msg and "DDLSCOPE_SHARE_CORES=1" in msg
        # it took nothing: a run that fits the one free core still gets it
        with lease_cores(_cfg(1, 1), "third", cores=CORES, share=False, folder=tmp_path) as lease:
            assert lease.core_sets == [[3]]
    finally:
        _end(first)


def test_a_killed_run_frees_its_cores(tmp_path):
    first = _holder(tmp_path, peers=2, vcpus=2)
    assert first.leased == CORES
    with pytest.raises(UserError):
        lease_cores(_cfg(1, 1), "second", cores=CORES, share=False, folder=tmp_path)
    _end(first)  # SIGKILL: no chance to release anything
    with lease_cores(_cfg(2, 2), "second", cores=CORES, share=False, folder=tmp_path) as lease:
        assert lease.core_sets == [[0, 1], [2, 3]]


def test_default_share_splits_the_free_cores(tmp_path):
    first = _holder(tmp_path, peers=1, vcpus=1)
    try:
        with lease_cores(_cfg(2, None), "second", cores=CORES, share=False, folder=tmp_path) as lease:
            assert lease.core_sets == [[1], [2]], "3 free cores for 2 workers: one each"
    finally:
        _end(first)


def test_released_lease_and_named_run(tmp_path):
    lease = lease_cores(_cfg(2, 1), "label", cores=CORES, share=False, folder=tmp_path)
    lease.name_run("run123")
    with pytest.raises(UserError, match=r"cores 0-1 are used by run run123 \(pid %d\)" % os.getpid()):
        # a lease in the same process is a second open file: flock refuses it too
        lease_cores(_cfg(2, 2), "other", cores=CORES, share=False, folder=tmp_path)
    lease.release()
    with lease_cores(_cfg(2, 2), "other", cores=CORES, share=False, folder=tmp_path) as again:
        assert again.cores == CORES


def test_sharing_takes_no_lease(tmp_path, monkeypatch):
    first = _holder(tmp_path, peers=2, vcpus=2)
    try:
        monkeypatch.setenv("DDLSCOPE_SHARE_CORES", "1")
        lease = lease_cores(_cfg(2, 1), "second", cores=CORES, folder=tmp_path)
        assert lease.shared and lease.core_sets == [[0], [1]] and lease.cores == []
    finally:
        _end(first)


def test_a_run_larger_than_the_machine_gets_the_machine_error(tmp_path):
    with pytest.raises(UserError, match="allowed: workers x vcpus_per_peer <= 4"):
        lease_cores(_cfg(5, 1), "big", cores=CORES, share=False, folder=tmp_path)


def test_ranges():
    assert _ranges([5, 0, 1, 2]) == "0-2,5" and _ranges([3]) == "3" and _ranges([]) == ""
