"""Datasets for the training workloads: readers, synthetic writers and the built-in `digits` set.

Every dataset is read from local files in its *standard* on-disk format, so real copies and
synthetic stand-ins go through exactly the same reading and decoding code:

* ``mnist-idx``       MNIST idx files (``train-images-idx3-ubyte`` ... , raw or ``.gz``),
* ``cifar10-python``  CIFAR-10 "python version" pickled batches (``data_batch_1..5``, ``test_batch``),
* ``imagefolder``     ``root/train/<class>/*.png|jpg|jpeg`` and ``root/val|test/<class>/...``.

Whatever the image format, a dataset item is ``(image, label)`` with ``image`` a ``torch.uint8``
tensor of shape ``(C, H, W)`` (values 0..255) and ``label`` a Python ``int`` in
``[0, num_classes)``; an optional ``transform`` is applied to the image (see
``ddlscope.workloads.preprocessing``).

The ``text`` format is byte-level text held in memory: the built-in ``python-docs`` corpus
(``ddlscope.workloads.text``; CPython's documentation topics, read from the standard library,
so it needs no files under the data root). Its items are ``(x, y)``, both ``torch.int64
[length]``: byte ids with some positions masked, and the masked bytes to predict.

Nothing here downloads anything. ``write_synthetic`` writes class-dependent random images in the
standard formats; ``materialize_digits`` turns scikit-learn's bundled real 8x8 digits into a
28x28 ImageFolder tree. Both publish a folder atomically (built next to the target, renamed into
place, completion marker written last), so an interrupted write leaves nothing half-written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import json
import os
import pickle
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from ddlscope.errors import DatasetError, UserError
from ddlscope.workloads import text

Transform = Callable[[torch.Tensor], object]
"""A callable applied to each decoded uint8 ``(C, H, W)`` image tensor."""

MNIST_IDX = "mnist-idx"
CIFAR10_PYTHON = "cifar10-python"
IMAGEFOLDER = "imagefolder"
TEXT = "text"
USER = "user"
"""A user's dataset factory ``"module:attribute"`` (:func:`ddlscope.workloads.factories.open_user_dataset`):
items come preprocessed by the factory, ddlscope applies no transform."""
FORMATS = (MNIST_IDX, CIFAR10_PYTHON, IMAGEFOLDER, TEXT, USER)
SPLITS = ("train", "test")

MARKER_NAME = ".ddlscope-complete.json"
"""Written last into every folder this module publishes; its presence means the tree is complete."""


# --------------------------------------------------------------------------------------------
# Dataset descriptions
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    """What a dataset looks like (thesis 002, Table 3.2).

    Attributes:
        name: dataset name, a key of ``DATASETS`` for the built-in ones.
        format: on-disk format, one of ``FORMATS``.
        channels: image channels, 1 (grayscale) or 3 (RGB); 1 for ``text``.
        height, width: image size in pixels that items are decoded to; ``text``: height 1 and
            width the window length in bytes.
        num_classes: number of classes; labels are in ``[0, num_classes)`` (``text``: byte values
            a model predicts at each scored position).
        train_size: images (``text``: windows) in the full training set (the thesis's count),
            used to extrapolate seconds per epoch from a measured subset.
        family: model family that trains on it (``"mnist"``, ``"cifar10"``, ``"imagenet"``,
            ``"highres"``; ``"text"`` for byte-level text).

    Raises:
        ValueError: on an unknown format, a channel count other than 1 or 3 (1 and height 1 for
            ``text``), or a non-positive size.
    """

    name: str
    format: str
    channels: int
    height: int
    width: int
    num_classes: int
    train_size: int
    family: str

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"unknown dataset format {self.format!r}; allowed: {', '.join(FORMATS)}")
        if self.format == TEXT and (self.channels, self.height) != (1, 1):
            raise ValueError(f"a text dataset has channels = height = 1 (width = window bytes), got "
                             f"{self.channels} x {self.height}")
        if self.channels not in (1, 3):
            raise ValueError(f"channels must be 1 or 3, got {self.channels}")
        if min(self.height, self.width, self.num_classes, self.train_size) < 1:
            raise ValueError(f"sizes and counts must be positive: {self}")

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """``(C, H, W)`` of a decoded item (image formats)."""
        return (self.channels, self.height, self.width)

    @property
    def sample_shape(self) -> tuple[int, ...]:
        """Shape of one input: ``(C, H, W)`` for images, ``(window bytes,)`` for ``text``."""
        return (self.width,) if self.format == TEXT else self.image_shape


DIGITS_TRAIN_SIZE = 1438
"""Training images of ``digits`` after the fixed stratified 80/20 split of the 1,797 images."""

DATASETS: dict[str, DatasetSpec] = {
    "mnist": DatasetSpec("mnist", MNIST_IDX, 1, 28, 28, 10, 60_000, "mnist"),
    "cifar10": DatasetSpec("cifar10", CIFAR10_PYTHON, 3, 32, 32, 10, 50_000, "cifar10"),
    "imagenet": DatasetSpec("imagenet", IMAGEFOLDER, 3, 224, 224, 1000, 1_280_000, "imagenet"),
    "highres": DatasetSpec("highres", IMAGEFOLDER, 3, 512, 512, 1000, 60_000, "highres"),
    "digits": DatasetSpec("digits", IMAGEFOLDER, 1, 28, 28, 10, DIGITS_TRAIN_SIZE, "mnist"),
    text.PYTHON_DOCS: DatasetSpec(text.PYTHON_DOCS, TEXT, 1, 1, text.SEQUENCE_LENGTH, text.VOCAB_SIZE,
                                  text.window_count("train"), text.TEXT_FAMILY),
}


def default_data_root() -> Path:
    """Folder holding the datasets: ``$DDLSCOPE_DATA`` if set, else ``~/.cache/ddlscope/data``."""
    configured = os.environ.get("DDLSCOPE_DATA")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "ddlscope" / "data"


def _known_spec(name: str) -> DatasetSpec:
    try:
        return DATASETS[name]
    except KeyError:
        raise UserError(f"unknown dataset {name!r}; allowed: {', '.join(sorted(DATASETS))}") from None


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise UserError(f"unknown split {split!r}; allowed: {', '.join(SPLITS)}")


def family_for_geometry(height: int, width: int) -> str:
    """Model family for a dataset that is not built in, chosen by image size."""
    side = max(height, width)
    if side <= 28:
        return "mnist"
    if side <= 32:
        return "cifar10"
    return "imagenet" if side <= 224 else "highres"


# --------------------------------------------------------------------------------------------
# Dataset classes
# --------------------------------------------------------------------------------------------


class ArrayDataset(Dataset):
    """Decoded images held in memory (MNIST, CIFAR-10).

    Args:
        images: ``torch.uint8`` tensor of shape ``(N, C, H, W)``.
        labels: ``torch.int64`` tensor of shape ``(N,)``.
        transform: optional callable applied to each ``(C, H, W)`` uint8 image.

    Items are ``(transform(image), label)``; the image is a copy, so a transform may modify it in place.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, transform: Transform | None = None):
        if images.dtype != torch.uint8 or images.dim() != 4 or labels.shape != (images.shape[0],):
            raise ValueError(f"need uint8 images (N,C,H,W) and N labels, "
                             f"got {images.dtype} {tuple(images.shape)} and {tuple(labels.shape)}")
        self.images = images
        self.labels = labels.to(torch.int64)
        self.transform = transform

    def __len__(self) -> int:
        return self.images.shape[0]

    def __getitem__(self, index: int) -> tuple[object, int]:
        image = self.images[index].clone()
        return (self.transform(image) if self.transform else image), int(self.labels[index])


