"""Pre-flight checks of the device, before anything starts: workers beyond the visible GPUs, nccl
without CUDA, a device that is not there. Run on CPU: torch's view of CUDA is monkeypatched."""

from __future__ import annotations

import sys

import pytest
import torch

from ddlscope import cli
from ddlscope.config import check_device, check_runnable, validate_config
from ddlscope.errors import UserError


def _gpus(monkeypatch, count: int, visible: str | None = "0") -> None:
    """Make torch see ``count`` CUDA GPUs (none: CUDA unavailable), with CUDA_VISIBLE_DEVICES = ``visible``."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)


def _cfg(nnodes: int = 1, **values):
    return validate_config({"model": "tiny_cnn", "dataset": "digits", **values}, nnodes)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "gpipe"])
def test_more_torchrun_workers_than_visible_gpus(monkeypatch, strategy):
    _gpus(monkeypatch, 1, "3")
    with pytest.raises(UserError) as err:
        check_runnable(_cfg(strategy=strategy, peers=2, device="cuda"))
    assert str(err.value).startswith(f"{strategy} with peers = 2 on device cuda needs 2 GPUs on this host")
    assert "torch sees 1 GPU (CUDA_VISIBLE_DEVICES=3)" in str(err.value)


def test_local_workers_count_not_all_peers(monkeypatch):
    _gpus(monkeypatch, 1)
    check_device("cuda", 1)
    with pytest.raises(UserError, match=r"ddp with 2 of its peers = 4 on this host on device cuda needs 2 GPUs on this host \(one per worker\); torch sees 1 GPU"):
        check_runnable(_cfg(2, strategy="ddp", peers=4, vcpus_per_peer=1, device="cuda"), local_workers=2)


def test_collaborative_peers_share_a_gpu(monkeypatch):
    _gpus(monkeypatch, 1)
    check_runnable(_cfg(strategy="collaborative", peers=2, vcpus_per_peer=1, device="cuda"))  # no error


@pytest.mark.parametrize("device, gpus, must", [
    ("cuda", 0, "needs CUDA, but torch sees no CUDA GPU (CUDA_VISIBLE_DEVICES=unset)"),
    ("cuda:3", 1, "there is no cuda:3, torch sees 1 GPU (CUDA_VISIBLE_DEVICES=unset); allowed: cuda:0..cuda:0"),
    ("cuda:1", 2, None),
    ("gpu", 1, "unknown device 'gpu'; allowed: cpu, cuda, cuda:N"),
    ("cuda:x", 1, "unknown device 'cuda:x'"),
    ("cpu:0", 1, "unknown device 'cpu:0'"),
])
def test_a_device_that_is_not_there(monkeypatch, device, gpus, must):
    _gpus(monkeypatch, gpus, None)
    if must is None:
        check_device(device)
        return
    with pytest.raises(UserError) as err:
        check_device(device)
    assert must in str(err.value)


def test_cuda_in_a_torch_built_without_it(monkeypatch):
    _gpus(monkeypatch, 0)
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(UserError, match="this torch is built without CUDA"):
        check_device("cuda")


def test_mps_absent(monkeypatch):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(UserError, match="torch sees no MPS"):
        check_device("mps")


def test_nccl_without_cuda_is_refused_by_the_config():
    with pytest.raises(UserError) as err:
        _cfg(strategy="ddp", peers=2, device="cpu", distributed={"backend": "nccl"})
    assert 'distributed.backend = "nccl" with device = "cpu"' in str(err.value)
    _cfg(strategy="collaborative", peers=2, device="cpu", distributed={"backend": "nccl"})  # not a torchrun model: unused


def test_nccl_missing_from_torch(monkeypatch):
    import torch.distributed as dist

    _gpus(monkeypatch, 2)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    with pytest.raises(UserError, match='backend = "nccl", but this torch has no NCCL'):
        check_runnable(_cfg(strategy="ddp", peers=2, device="cuda", distributed={"backend": "nccl"}))


def test_the_cli_says_it_in_one_line_before_anything_starts(monkeypatch, tmp_path, capsys):
    _gpus(monkeypatch, 1, "0")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["ddlscope", "run", "--set", "model='tiny_cnn'", "--set", "strategy='ddp'",
                                      "--set", "peers=2", "--set", "vcpus_per_peer=1", "--set", "device='cuda'"])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(lines) == 1, lines
    assert lines[0] == ("error: ddp with peers = 2 on device cuda needs 2 GPUs on this host (one per worker); torch sees "
                        "1 GPU (CUDA_VISIBLE_DEVICES=0); allowed: at most 1 workers on this host (fewer peers, "
                        "--local-peers, or more nodes)")
    assert list(tmp_path.iterdir()) == []  # no store, no run
