"""Your own CNN and training loop on an ImageFolder, measured by ddlscope's recorder, then a report.

The loop is ordinary PyTorch (a small ImageFolder reader with Pillow, a CNN, SGD); the recorder's lines
time each step's phases (``rec.batches`` the data loading, ``rec.phase`` forward, backward and optimizer),
sample CPU and memory in the background, store a held-out evaluation per epoch, and end the run
``completed`` (or ``failed`` with the error). ``ddlscope.report`` then writes the same report as
``ddlscope report``: the step breakdown, the bottleneck verdict, accuracy and loss curves.

    ddlscope examples --copy examples                              # the shipped examples, to a folder to edit
    python examples/own_loop_imagefolder.py                       # the bundled digits as an ImageFolder
    python examples/own_loop_imagefolder.py --data /path/to/imagefolder --epochs 3

``--data`` is a folder with ``train/<class>/*.png|jpg`` and ``test/<class>/...`` (or ``val/``); without it
the real handwritten digits bundled with scikit-learn are written as such a folder (28x28 PNGs) under
``$DDLSCOPE_DATA`` (default ``~/.cache/ddlscope/data``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn
from torch.utils.data import DataLoader, Dataset

import ddlscope


class ImageFolder(Dataset):
    """``root/<split>/<class>/<image>`` as ``(float (C, H, W) in 0..1, class index)``, classes sorted by name."""

    def __init__(self, root: Path, split: str, channels: int = 1):
        folder = root / split if (root / split).is_dir() else root / "val"
        self.classes = sorted(d.name for d in folder.iterdir() if d.is_dir())
        self.samples = [(path, label) for label, name in enumerate(self.classes)
                        for path in sorted((folder / name).iterdir()) if path.suffix.lower() in (".png", ".jpg", ".jpeg")]
        self.mode = "L" if channels == 1 else "RGB"

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        path, label = self.samples[i]
        with Image.open(path) as image:
            array = np.asarray(image.convert(self.mode), dtype=np.float32) / 255.0
        x = torch.from_numpy(array)
        return (x.unsqueeze(0) if x.dim() == 2 else x.permute(2, 0, 1)), label


class UserCNN(nn.Module):
    def __init__(self, in_channels: int, num_classes: int):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(in_channels, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4))
        self.head = nn.Linear(32 * 4 * 4, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader) -> tuple[float, float, int]:
    """Held-out (accuracy, mean loss, samples)."""
    model.eval()
    correct, loss_sum, seen = 0, 0.0, 0
    for x, y in loader:
        logits = model(x)
        loss_sum += F.cross_entropy(logits, y, reduction="sum").item()
        correct += int((logits.argmax(1) == y).sum())
        seen += len(y)
    model.train()
    return correct / seen, loss_sum / seen, seen


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, help="ImageFolder root (default: the digits, written on first use)")
    parser.add_argument("--db", type=Path, default=None, help="results store (default ./ddlscope-results/ddlscope.db)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=None, help="stop each epoch after this many steps")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--loader-workers", type=int, default=0)
    parser.add_argument("--name", default="own-loop-imagefolder")
    args = parser.parse_args(argv)

    root = args.data
    if root is None:
        from ddlscope.workloads.datasets import default_data_root, materialize_digits

        root = materialize_digits(default_data_root())
    train, test = ImageFolder(root, "train"), ImageFolder(root, "test")
    loader = DataLoader(train, batch_size=args.batch_size, shuffle=True, drop_last=True, num_workers=args.loader_workers)
    test_loader = DataLoader(test, batch_size=256)
    torch.manual_seed(0)
    model = UserCNN(1, len(train.classes))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)

    with ddlscope.record(args.name, db=args.db, model="UserCNN", dataset=str(root)) as rec:
        for _ in range(args.epochs):
            for i, (x, y) in enumerate(rec.batches(loader)):
                with rec.step(len(x)) as st:
                    with rec.phase("forward"):
                        logits = model(x)
                        loss = F.cross_entropy(logits, y)
                    with rec.phase("backward"):
                        optimizer.zero_grad()
                        loss.backward()
                    with rec.phase("optimizer"):
                        optimizer.step()
                    st.loss, st.accuracy = loss, float((logits.argmax(1) == y).float().mean())
                if args.max_steps is not None and i + 1 >= args.max_steps:
                    break
            with rec.evaluation() as ev:
                ev.record(*evaluate(model, test_loader))
    report = ddlscope.report(rec.run_id, db=rec.db_path)
    print(f"report: {report}")
    return report


if __name__ == "__main__":
    main()