class ImageFolderDataset(Dataset):
    """Image files in ``root/<split>/<class>/`` decoded lazily, so decoding runs in DataLoader workers.

    The test split is read from ``root/val`` or, failing that, ``root/test``. Class indices are
    the positions of the class folder names in the sorted union of the class folders of all splits
    (``train``, ``val``, ``test``), so train and test agree even when a split lacks some classes.

    Args:
        root: dataset folder.
        split: ``"train"`` or ``"test"``.
        channels: 1 (decode as grayscale) or 3 (RGB).
        height, width: items are resized (bilinear) to this size in pixels when the file differs.
        transform: optional callable applied to each uint8 ``(C, H, W)`` image.

    Attributes:
        classes: sorted class folder names; ``samples``: ``(path, label)`` pairs;
        ``labels``: ``torch.int64`` tensor ``(N,)``.

    Raises:
        UserError: on an unknown split.
        DatasetError: (with the path) when the split folder is missing, has no class folders or no
            ``.png``/``.jpg``/``.jpeg`` files; ``__getitem__`` raises it for a file PIL cannot decode.
    """

    EXTENSIONS = (".png", ".jpg", ".jpeg")

    def __init__(self, root: Path, split: str, channels: int, height: int, width: int,
                 transform: Transform | None = None):
        _check_split(split)
        self.root = Path(root)
        split_dir = _imagefolder_split_dir(self.root, split)
        if not _class_dirs(split_dir):
            raise DatasetError(f"{split_dir}: no class folders (expected {split_dir}/<class>/<image files>)")
        self.classes = sorted({d.name for folder in _imagefolder_split_dirs(self.root) for d in _class_dirs(folder)})
        label_of = {name: index for index, name in enumerate(self.classes)}
        self.samples = [
            (str(path), label_of[class_dir.name])
            for class_dir in _class_dirs(split_dir)
            for path in sorted(class_dir.iterdir())
            if path.suffix.lower() in self.EXTENSIONS and path.is_file()
        ]
        if not self.samples:
            raise DatasetError(f"{split_dir}: no image files ({', '.join(self.EXTENSIONS)}) in its class folders")
        self.labels = torch.tensor([label for _, label in self.samples], dtype=torch.int64)
        self.channels, self.height, self.width = channels, height, width
        self.transform = transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[object, int]:
        path, label = self.samples[index]
        image = decode_image(Path(path), self.channels, self.height, self.width)
        return (self.transform(image) if self.transform else image), label


