"""A plain PyTorch DDP training script, measured by ddlscope with the 5 lines marked ``# +ddlscope``.

Without those lines this is an ordinary torchrun script: scikit-learn's handwritten digits (8x8, real
data), a small CNN wrapped in DistributedDataParallel, SGD, gloo on CPU (nccl on GPUs). With them every
rank records its steps (data loading, forward, backward, communication wait, optimizer), its DDP
all-reduces (a timed communication hook), host metrics and its status into one run of the results store:

    ddlscope examples --copy examples                              # the shipped examples, to a folder to edit
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 examples/torchrun_instrumented.py --steps 40
    ddlscope report            # the newest run: step breakdown, bottleneck verdict, plots

Options: ``--db`` (results store, default ./ddlscope-results/ddlscope.db), ``--steps`` (per rank),
``--batch-size`` (per rank), ``--name`` (the run's label).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ddlscope  # +ddlscope


def digits() -> TensorDataset:
    """The 1,797 8x8 digit images as ``(N, 1, 8, 8)`` floats in 0..1 with labels 0..9."""
    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    return TensorDataset(images, torch.tensor(data.target))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 16, 3, padding=1)
        self.fc = nn.Linear(16 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv(x)), 2)
        return self.fc(x.flatten(1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--db", default=None, help="results store (default ./ddlscope-results/ddlscope.db)")
    parser.add_argument("--name", default="torchrun-ddp-digits")
    parser.add_argument("--steps", type=int, default=40, help="training steps per rank")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank per step")
    args = parser.parse_args()

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    torch.manual_seed(0)
    dataset = digits()
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    model = DistributedDataParallel(Net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    rec = ddlscope.record(args.name, db=args.db, model="Net", dataset="sklearn-digits")  # +ddlscope
    rec.watch(model, optimizer)  # +ddlscope
    step, epoch = 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            rec.note(loss=loss)  # +ddlscope
            step += 1
            if step == args.steps:
                break
        epoch += 1
    rec.finish()  # +ddlscope
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
