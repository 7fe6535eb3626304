"""Factories that tests/test_api.py hands to ``ddlscope.run`` as callables (importable by the workers)."""

from __future__ import annotations

import torch
from torch import nn

SIZE = (12, 10)
"""Height and width of :class:`Blobs` images (not a built-in family's geometry)."""


class SmallCNN(nn.Module):
    """A CNN whose classifier is sized from the image size it is given."""

    def __init__(self, num_classes: int, in_channels: int, image_size: tuple[int, int]):
        super().__init__()
        height, width = image_size
        self.conv = nn.Conv2d(in_channels, 4, 3, padding=1)
        self.fc = nn.Linear(4 * (height // 2) * (width // 2), num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.nn.functional.max_pool2d(torch.relu(self.conv(x)), 2).flatten(1))


class Blobs(torch.utils.data.Dataset):
    """Three-channel images whose mean is their class (4 classes), 128 per split, preprocessed already."""

    num_classes = 4

    def __init__(self, split: str):
        gen = torch.Generator().manual_seed(0 if split == "train" else 1)
        self.labels = torch.randint(0, self.num_classes, (128,), generator=gen)
        self.images = torch.randn(128, 3, *SIZE, generator=gen) + self.labels.view(-1, 1, 1, 1).float()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return self.images[i], int(self.labels[i])


def smoothed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits, labels, label_smoothing=0.1)


class FailsInWorker(nn.Module):
    """Builds and runs its first forward (the pre-run check), fails at the worker's third training forward."""

    def __init__(self, num_classes: int, in_channels: int):
        super().__init__()
        self.fc = nn.Linear(in_channels * 28 * 28, num_classes)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls >= 3:
            raise RuntimeError(f"broke at forward {self.calls}")
        return self.fc(x.flatten(1))
