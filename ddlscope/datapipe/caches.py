"""The preprocessing strategies compared by ``ddlscope datapipe`` and the caches they read.

Four ways to feed a training loop (after Isenko et al., SIGMOD 2022, "Where Is My Training
Bottleneck?", who materialize a pipeline's output at different steps and trade storage and
one-time preprocessing for throughput):

* ``decode-every-step``     read and decode every sample (PNG/JPEG with PIL for image folders)
  and augment it, every epoch: what ``ddlscope run`` does today;
* ``cached-decoded-memory`` decode once into a uint8 ``(N, C, H, W)`` tensor in RAM, augment online;
* ``cached-decoded-disk``   decode once into a uint8 ``.npy`` file read through a memory map,
  augment online;
* ``preprocessed``          decode, convert and normalize once into a float32 ``.npy`` file; no
  online augmentation, so every epoch sees the same pixels (augmentation variety is lost).

Caches are folders under a cache directory, published atomically (built next to the target,
renamed into place, a JSON marker written last) by the same code that publishes datasets. The
marker records what the cache was built from (a fingerprint of the source) and the one-time cost
measured when it was built, so a re-run reuses the files and still reports that cost.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, Subset

from ddlscope.errors import DatasetError, UserError
from ddlscope.train.loop import Transformed
from ddlscope.workloads.datasets import (
    ArrayDataset,
    DatasetSpec,
    ImageFolderDataset,
    _atomic_folder,
    _read_marker,
)
from ddlscope.workloads.preprocessing import eval_transform, train_transform

DECODE_EVERY_STEP = "decode-every-step"
CACHED_DECODED_MEMORY = "cached-decoded-memory"
CACHED_DECODED_DISK = "cached-decoded-disk"
PREPROCESSED = "preprocessed"
STRATEGIES = (DECODE_EVERY_STEP, CACHED_DECODED_MEMORY, CACHED_DECODED_DISK, PREPROCESSED)
"""In order of cost: no preparation, then RAM per training start, then disk once, then 4x disk once
and no online augmentation. :func:`ddlscope.datapipe.verdict.recommend` prefers the earlier ones."""

DECODED_FOLDER = "decoded-uint8"
PREPROCESSED_FOLDER = "preprocessed-float32"
IMAGES_FILE = "images.npy"
LABELS_FILE = "labels.npy"

OnItems = Callable[[int], None]
"""Progress callback: called with the number of samples just processed."""


@dataclasses.dataclass
class StrategyData:
    """What one strategy's DataLoader reads, and what it cost to prepare.

    Attributes:
        strategy: one of ``STRATEGIES``.
        dataset: items ``(float32 (C, H, W) normalized image, int label)``.
        storage_bytes: bytes of image data the strategy keeps: the encoded files (decode-every-step
            on an image folder), the uint8 array (``N x C x H x W``; in RAM for in-memory readers and
            cached-decoded-memory, on disk for cached-decoded-disk) or the float32 array
            (``4 x N x C x H x W``, preprocessed). Labels and the 128-byte ``.npy`` header are not counted.
        storage_location: ``"disk"`` or ``"memory"``.
        build_s: one-time preparation, seconds, measured when the cache was built: decoding all
            samples (cached-decoded-memory, paid again at every training start because RAM does not
            persist), plus writing the file (cached-decoded-disk), plus converting and normalizing
            (preprocessed). 0 for decode-every-step.
        online_augmentation: whether samples are augmented per step (False for preprocessed, and
            for every strategy when augmentation is off).
    """

    strategy: str
    dataset: Dataset
    storage_bytes: int
    storage_location: str
    build_s: float
    online_augmentation: bool


class NpyDataset(Dataset):
    """Images in a ``.npy`` file, read through a memory map that each process opens for itself.

    Args:
        path: ``.npy`` file holding an array ``(N, C, H, W)`` (uint8 or float32).
        labels: int64 tensor ``(N,)``.
        transform: optional callable applied to each ``(C, H, W)`` image tensor (a copy out of the map).

    The map is opened on first access and not pickled, so DataLoader workers (fork or spawn) each
    open their own instead of receiving a copy of the array.
    """

    def __init__(self, path: Path, labels: torch.Tensor, transform: Callable | None = None):
        self.path, self.labels, self.transform = Path(path), labels, transform
        self._images: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[object, int]:
        if self._images is None:
            self._images = np.load(self.path, mmap_mode="r")
        image = torch.from_numpy(np.array(self._images[index]))
        return (self.transform(image) if self.transform else image), int(self.labels[index])

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_images": None}


def subset_indices(size: int, max_samples: int | None) -> list[int]:
    """Indices of the samples to use: all ``size``, or ``max_samples`` evenly spaced ones (every class
    folder keeps a share, since image folders list their samples class by class)."""
    if max_samples is None or max_samples >= size:
        return list(range(size))
    return np.linspace(0, size - 1, max_samples).round().astype(int).tolist()


def source_fingerprint(source: Dataset, spec: DatasetSpec, indices: Sequence[int]) -> str:
    """SHA-256 (hex) identifying the samples a cache is built from and the geometry they decode to.

    Image folders: the paths, sizes and modification times of the used files; in-memory readers
    (MNIST idx, CIFAR-10): the bytes of the used images and labels. A changed file, another subset
    or another spec gives another fingerprint, and the cache is rebuilt.
    """
    digest = hashlib.sha256(repr((spec.name, spec.image_shape, spec.family, len(indices))).encode())
    if isinstance(source, ImageFolderDataset):
        for i in indices:
            path, label = source.samples[i]
            stat = Path(path).stat()
            digest.update(f"{path}\0{label}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    elif isinstance(source, ArrayDataset):
        chosen = torch.as_tensor(indices, dtype=torch.int64)
        digest.update(source.images[chosen].numpy().tobytes())
        digest.update(source.labels[chosen].numpy().tobytes())
    else:
        raise TypeError(f"cannot fingerprint a {type(source).__name__}")
    return digest.hexdigest()


def encoded_bytes(source: Dataset, indices: Sequence[int]) -> tuple[int, str]:
    """``(bytes, location)`` of the source's image data that decode-every-step reads.

    Image folders: the sizes of the used encoded files on disk. In-memory readers (MNIST idx,
    CIFAR-10) decode the whole split into RAM when opened, so their data is the uint8 array:
    ``N x C x H x W`` bytes in memory.
    """
    if isinstance(source, ImageFolderDataset):
        return sum(Path(source.samples[i][0]).stat().st_size for i in indices), "disk"
    if isinstance(source, ArrayDataset):
        return len(indices) * source.images[0].numel(), "memory"
    raise TypeError(f"cannot size a {type(source).__name__}")


def _decode_all(source: Dataset, indices: Sequence[int], spec: DatasetSpec,
                on_items: OnItems | None) -> tuple[np.ndarray, np.ndarray]:
    """Decode the used samples: uint8 images ``(n, C, H, W)`` and int64 labels ``(n,)``."""
    images = np.empty((len(indices), *spec.image_shape), dtype=np.uint8)
    labels = np.empty(len(indices), dtype=np.int64)
    for k, i in enumerate(indices):
        image, labels[k] = source[i]
        if tuple(image.shape) != spec.image_shape:
            raise DatasetError(f"sample {i} decodes to {tuple(image.shape)}, expected {spec.image_shape}")
        images[k] = image.numpy()
        if on_items:
            on_items(1)
    return images, labels


def _cached(folder: Path, identity: dict) -> dict | None:
    """The marker of a complete cache built from ``identity``, else None.

    Raises:
        DatasetError: if ``folder`` exists but was not written by this module (it is never overwritten).
    """
    marker = _read_marker(folder)
    if marker is not None and all(marker.get(k) == v for k, v in identity.items()):
        return marker
    if folder.exists() and (marker or {}).get("kind") not in ("datapipe-decoded", "datapipe-preprocessed"):
        raise DatasetError(f"{folder}: exists and is not a ddlscope datapipe cache; refusing to overwrite it")
    return None


def build_decoded_cache(source: Dataset, spec: DatasetSpec, indices: Sequence[int], cache_dir: Path,
                        on_items: OnItems | None = None) -> tuple[dict, np.ndarray | None]:
    """Decode the used samples once into ``cache_dir/decoded-uint8/{images,labels}.npy`` (or reuse it).

    Args:
        source: dataset opened without a transform; items ``(uint8 (C, H, W), int label)``.
        spec: its spec; indices: which samples to use (see :func:`subset_indices`).
        cache_dir: folder for the caches (created if missing).
        on_items: progress callback, called per decoded sample (only when building).

    Returns:
        ``(marker, images)``: the cache's marker (``decode_s`` = seconds to decode all used samples,
        ``write_s`` = seconds to write the ``.npy`` files, ``shape``, ``fingerprint``), and the
        decoded uint8 array ``(n, C, H, W)`` when it was just built (None when reused).

    Raises:
        DatasetError: a sample that cannot be decoded (with its path), or a non-cache folder in the way.
    """
    folder = Path(cache_dir) / DECODED_FOLDER
    identity = {"kind": "datapipe-decoded", "fingerprint": source_fingerprint(source, spec, indices)}
    marker = _cached(folder, identity)
    if marker is not None:
        return marker, None
    marker = dict(identity, shape=[len(indices), *spec.image_shape])
    # _atomic_folder writes `marker` after the block, so the timings added inside it are recorded
    with _atomic_folder(folder, marker, replace=folder.exists()) as staging:
        start = time.perf_counter()
        images, labels = _decode_all(source, indices, spec, on_items)
        marker["decode_s"] = time.perf_counter() - start
        start = time.perf_counter()
        np.save(staging / IMAGES_FILE, images)
        np.save(staging / LABELS_FILE, labels)
        marker["write_s"] = time.perf_counter() - start
    return marker, images


def build_preprocessed_cache(decoded_dir: Path, decoded_marker: dict, spec: DatasetSpec, cache_dir: Path,
                             on_items: OnItems | None = None, chunk: int = 256) -> dict:
    """Convert and normalize the decoded cache once into ``cache_dir/preprocessed-float32/images.npy``.

    Applies ``eval_transform(spec)`` (ToFloat, Normalize) in chunks of ``chunk`` images, so the
    values are exactly those the per-sample eval transform gives; the float32 file is written
    through a memory map (``4 x N x C x H x W`` bytes), never held in RAM at once.

    Returns:
        The marker: ``build_s`` = decode seconds of the decoded cache (the source must be decoded
        first) + seconds to convert and write; ``transform_write_s`` the latter alone.
    """
    folder = Path(cache_dir) / PREPROCESSED_FOLDER
    identity = {"kind": "datapipe-preprocessed", "fingerprint": decoded_marker["fingerprint"],
                "transform": repr(eval_transform(spec))}
    marker = _cached(folder, identity)
    if marker is not None:
        return marker
    marker = dict(identity, shape=decoded_marker["shape"])
    transform = eval_transform(spec)
    decoded = np.load(Path(decoded_dir) / IMAGES_FILE, mmap_mode="r")
    with _atomic_folder(folder, marker, replace=folder.exists()) as staging:
        start = time.perf_counter()
        out = np.lib.format.open_memmap(staging / IMAGES_FILE, mode="w+", dtype=np.float32, shape=decoded.shape)
        for first in range(0, len(decoded), chunk):
            block = torch.from_numpy(np.array(decoded[first:first + chunk]))
            out[first:first + len(block)] = transform(block).numpy()
            if on_items:
                on_items(len(block))
        out.flush()
        del out
        marker["transform_write_s"] = time.perf_counter() - start
        marker["build_s"] = decoded_marker["decode_s"] + marker["transform_write_s"]
    return marker


def _labels(folder: Path) -> torch.Tensor:
    return torch.from_numpy(np.load(folder / LABELS_FILE))


def prepare_strategies(source: Dataset, spec: DatasetSpec, indices: Sequence[int], cache_dir: Path,
                       strategies: Sequence[str] = STRATEGIES, augment: bool = True,
                       on_items: OnItems | None = None) -> list[StrategyData]:
    """Build (or reuse) the caches the chosen strategies need and return their datasets.

    Args:
        source: the training split opened without a transform (``open_dataset(name, root, "train")``).
        spec: its spec; indices: the samples to use.
        cache_dir: folder for the caches.
        strategies: names from ``STRATEGIES``, in the order to return them.
        augment: online augmentation (``train_transform(spec, augment)``) for the strategies that
            have it; ``preprocessed`` never augments.
        on_items: progress callback for the cache builds (samples processed).

    Returns:
        One :class:`StrategyData` per strategy; every dataset yields float32 ``(C, H, W)`` images
        normalized with ``normalization_stats(spec)``, and with ``augment=False`` exactly the same
        values in every strategy.

    Raises:
        UserError: an unknown strategy name.
        DatasetError: undecodable samples, or a non-cache folder where a cache goes.
    """
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        raise UserError(f"unknown preprocessing strategy {unknown[0]!r}; allowed: {', '.join(STRATEGIES)}")
    online = train_transform(spec, augment=augment)
    out: dict[str, StrategyData] = {}
    if DECODE_EVERY_STEP in strategies:
        storage_bytes, location = encoded_bytes(source, indices)
        out[DECODE_EVERY_STEP] = StrategyData(DECODE_EVERY_STEP, Transformed(Subset(source, indices), online),
                                              storage_bytes, location, 0.0, augment)
    if set(strategies) - {DECODE_EVERY_STEP}:
        decoded_dir = Path(cache_dir) / DECODED_FOLDER
        decoded_marker, images = build_decoded_cache(source, spec, indices, cache_dir, on_items)
        labels = _labels(decoded_dir)
        if CACHED_DECODED_MEMORY in strategies:
            in_ram = torch.from_numpy(images if images is not None else np.load(decoded_dir / IMAGES_FILE))
            out[CACHED_DECODED_MEMORY] = StrategyData(CACHED_DECODED_MEMORY, ArrayDataset(in_ram, labels, online),
                                                      in_ram.numel(), "memory", decoded_marker["decode_s"], augment)
        if CACHED_DECODED_DISK in strategies:
            out[CACHED_DECODED_DISK] = StrategyData(
                CACHED_DECODED_DISK, NpyDataset(decoded_dir / IMAGES_FILE, labels, online),
                int(np.prod(decoded_marker["shape"])), "disk",
                decoded_marker["decode_s"] + decoded_marker["write_s"], augment)
        if PREPROCESSED in strategies:
            marker = build_preprocessed_cache(decoded_dir, decoded_marker, spec, cache_dir, on_items)
            out[PREPROCESSED] = StrategyData(
                PREPROCESSED, NpyDataset(Path(cache_dir) / PREPROCESSED_FOLDER / IMAGES_FILE, labels),
                4 * int(np.prod(marker["shape"])), "disk", marker["build_s"], False)
    return [out[s] for s in strategies]