def decode_image(path: Path, channels: int, height: int, width: int) -> torch.Tensor:
    """Decode one image file to a ``torch.uint8`` tensor of shape ``(channels, height, width)``.

    The file is converted to grayscale (``channels == 1``) or RGB (``channels == 3``) and resized
    with bilinear filtering only if its size differs from ``height`` x ``width`` pixels.

    Raises:
        DatasetError: with the path, when PIL cannot open or decode the file.
    """
    try:
        with Image.open(path) as opened:
            image = opened.convert("L" if channels == 1 else "RGB")
        if image.size != (width, height):
            image = image.resize((width, height), Image.Resampling.BILINEAR)
        pixels = np.array(image, dtype=np.uint8)
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise DatasetError(f"{path}: cannot decode image ({exc})") from exc
    chw = pixels[None] if pixels.ndim == 2 else pixels.transpose(2, 0, 1)
    return torch.from_numpy(np.ascontiguousarray(chw))


def _imagefolder_split_dirs(root: Path) -> list[Path]:
    return [root / name for name in ("train", "val", "test") if (root / name).is_dir()]


def _imagefolder_split_dir(root: Path, split: str) -> Path:
    candidates = [root / "train"] if split == "train" else [root / "val", root / "test"]
    for candidate in candidates:
        if candidate.is_dir():
            return candidate
    raise DatasetError(f"{root}: no {' or '.join(c.name for c in candidates)} folder for the {split} split")


def _class_dirs(split_dir: Path) -> list[Path]:
    return sorted(d for d in split_dir.iterdir() if d.is_dir() and not d.name.startswith("."))


# --------------------------------------------------------------------------------------------
# Readers
# --------------------------------------------------------------------------------------------

_IDX_IMAGES_MAGIC = 0x00000803  # unsigned bytes, 3 dimensions (N, H, W)
_IDX_LABELS_MAGIC = 0x00000801  # unsigned bytes, 1 dimension (N,)
_IDX_PREFIX = {"train": "train", "test": "t10k"}


def read_mnist_idx(folder: Path, split: str, transform: Transform | None = None) -> ArrayDataset:
    """Read MNIST idx files into memory: images ``(N, 1, H, W)`` uint8, labels ``(N,)``.

    Looks in ``folder``, ``folder/raw`` and ``folder/MNIST/raw`` for ``train-images-idx3-ubyte``
    and ``train-labels-idx1-ubyte`` (``t10k-...`` for the test split), each raw or gzip-compressed
    (``.gz`` name or gzip content).

    Raises:
        UserError: on an unknown split.
        DatasetError: with the path, when a file is missing, not valid gzip, has a wrong magic
            number (which also encodes the dimension count), a size that does not match its
            header, or when the image and label counts differ.
    """
    _check_split(split)
    prefix = _IDX_PREFIX[split]
    images_path = _find_idx_file(Path(folder), f"{prefix}-images-idx3-ubyte")
    labels_path = _find_idx_file(Path(folder), f"{prefix}-labels-idx1-ubyte")
    images = _read_idx(images_path, _IDX_IMAGES_MAGIC)
    labels = _read_idx(labels_path, _IDX_LABELS_MAGIC)
    if images.shape[0] != labels.shape[0]:
        raise DatasetError(f"{images_path}: {images.shape[0]} images but {labels_path} has {labels.shape[0]} labels")
    images_nchw = torch.from_numpy(images.copy()).unsqueeze(1)
    return ArrayDataset(images_nchw, torch.from_numpy(labels.astype(np.int64)), transform)


def _idx_dirs(folder: Path) -> tuple[Path, ...]:
    """Where MNIST idx files may be: the folder itself or the raw/ layouts other tools use."""
    return (folder, folder / "raw", folder / "MNIST" / "raw")


def _find_idx_file(folder: Path, stem: str) -> Path:
    candidates = [base / name for base in _idx_dirs(folder) for name in (stem, stem + ".gz")]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise DatasetError(f"{folder}: missing MNIST file {stem} (or {stem}.gz)")


