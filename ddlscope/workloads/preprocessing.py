"""Image transforms in pure torch (no torchvision) for uint8 ``(C, H, W)`` image tensors.

The transforms are small picklable classes, so they travel to DataLoader worker processes
(fork or spawn). Random choices use the global torch generator (``torch.randint`` /
``torch.rand``), which the DataLoader seeds differently in every worker.

Typical use::

    dataset, spec = open_dataset("cifar10", root, "train", transform=train_transform(spec))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from ddlscope.workloads.datasets import TEXT, DatasetSpec

# Per-channel mean and standard deviation of the pixel values scaled to [0, 1], by model family.
_IMAGENET_STATS = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
NORMALIZATION_STATS: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "mnist": ((0.1307,), (0.3081,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "imagenet": _IMAGENET_STATS,
    "highres": _IMAGENET_STATS,
}


class Compose:
    """Apply ``transforms`` in order: ``Compose([a, b])(x) == b(a(x))``."""

    def __init__(self, transforms: Sequence[Callable[[torch.Tensor], torch.Tensor]]):
        self.transforms = list(transforms)

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        for transform in self.transforms:
            image = transform(image)
        return image

    def __repr__(self) -> str:
        return f"Compose({self.transforms!r})"


class RandomCrop:
    """Pad with ``padding`` zero pixels on every side, then crop ``size`` pixels at a random offset.

    Args:
        size: output ``(height, width)`` in pixels, or one int for a square.
        padding: zero pixels added on each side before cropping (>= 0).

    Input ``(..., C, H, W)`` of any dtype; output ``(..., C, height, width)`` of the same dtype.

    Raises:
        ValueError: (when called) if the padded image is smaller than ``size``.
    """

    def __init__(self, size: int | tuple[int, int], padding: int = 0):
        self.size = (size, size) if isinstance(size, int) else tuple(size)
        if padding < 0 or min(self.size) < 1:
            raise ValueError(f"need size >= 1 and padding >= 0, got size={size}, padding={padding}")
        self.padding = padding

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        if self.padding:
            image = F.pad(image, (self.padding,) * 4)
        height, width = image.shape[-2:]
        crop_h, crop_w = self.size
        if crop_h > height or crop_w > width:
            raise ValueError(f"cannot crop {crop_h}x{crop_w} from a padded {height}x{width} image")
        top = int(torch.randint(0, height - crop_h + 1, ()))
        left = int(torch.randint(0, width - crop_w + 1, ()))
        return image[..., top:top + crop_h, left:left + crop_w].contiguous()

    def __repr__(self) -> str:
        return f"RandomCrop(size={self.size}, padding={self.padding})"


class RandomHorizontalFlip:
    """Mirror the image left-right (last dimension) with probability ``p``; shape and dtype unchanged."""

    def __init__(self, p: float = 0.5):
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"p must be in [0, 1], got {p}")
        self.p = p

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return image.flip(-1) if float(torch.rand(())) < self.p else image

    def __repr__(self) -> str:
        return f"RandomHorizontalFlip(p={self.p})"


class ToFloat:
    """uint8 pixels 0..255 -> float32 in [0, 1]; shape unchanged.

    Raises:
        TypeError: (when called) if the input is not uint8.
    """

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        if image.dtype != torch.uint8:
            raise TypeError(f"ToFloat expects a uint8 tensor, got {image.dtype}")
        return image.to(torch.float32).div_(255.0)

    def __repr__(self) -> str:
        return "ToFloat()"


class Normalize:
    """Per channel ``(x - mean[c]) / std[c]`` on a float ``(..., C, H, W)`` tensor; shape unchanged.

    Args:
        mean, std: one value per channel (or one value for all channels), in the units of the
            input (pixels scaled to [0, 1] after ``ToFloat``); std must be positive.

    Raises:
        ValueError: for empty or mismatched mean/std, or a non-positive std.
        TypeError: (when called) if the input is not floating point.
    """

    def __init__(self, mean: Sequence[float], std: Sequence[float]):
        if len(mean) != len(std) or not mean or min(std) <= 0:
            raise ValueError(f"need equally long mean and positive std, got mean={mean}, std={std}")
        self.mean = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        if not image.is_floating_point():
            raise TypeError(f"Normalize expects a floating point tensor (use ToFloat first), got {image.dtype}")
        if self.mean.shape[0] not in (1, image.shape[-3]):
            raise ValueError(f"{self.mean.shape[0]} mean/std values for a {image.shape[-3]}-channel image")
        return (image - self.mean) / self.std

    def __repr__(self) -> str:
        return f"Normalize(mean={self.mean.flatten().tolist()}, std={self.std.flatten().tolist()})"


def normalization_stats(spec: DatasetSpec) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel ``(mean, std)`` for ``spec`` (pixels in [0, 1]), one value per channel.

    Taken from the spec's family (digits use MNIST's); a family's RGB values are averaged for a
    grayscale spec and a grayscale value repeated for an RGB spec.

    Raises:
        ValueError: for a family without statistics.
    """
    try:
        mean, std = NORMALIZATION_STATS[spec.family]
    except KeyError:
        raise ValueError(f"no normalization statistics for family {spec.family!r}") from None
    if len(mean) == spec.channels:
        return mean, std
    if spec.channels == 1:
        return (sum(mean) / len(mean),), (sum(std) / len(std),)
    return mean * spec.channels, std * spec.channels


def eval_transform(spec: DatasetSpec) -> Compose:
    """Evaluation pipeline: uint8 ``(C, H, W)`` -> normalized float32 ``(C, H, W)`` (ToFloat, Normalize).

    ``text`` datasets: the identity (``Compose([])``), byte ids stay int64.
    """
    if spec.format == TEXT:
        return Compose([])
    return Compose([ToFloat(), Normalize(*normalization_stats(spec))])


def train_transform(spec: DatasetSpec, augment: bool = True) -> Compose:
    """Training pipeline: uint8 ``(C, H, W)`` -> augmented, normalized float32 ``(C, H, W)``.

    Augmentation by family: mnist (incl. digits) random crop with padding 2 and no flip (digits
    are not mirror-symmetric); cifar10 random crop with padding 4 plus horizontal flip; imagenet
    and highres random crop with padding ``size // 8`` plus horizontal flip. Crops keep the
    spec's ``height`` x ``width``. With ``augment=False`` it is ``eval_transform(spec)``.
    ``text`` datasets: the identity (their masking is drawn by the dataset itself).

    Raises:
        ValueError: for a family without normalization statistics.
    """
    if not augment or spec.format == TEXT:
        return eval_transform(spec)
    size = (spec.height, spec.width)
    if spec.family == "mnist":
        augmentation = [RandomCrop(size, padding=2)]
    else:
        padding = 4 if spec.family == "cifar10" else min(size) // 8
        augmentation = [RandomCrop(size, padding=padding), RandomHorizontalFlip()]
    return Compose([*augmentation, *eval_transform(spec).transforms])
