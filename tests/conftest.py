"""Shared fixtures: a private data root with small real/synthetic data, and a results database."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

can_emulate = (sys.platform.startswith("linux") and os.geteuid() == 0 and shutil.which("tc") is not None
               and subprocess.run(["ip", "netns", "list"], capture_output=True).returncode == 0)
"""Whether this machine can run emulated networks (root, iproute2's ``ip netns`` and ``tc``)."""


@pytest.fixture(scope="session", autouse=True)
def children_temp_dir():
    """A temporary folder for every process the suite starts (their ``TMPDIR``), removed when the session ends.

    A child that is killed, or ends with ``os._exit`` as ddlscope's workers do, cannot remove what
    it made in the temporary folder (multiprocessing's ``pymp-*``, torchelastic's folders, and
    hivemind's socket files, which ddlscope routes into a ``ddlscope-run-*`` ``TMPDIR``); the
    launcher removes a run's own folder, but the suite also starts workers, calibrations and
    commands directly. The pytest process itself keeps the system's folder (read first, so that
    ``tmp_path`` and the Unix socket paths made under it stay short).
    """
    from ddlscope.launch.processes import make_run_temp_dir, remove_run_temp_dir

    tempfile.gettempdir()  # this process's own: cached before TMPDIR changes
    folder, before = make_run_temp_dir(), os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(folder)
    yield folder
    if before is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = before
    remove_run_temp_dir(folder)


@pytest.fixture(scope="session")
def data_root(tmp_path_factory) -> Path:
    """A data root holding the materialized digits (real data) and a tiny synthetic MNIST."""
    from ddlscope.workloads.datasets import materialize_digits, write_synthetic

    root = tmp_path_factory.mktemp("data")
    materialize_digits(root)
    write_synthetic("mnist", root, train_size=512, test_size=128, seed=0)
    return root


@pytest.fixture
def env_data(data_root, monkeypatch) -> Path:
    """Point ddlscope (and worker processes it starts) at the test data root."""
    monkeypatch.setenv("DDLSCOPE_DATA", str(data_root))
    return data_root


@pytest.fixture
def db_path(tmp_path) -> Path:
    return tmp_path / "results" / "ddlscope.db"


def tiny_run(**overrides) -> dict:
    """Values of a tiny, fast run config (tiny CNN, synthetic MNIST, 1 loader worker)."""
    values = dict(model="tiny_cnn", dataset="mnist", batch_size=16, sample_budget=320, loader_workers=0,
                  warmup_steps=1, host_sample_interval_s=0.2)
    values.update(overrides)
    return values


def bare_peer(worker_index: int, local_epoch: int, events: list) -> "object":
    """A ``CollaborativeStrategy`` with only what recording events needs, no swarm: its store appends
    ``(run_id, worker, kind, fields)`` to ``events``; its run is ``"r"``, hivemind's optimizer at ``local_epoch``."""
    from types import SimpleNamespace

    from ddlscope.strategies.collaborative import CollaborativeStrategy, LeaveRequest

    peer = object.__new__(CollaborativeStrategy)
    peer.hm_opt = SimpleNamespace(local_epoch=local_epoch)
    peer._leave = LeaveRequest()  # not asked to leave; its signal handler is not installed
    peer.ctx = SimpleNamespace(worker_index=worker_index, run_id="r", store=SimpleNamespace(
        add_event=lambda run_id, worker, kind, **fields: events.append((run_id, worker, kind, fields))))
    return peer


def stored_swarm_run(store, peers: int = 3, steps: int = 4, step=None, collaborative=None) -> str:
    """A collaborative run in ``store`` (a ``ResultsStore``): batch 32, target batch 64, matchmaking 1 s
    (``collaborative`` adds to or replaces those settings), ``steps`` one-second steps of each of ``peers``
    peers, every other one an averaging round; ``step(t, peer)`` gives fields that replace or add to step
    ``t``'s. Returns its run id."""
    config = {"strategy": "collaborative", "batch_size": 32,
              "collaborative": {"target_batch_size": 64, "matchmaking_time_s": 1.0, **(collaborative or {})}}
    run_id = store.create_run("swarm", "collaborative", config)
    for t in range(steps):
        for peer in range(peers):
            store.add_step(run_id, peer, {**dict(step=t, wall_time=1e6 + t, samples=32, step_s=1.0, warmup=0,
                                                 optimizer_stepped=1, averaging_round=t % 2),
                                          **(step(t, peer) if step else {})})
    return run_id