def _read_idx(path: Path, expected_magic: int) -> np.ndarray:
    """Parse an idx file (big-endian header: magic, then one uint32 per dimension) into a uint8 array."""
    data = path.read_bytes()
    if data[:2] == b"\x1f\x8b":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as exc:
            raise DatasetError(f"{path}: corrupt gzip data ({exc})") from exc
    if len(data) < 4:
        raise DatasetError(f"{path}: truncated idx header ({len(data)} bytes)")
    magic = int.from_bytes(data[:4], "big")
    if magic != expected_magic:
        raise DatasetError(f"{path}: bad idx magic number 0x{magic:08X}, expected 0x{expected_magic:08X}")
    ndim = expected_magic & 0xFF
    header_size = 4 + 4 * ndim
    if len(data) < header_size:
        raise DatasetError(f"{path}: truncated idx header ({len(data)} bytes, need {header_size})")
    dims = tuple(int(d) for d in np.frombuffer(data, dtype=">u4", count=ndim, offset=4))
    expected_size = header_size + int(np.prod(dims))
    if len(data) != expected_size:
        raise DatasetError(f"{path}: {len(data)} bytes but header dimensions {dims} need {expected_size}")
    return np.frombuffer(data, dtype=np.uint8, offset=header_size).reshape(dims)


_CIFAR_FOLDER = "cifar-10-batches-py"
_CIFAR_BATCHES = {"train": [f"data_batch_{i}" for i in range(1, 6)], "test": ["test_batch"]}
_CIFAR_ROW = 3 * 32 * 32  # one image per row: 1024 red, then 1024 green, then 1024 blue bytes


def read_cifar10(folder: Path, split: str, transform: Transform | None = None) -> ArrayDataset:
    """Read CIFAR-10 python batches into memory: images ``(N, 3, 32, 32)`` uint8, labels ``(N,)``.

    ``folder`` is ``cifar-10-batches-py`` itself or a folder containing it. The train split needs
    ``data_batch_1`` .. ``data_batch_5``, the test split ``test_batch``: pickled dicts with
    ``b"data"`` (``N x 3072`` uint8) and ``b"labels"`` (N ints in 0..9). Unpickling only admits
    numpy array types, so a crafted file cannot run code.

    Raises:
        UserError: on an unknown split.
        DatasetError: with the path, for a missing batch, a file that cannot be unpickled, or
            wrong keys, shapes, dtypes or label values.
    """
    _check_split(split)
    folder = Path(folder)
    if (folder / _CIFAR_FOLDER).is_dir():
        folder = folder / _CIFAR_FOLDER
    batches = [_read_cifar_batch(folder / name) for name in _CIFAR_BATCHES[split]]
    images = np.concatenate([data for data, _ in batches]).reshape(-1, 3, 32, 32)
    labels = np.concatenate([labels for _, labels in batches])
    return ArrayDataset(torch.from_numpy(images), torch.from_numpy(labels), transform)


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Unpickler that resolves only the globals a pickled numpy array needs."""

    _CORE = "numpy._core" if int(np.__version__.split(".")[0]) >= 2 else "numpy.core"
    _ALLOWED = {("numpy", "ndarray"), ("numpy", "dtype"), (f"{_CORE}.multiarray", "_reconstruct"),
                (f"{_CORE}.multiarray", "scalar"), (f"{_CORE}.numeric", "_frombuffer")}

    def find_class(self, module: str, name: str) -> object:
        for core in ("numpy._core", "numpy.core"):  # pickles name either; use this numpy's
            if module.startswith(core + "."):
                module = self._CORE + module[len(core):]
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load global {module}.{name}")
        return super().find_class(module, name)


def _read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    if not path.is_file():
        raise DatasetError(f"{path}: missing CIFAR-10 batch file")
    try:
        with path.open("rb") as f:
            batch = _NumpyOnlyUnpickler(f, encoding="bytes").load()
    except Exception as exc:  # corrupt pickles raise many types (EOFError, UnpicklingError, KeyError, ...)
        raise DatasetError(f"{path}: cannot unpickle CIFAR-10 batch ({type(exc).__name__}: {exc})") from exc
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
        raise DatasetError(f"{path}: not a CIFAR-10 batch (need a dict with b'data' and b'labels')")
    data, labels = batch[b"data"], np.asarray(batch[b"labels"])
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != _CIFAR_ROW:
        raise DatasetError(f"{path}: b'data' must be a uint8 array of shape (N, {_CIFAR_ROW}), "
                           f"got {getattr(data, 'dtype', type(data).__name__)} {getattr(data, 'shape', '')}")
    labels_ok = labels.shape == (data.shape[0],) and (
        labels.size == 0 or (np.issubdtype(labels.dtype, np.integer) and 0 <= labels.min() and labels.max() <= 9))
    if not labels_ok:
        raise DatasetError(f"{path}: b'labels' must be {data.shape[0]} integers in 0..9")
    return data, labels.astype(np.int64)


# --------------------------------------------------------------------------------------------
# Opening by name or by path
# --------------------------------------------------------------------------------------------


def detect_format(folder: Path) -> str:
    """Format of the dataset in ``folder``: one of ``FORMATS``.

    idx files (in ``folder``, ``raw/`` or ``MNIST/raw/``) mean ``mnist-idx``; ``data_batch_1`` or
    ``test_batch`` (in ``folder`` or ``cifar-10-batches-py/``) mean ``cifar10-python``; a
    ``train``, ``val`` or ``test`` folder with class subfolders means ``imagefolder``.

    Raises:
        DatasetError: with the path, when none of these is found.
    """
    folder = Path(folder)
    idx_names = [f"{p}-images-idx3-ubyte{gz}" for p in _IDX_PREFIX.values() for gz in ("", ".gz")]
    if any((base / n).is_file() for base in _idx_dirs(folder) for n in idx_names):
        return MNIST_IDX
    if any((base / n).is_file() for base in (folder, folder / _CIFAR_FOLDER) for n in ("data_batch_1", "test_batch")):
        return CIFAR10_PYTHON
    if any(_class_dirs(d) for d in _imagefolder_split_dirs(folder)):
        return IMAGEFOLDER
    raise DatasetError(f"{folder}: no dataset found (looked for MNIST idx files, CIFAR-10 python batches, "
                       "or train/, val/ or test/ folders with class subfolders)")


def open_dataset(name_or_path: str, root: Path | None = None, split: str = "train",
                 transform: Transform | None = None) -> tuple[Dataset, DatasetSpec]:
    """Open a dataset split; items are ``(transform(uint8 (C,H,W) image), int label)``, or for
    ``text`` datasets ``(transform(int64 [length] byte ids), int64 [length] targets)``.

    Args:
        name_or_path: a key of ``DATASETS`` (read from ``root/<name>`` in that dataset's format;
            ``digits`` is materialized there on first use; ``python-docs`` comes from the
            standard library and ignores ``root``), the path of a dataset folder whose
            format is detected (``detect_format``), or a user factory ``"package.module:attribute"``
            that is not an existing path (called as ``factory(split)``; its items are preprocessed
            already, ``transform`` is not applied; format ``user``, see
            :func:`ddlscope.workloads.factories.open_user_dataset`). Names take precedence over
            same-named folders.
        root: data root for names; ``default_data_root()`` when None. Unused for paths.
        split: ``"train"`` or ``"test"``.
        transform: optional callable applied to each decoded image.

    Returns:
        ``(dataset, spec)``. For a path, ``spec`` is the built-in spec of the detected format
        (MNIST, CIFAR-10, or an image folder named like a built-in dataset) with height/width
        adjusted to the files; other image folders get a spec derived from their first image,
        class count and train image count.

    Raises:
        UserError: for an unknown name (the message lists the allowed names) or split.
        DatasetError: with the path, when the files are missing, corrupt, of another image size
            than the named dataset's, or have more classes than it.
    """
    _check_split(split)
    if name_or_path in DATASETS:
        spec = DATASETS[name_or_path]
        if spec.format == TEXT:
            return text.python_docs(split, transform), spec
        root = default_data_root() if root is None else Path(root)
        folder = materialize_digits(root) if spec.name == "digits" else root / spec.name
        if not folder.is_dir():
            raise DatasetError(f"{folder}: dataset {spec.name!r} not found; put a copy in the {spec.format} "
                               "format there, or create synthetic data with write_synthetic()")
        dataset = _read(folder, spec, split, transform)
        _check_matches(folder, dataset, spec)
        return dataset, spec
    folder = Path(name_or_path).expanduser()
    if not folder.exists():
        from ddlscope.workloads.factories import is_import_string, open_user_dataset

        if is_import_string(name_or_path):
            return open_user_dataset(name_or_path, split)
    if not folder.is_dir():
        if os.sep in name_or_path or "/" in name_or_path or name_or_path.startswith("."):
            raise DatasetError(f"{folder}: no such dataset folder")
        raise UserError(f"unknown dataset {name_or_path!r}; allowed: {', '.join(sorted(DATASETS))}, "
                        "the path of a folder with MNIST idx, CIFAR-10 python or ImageFolder data, "
                        "or a factory 'package.module:factory'")
    fmt = detect_format(folder)
    if fmt == IMAGEFOLDER:
        spec = _imagefolder_spec(folder)
        dataset = _read(folder, spec, split, transform)
        _check_matches(folder, dataset, spec)
        return dataset, spec
    base = DATASETS["mnist" if fmt == MNIST_IDX else "cifar10"]
    dataset = _read(folder, base, split, transform)
    return dataset, _with_geometry(base, *dataset.images.shape[2:])


def _read(folder: Path, spec: DatasetSpec, split: str, transform: Transform | None) -> Dataset:
    if spec.format == MNIST_IDX:
        return read_mnist_idx(folder, split, transform)
    if spec.format == CIFAR10_PYTHON:
        return read_cifar10(folder, split, transform)
    return ImageFolderDataset(folder, split, spec.channels, spec.height, spec.width, transform)


def _check_matches(folder: Path, dataset: Dataset, spec: DatasetSpec) -> None:
    if isinstance(dataset, ArrayDataset) and tuple(dataset.images.shape[1:]) != spec.image_shape:
        raise DatasetError(f"{folder}: images are {tuple(dataset.images.shape[1:])}, "
                           f"but {spec.name} images are {spec.image_shape}")
    if isinstance(dataset, ImageFolderDataset) and len(dataset.classes) > spec.num_classes:
        raise DatasetError(f"{folder}: {len(dataset.classes)} class folders, "
                           f"but {spec.name} has {spec.num_classes} classes")


def _imagefolder_spec(folder: Path) -> DatasetSpec:
    """The built-in spec if ``folder`` is named like a built-in image folder dataset, else one
    derived from the first image's mode and size, the class folders and the train image count."""
    named = DATASETS.get(folder.name)
    if named is not None and named.format == IMAGEFOLDER:
        return named
    split = "train" if (folder / "train").is_dir() else "test"
    listing = ImageFolderDataset(folder, split, 3, 1, 1)
    first_path = listing.samples[0][0]
    try:
        with Image.open(first_path) as first:
            channels, (width, height) = (1 if first.mode in ("1", "L", "LA", "I", "I;16", "F") else 3), first.size
    except OSError as exc:
        raise DatasetError(f"{first_path}: cannot open image ({exc})") from exc
    return DatasetSpec(folder.name, IMAGEFOLDER, channels, height, width, len(listing.classes),
                       len(listing), family_for_geometry(height, width))


def _with_geometry(spec: DatasetSpec, height: int, width: int) -> DatasetSpec:
    if (height, width) == (spec.height, spec.width):
        return spec
    return dataclasses.replace(spec, height=height, width=width, family=family_for_geometry(height, width))


# --------------------------------------------------------------------------------------------
# Atomic publishing of generated folders
# --------------------------------------------------------------------------------------------


def _read_marker(folder: Path) -> dict | None:
    """The completion marker's content, or None when the folder has no (valid) marker."""
    try:
        content = json.loads((folder / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return None
    return content if isinstance(content, dict) else None


@contextlib.contextmanager
def _atomic_folder(target: Path, marker: dict, replace: bool = False) -> Iterator[Path]:
    """Yield an empty staging folder next to ``target``; on success write ``marker`` into it and
    rename it to ``target``. An existing ``target`` is replaced only if ``replace``; otherwise a
    complete one (published meanwhile by a concurrent writer) is kept. On error the staging
    folder is removed, so ``target`` is never half-written."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    try:
        yield staging
        (staging / MARKER_NAME).write_text(json.dumps(marker, indent=1))
        retired = None
        if replace and target.exists():
            retired = staging.with_name(staging.name + ".old")
            os.rename(target, retired)
        try:
            os.rename(staging, target)
        except OSError:
            if _read_marker(target) is None:
                raise
        if retired is not None:
            shutil.rmtree(retired, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# Synthetic data in the standard formats
# --------------------------------------------------------------------------------------------

_SPLIT_STREAM = {"train": 0, "test": 1}
_PROTOTYPE_STREAM = 2
_PROTOTYPE_GRID = 4  # class prototypes are a 4x4 grid of intensities per channel
_NOISE_STD = 40.0
_CHUNK_ELEMENTS = 1 << 24  # generate at most ~16 M pixel values (64 MB float32) at a time


def synthetic_labels(spec: DatasetSpec, count: int, seed: int, split: str) -> np.ndarray:
    """Labels that ``write_synthetic`` gives a split: int64 ``(count,)``, in the written order.

    Classes are balanced (``i % num_classes`` shuffled), so exactly classes
    ``0 .. min(count, num_classes) - 1`` occur.
    """
    return np.random.default_rng([seed, _SPLIT_STREAM[split]]).permutation(np.arange(count) % spec.num_classes)


def synthetic_batches(spec: DatasetSpec, count: int, seed: int,
                      split: str) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Deterministic class-dependent random images for one split, in chunks.

    Each image is its class's prototype (a 4x4 grid of intensities per channel, blown up to the
    spec's size; the same for both splits) plus Gaussian noise (std 40), clipped to 0..255.

    Yields:
        ``(images, labels)``: uint8 ``(n, C, H, W)`` and int64 ``(n,)``, covering
        ``synthetic_labels(spec, count, seed, split)`` in order.
    """
    labels = synthetic_labels(spec, count, seed, split)
    noise_rng = np.random.default_rng([seed, _SPLIT_STREAM[split], 1])
    chunk = max(1, _CHUNK_ELEMENTS // (spec.channels * spec.height * spec.width))
    prototypes: dict[int, np.ndarray] = {}
    for start in range(0, count, chunk):
        chunk_labels = labels[start:start + chunk]
        for label in set(chunk_labels.tolist()) - prototypes.keys():
            prototypes[label] = _class_prototype(spec, seed, label)
        noise = noise_rng.standard_normal((len(chunk_labels), *spec.image_shape), dtype=np.float32) * _NOISE_STD
        images = np.stack([prototypes[label] for label in chunk_labels.tolist()]) + noise
        yield np.clip(np.rint(images), 0, 255).astype(np.uint8), chunk_labels


def synthetic_samples(spec: DatasetSpec, count: int, seed: int, split: str) -> tuple[np.ndarray, np.ndarray]:
    """All of ``synthetic_batches`` at once: uint8 images ``(count, C, H, W)`` and int64 labels ``(count,)``."""
    batches = list(synthetic_batches(spec, count, seed, split))
    if not batches:
        return np.zeros((0, *spec.image_shape), np.uint8), np.zeros(0, np.int64)
    return np.concatenate([b[0] for b in batches]), np.concatenate([b[1] for b in batches])


def _class_prototype(spec: DatasetSpec, seed: int, label: int) -> np.ndarray:
    grid = np.random.default_rng([seed, _PROTOTYPE_STREAM, label]).uniform(
        30, 225, (spec.channels, _PROTOTYPE_GRID, _PROTOTYPE_GRID)).astype(np.float32)
    rows = np.arange(spec.height) * _PROTOTYPE_GRID // spec.height
    cols = np.arange(spec.width) * _PROTOTYPE_GRID // spec.width
    return grid[:, rows][:, :, cols]


def write_synthetic(name: str, root: Path, train_size: int, test_size: int, seed: int = 0) -> Path:
    """Write a synthetic copy of dataset ``name`` to ``root/<name>`` in its standard format.

    ``mnist`` becomes gzip idx files, ``cifar10`` pickled python batches (train images split
    evenly over ``data_batch_1..5``) under ``cifar-10-batches-py/``, ``imagenet`` and ``highres``
    an ImageFolder of JPEG files at the spec's resolution (``train/`` and ``val/``, class folders
    named by zero-padded class index, only for classes that get images). Images and labels are
    those of ``synthetic_samples(spec, size, seed, split)`` (JPEG is lossy). Idempotent: a tree
    written earlier with the same arguments is kept; one with other arguments is replaced.

    Args:
        name: ``"mnist"``, ``"cifar10"``, ``"imagenet"`` or ``"highres"``.
        root: data root; train_size, test_size: image counts (>= 1); seed: random seed.

    Returns:
        The dataset folder ``root/<name>``.

    Raises:
        UserError: for an unknown name, ``digits`` (it is real data), or counts below 1.
        DatasetError: if ``root/<name>`` exists but was not written by ``write_synthetic``
            (it is never overwritten).
    """
    spec = _known_spec(name)
    if spec.name == "digits":
        raise UserError("digits is real data; use materialize_digits() instead of write_synthetic()")
    if train_size < 1 or test_size < 1:
        raise UserError(f"train_size and test_size must be at least 1, got {train_size} and {test_size}")
    target = Path(root) / spec.name
    marker = {"kind": "synthetic", "name": spec.name, "train_size": train_size, "test_size": test_size, "seed": seed}
    existing = _read_marker(target)
    if existing == marker:
        return target
    if target.exists() and (existing or {}).get("kind") != "synthetic":
        raise DatasetError(f"{target}: exists and was not written by write_synthetic; refusing to overwrite it")
    writer = {MNIST_IDX: _write_mnist_split, CIFAR10_PYTHON: _write_cifar_split, IMAGEFOLDER: _write_imagefolder_split}
    with _atomic_folder(target, marker, replace=target.exists()) as staging:
        for split, count in (("train", train_size), ("test", test_size)):
            writer[spec.format](staging, split, synthetic_batches(spec, count, seed, split), spec)
    return target


def _write_mnist_split(folder: Path, split: str, batches: Iterator, spec: DatasetSpec) -> None:
    images, labels = map(np.concatenate, zip(*batches))
    prefix = _IDX_PREFIX[split]
    _write_idx(folder / f"{prefix}-images-idx3-ubyte.gz", _IDX_IMAGES_MAGIC, images[:, 0])
    _write_idx(folder / f"{prefix}-labels-idx1-ubyte.gz", _IDX_LABELS_MAGIC, labels.astype(np.uint8))


def _write_idx(path: Path, magic: int, array: np.ndarray) -> None:
    header = magic.to_bytes(4, "big") + np.asarray(array.shape, dtype=">u4").tobytes()
    path.write_bytes(gzip.compress(header + array.astype(np.uint8).tobytes(), compresslevel=6))


def _write_cifar_split(folder: Path, split: str, batches: Iterator, spec: DatasetSpec) -> None:
    images, labels = map(np.concatenate, zip(*batches))
    (folder / _CIFAR_FOLDER).mkdir(exist_ok=True)
    names = _CIFAR_BATCHES[split]
    for name, part in zip(names, np.array_split(np.arange(len(labels)), len(names))):
        batch = {
            b"batch_label": f"synthetic {name}".encode(),
            b"labels": labels[part].tolist(),
            b"data": images[part].reshape(len(part), _CIFAR_ROW),
            b"filenames": [f"synthetic_{i:06d}.png".encode() for i in part],
        }
        with (folder / _CIFAR_FOLDER / name).open("wb") as f:
            pickle.dump(batch, f, protocol=4)


def _write_imagefolder_split(folder: Path, split: str, batches: Iterator, spec: DatasetSpec) -> None:
    split_dir = folder / ("train" if split == "train" else "val")
    name_width = len(str(spec.num_classes - 1))  # zero-padded, so names sort in class order
    index = 0
    for images, labels in batches:
        for image, label in zip(images, labels.tolist()):
            class_dir = split_dir / f"{label:0{name_width}d}"
            class_dir.mkdir(parents=True, exist_ok=True)
            _save_image(image, class_dir / f"{index:06d}.jpg", quality=90)
            index += 1


def _save_image(chw: np.ndarray, path: Path, **options: object) -> None:
    """Save a uint8 ``(C, H, W)`` array as an image file (format from the suffix)."""
    pixels = chw[0] if chw.shape[0] == 1 else chw.transpose(1, 2, 0)
    Image.fromarray(np.ascontiguousarray(pixels)).save(path, **options)


# --------------------------------------------------------------------------------------------
# digits: real scikit-learn images at MNIST geometry
# --------------------------------------------------------------------------------------------

_DIGITS_TEST_FRACTION = 0.2
_DIGITS_SPLIT_SEED = 0


def digits_split(targets: np.ndarray) -> np.ndarray:
    """Fixed stratified split of the digits: bool ``(N,)``, True for test (20 % of each class, seeded)."""
    rng = np.random.default_rng(_DIGITS_SPLIT_SEED)
    is_test = np.zeros(len(targets), dtype=bool)
    for digit in np.unique(targets):
        members = rng.permutation(np.flatnonzero(targets == digit))
        is_test[members[: round(_DIGITS_TEST_FRACTION * len(members))]] = True
    return is_test


def digit_to_mnist_geometry(image: np.ndarray) -> np.ndarray:
    """One 8x8 digit (float values 0..16) as a uint8 28x28 image like MNIST's.

    Values are scaled to 0..255, resized bilinearly to 20x20 and padded with 4 zero pixels on
    each side, like MNIST's digits centred in a 20x20 box.
    """
    scaled = np.clip(np.rint(np.asarray(image, dtype=np.float64) * (255.0 / 16.0)), 0, 255).astype(np.uint8)
    resized = np.asarray(Image.fromarray(scaled).resize((20, 20), Image.Resampling.BILINEAR))
    return np.pad(resized, 4)


def materialize_digits(root: Path) -> Path:
    """Write scikit-learn's bundled real digits (1,797 images) as an ImageFolder of 28x28 PNGs.

    Layout: ``root/digits/{train,test}/<digit>/<i>.png`` with ``i`` the image's index in
    ``sklearn.datasets.load_digits()`` and the split from ``digits_split`` (1,438 train, 359 test).
    Idempotent: returns at once if the completed tree (its marker file) exists. Published
    atomically, so concurrent callers (e.g. several training ranks) are safe.

    Returns:
        The dataset folder ``root/digits``.

    Raises:
        DatasetError: if ``root/digits`` exists without the completion marker (it is never overwritten).
    """
    target = Path(root) / "digits"
    if _read_marker(target) is not None:
        return target
    if target.exists():
        raise DatasetError(f"{target}: exists but is not a complete digits tree (no {MARKER_NAME}); "
                           "remove it to have it re-created")
    from sklearn.datasets import load_digits  # bundled with scikit-learn: no download

    digits = load_digits()
    is_test = digits_split(digits.target)
    marker = {"kind": "digits", "train": int((~is_test).sum()), "test": int(is_test.sum())}
    with _atomic_folder(target, marker) as staging:
        for index, (image, digit) in enumerate(zip(digits.images, digits.target.tolist())):
            class_dir = staging / ("test" if is_test[index] else "train") / str(digit)
            class_dir.mkdir(parents=True, exist_ok=True)
            _save_image(digit_to_mnist_geometry(image)[None], class_dir / f"{index}.png")
    return target
