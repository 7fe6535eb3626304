"""Tests for ddlscope.workloads.datasets and ddlscope.workloads.preprocessing (small data in tmp_path)."""

from __future__ import annotations

import gzip
import io
import json
import os
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from ddlscope.errors import DatasetError, UserError
from ddlscope.workloads import datasets
from ddlscope.workloads.datasets import (
    DATASETS,
    MARKER_NAME,
    ImageFolderDataset,
    digit_to_mnist_geometry,
    materialize_digits,
    open_dataset,
    read_cifar10,
    read_mnist_idx,
    synthetic_samples,
    write_synthetic,
)
from ddlscope.workloads.preprocessing import (
    Compose,
    Normalize,
    RandomCrop,
    RandomHorizontalFlip,
    ToFloat,
    eval_transform,
    normalization_stats,
    train_transform,
)

SEED = 3


def _all_items(dataset) -> tuple[torch.Tensor, list[int]]:
    items = [dataset[i] for i in range(len(dataset))]
    return torch.stack([image for image, _ in items]), [label for _, label in items]


def _write_png_folder(root: Path, layout: dict[str, dict[str, int]], size: int = 8) -> Path:
    """Small RGB PNG ImageFolder: layout = {split: {class name: image count}}."""
    for split, classes in layout.items():
        (root / split).mkdir(parents=True, exist_ok=True)
        for name, count in classes.items():
            (root / split / name).mkdir(parents=True, exist_ok=True)
            for i in range(count):
                Image.new("RGB", (size, size), (10 * i, 50, 200)).save(root / split / name / f"{i}.png")
    return root


# ---------------------------------------------------------------- synthetic round trips


@pytest.mark.parametrize("name, train_size, test_size", [
    ("mnist", 20, 7), ("cifar10", 12, 5), ("cifar10", 3, 1),  # 3 train images: some batches are empty
    ("imagenet", 6, 2), ("highres", 3, 1),
])
def test_synthetic_round_trip(tmp_path, name, train_size, test_size):
    spec = DATASETS[name]
    assert write_synthetic(name, tmp_path, train_size, test_size, seed=SEED) == tmp_path / name
    for split, count in (("train", train_size), ("test", test_size)):
        dataset, opened_spec = open_dataset(name, tmp_path, split)
        assert opened_spec == spec and len(dataset) == count
        images, labels = _all_items(dataset)
        assert images.dtype == torch.uint8 and images.shape == (count, *spec.image_shape)
        assert all(type(label) is int and 0 <= label < spec.num_classes for label in labels)
        expected_images, expected_labels = synthetic_samples(spec, count, SEED, split)
        if spec.format == "imagefolder":
            # Files are listed class by class, in write order within a class; JPEG is lossy, so
            # compare 4x4 block means per channel (catches swapped channels or transposed axes).
            order = np.argsort(expected_labels, kind="stable")
            assert labels == expected_labels[order].tolist()
            expected = torch.from_numpy(expected_images[order]).float()
            block = spec.height // 4
            assert (F.avg_pool2d(images.float(), block) - F.avg_pool2d(expected, block)).abs().max() < 6
        else:
            assert labels == expected_labels.tolist()
            assert torch.equal(images, torch.from_numpy(expected_images))


def test_synthetic_images_depend_on_class():
    spec = DATASETS["cifar10"]
    images, labels = synthetic_samples(spec, 200, SEED, "train")
    class_means = np.stack([images[labels == k].mean(0) for k in range(10)]).astype(np.float32)
    within = np.abs(images[labels == 0].astype(np.float32) - class_means[0]).mean()
    between = np.abs(class_means[0] - class_means[1]).mean()
    assert between > 20 and within < 40
    assert set(labels.tolist()) == set(range(10))


@pytest.mark.parametrize("name, fmt",
                         [("mnist", "mnist-idx"), ("cifar10", "cifar10-python"), ("imagenet", "imagefolder")])
def test_open_by_path_detects_format(tmp_path, name, fmt):
    folder = write_synthetic(name, tmp_path, 4, 2)
    dataset, spec = open_dataset(str(folder), split="test")
    assert spec == DATASETS[name] and spec.format == fmt and len(dataset) == 2
    assert dataset[0][0].shape == spec.image_shape


def test_open_custom_imagefolder_derives_spec(tmp_path):
    root = _write_png_folder(tmp_path / "flowers", {"train": {"rose": 3, "tulip": 2}, "val": {"tulip": 1}})
    dataset, spec = open_dataset(str(root), split="test")
    assert (spec.name, spec.channels, spec.height, spec.width) == ("flowers", 3, 8, 8)
    assert (spec.num_classes, spec.train_size, spec.family) == (2, 5, "mnist")
    assert dataset.classes == ["rose", "tulip"] and dataset[0][1] == 1  # label from the union of classes


def test_write_synthetic_is_idempotent_and_never_overwrites_foreign_data(tmp_path):
    folder = write_synthetic("mnist", tmp_path, 5, 2)
    marker_mtime = (folder / MARKER_NAME).stat().st_mtime_ns
    write_synthetic("mnist", tmp_path, 5, 2)
    assert (folder / MARKER_NAME).stat().st_mtime_ns == marker_mtime
    write_synthetic("mnist", tmp_path, 9, 2)  # other arguments: replaced
    assert len(open_dataset("mnist", tmp_path, "train")[0]) == 9
    assert sorted(os.listdir(tmp_path)) == ["mnist"]  # no staging leftovers

    (tmp_path / "cifar10").mkdir()
    (tmp_path / "cifar10" / "mine.txt").write_text("real data")
    with pytest.raises(DatasetError, match="refusing"):
        write_synthetic("cifar10", tmp_path, 5, 2)
    assert (tmp_path / "cifar10" / "mine.txt").read_text() == "real data"
    with pytest.raises(UserError, match="materialize_digits"):
        write_synthetic("digits", tmp_path, 5, 2)


def test_interrupted_write_leaves_nothing(tmp_path, monkeypatch):
    real_save, calls = datasets._save_image, []

    def failing_save(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        real_save(*args, **kwargs)

    monkeypatch.setattr(datasets, "_save_image", failing_save)
    with pytest.raises(KeyboardInterrupt):
        write_synthetic("imagenet", tmp_path, 4, 1)
    assert os.listdir(tmp_path) == []


def test_concurrent_publisher_that_finished_first_wins(tmp_path):
    target = tmp_path / "digits"
    with datasets._atomic_folder(target, {"kind": "ours"}) as staging:
        (staging / "ours.txt").write_text("ours")
        target.mkdir()  # another process publishes a complete tree meanwhile
        (target / MARKER_NAME).write_text('{"kind": "theirs"}')
    assert json.loads((target / MARKER_NAME).read_text()) == {"kind": "theirs"}
    assert os.listdir(tmp_path) == ["digits"]


# ---------------------------------------------------------------- MNIST idx


def test_mnist_idx_reads_raw_and_gz(tmp_path):
    gz_folder = write_synthetic("mnist", tmp_path / "gz", 10, 4)
    raw_folder = tmp_path / "raw"
    raw_folder.mkdir()
    for path in gz_folder.glob("*.gz"):
        (raw_folder / path.stem).write_bytes(gzip.decompress(path.read_bytes()))
    for split in ("train", "test"):
        from_gz, from_raw = read_mnist_idx(gz_folder, split), read_mnist_idx(raw_folder, split)
        assert torch.equal(from_gz.images, from_raw.images) and torch.equal(from_gz.labels, from_raw.labels)
    assert from_raw.images.shape == (4, 1, 28, 28)


def _labels_idx(count: int) -> bytes:
    return (0x801).to_bytes(4, "big") + count.to_bytes(4, "big") + bytes(count)


@pytest.mark.parametrize("file, corrupt, message", [
    ("images", lambda data: b"\x00\x00\x08\x04" + data[4:], "magic"),
    ("images", lambda data: data[:-10], "bytes but header"),
    ("images", lambda data: data[:6], "truncated"),
    ("images", lambda data: b"\x1f\x8b not really gzip", "gzip"),
    ("labels", lambda data: _labels_idx(4), "4 labels"),
])
def test_corrupt_idx_raises_dataset_error_with_path(tmp_path, file, corrupt, message):
    folder = write_synthetic("mnist", tmp_path, 6, 2)
    gz_path = folder / f"train-{file}-idx{3 if file == 'images' else 1}-ubyte.gz"
    raw_path = gz_path.with_suffix("")
    raw_path.write_bytes(corrupt(gzip.decompress(gz_path.read_bytes())))
    gz_path.unlink()
    with pytest.raises(DatasetError, match=message) as caught:
        open_dataset("mnist", tmp_path, "train")
    assert str(folder) in str(caught.value)


def test_missing_dataset_folder_and_files(tmp_path):
    with pytest.raises(DatasetError, match=str(tmp_path / "mnist")):
        open_dataset("mnist", tmp_path, "train")
    (tmp_path / "mnist").mkdir()
    with pytest.raises(DatasetError, match="train-images-idx3-ubyte"):
        open_dataset("mnist", tmp_path, "train")


# ---------------------------------------------------------------- CIFAR-10


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


@pytest.mark.parametrize("corrupt, message", [
    (lambda path: path.write_bytes(b"not a pickle at all"), "cannot unpickle"),
    (lambda path: path.write_bytes(path.read_bytes()[:100]), "cannot unpickle"),
    (lambda path: path.write_bytes(pickle.dumps({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]})),
     "shape"),
    (lambda path: path.write_bytes(pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 10]})),
     "labels"),
    (lambda path: path.write_bytes(pickle.dumps([1, 2, 3])), "not a CIFAR-10 batch"),
    (lambda path: path.write_bytes(pickle.dumps({b"data": _Evil()})), "refusing"),
    (lambda path: path.unlink(), "missing"),
])
def test_corrupt_cifar_raises_dataset_error_with_path(tmp_path, corrupt, message):
    folder = write_synthetic("cifar10", tmp_path, 10, 2)
    batch = folder / "cifar-10-batches-py" / "data_batch_3"
    corrupt(batch)
    with pytest.raises(DatasetError, match=message) as caught:
        open_dataset("cifar10", tmp_path, "train")
    assert str(batch) in str(caught.value)


class _Python2Pickler(pickle._Pickler):
    """Writes bytes as Python 2 `str` opcodes, like the pickles in the official CIFAR-10 download."""

    dispatch = pickle._Pickler.dispatch.copy()

    def _save_py2_str(self, obj: bytes) -> None:
        self.write(pickle.BINSTRING + struct.pack("<i", len(obj)) + obj)
        self.memoize(obj)

    dispatch[bytes] = _save_py2_str


def test_cifar_reads_python2_pickles_of_the_official_download(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, (2, 3072), dtype=np.uint8)
    buffer = io.BytesIO()
    _Python2Pickler(buffer, protocol=2).dump({b"batch_label": b"x", b"labels": [7, 1], b"data": data})
    python2_pickle = buffer.getvalue().replace(b"numpy._core.multiarray", b"numpy.core.multiarray")
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        (tmp_path / name).write_bytes(python2_pickle)
    dataset = read_cifar10(tmp_path, "train")
    assert len(dataset) == 10 and dataset.labels[:2].tolist() == [7, 1]
    assert np.array_equal(dataset.images[:2].reshape(2, -1).numpy(), data)


def test_cifar_reader_accepts_batches_folder_itself(tmp_path):
    folder = write_synthetic("cifar10", tmp_path, 10, 3)
    direct = read_cifar10(folder / "cifar-10-batches-py", "test")
    assert direct.images.shape == (3, 3, 32, 32) and direct.labels.dtype == torch.int64


# ---------------------------------------------------------------- ImageFolder


def test_imagefolder_unreadable_file_raises_with_path(tmp_path):
    root = _write_png_folder(tmp_path, {"train": {"a": 2, "b": 1}})
    broken = root / "train" / "b" / "broken.jpg"
    broken.write_bytes(b"\xff\xd8 definitely not a jpeg")
    dataset = ImageFolderDataset(root, "train", 3, 8, 8)
    assert len(dataset) == 4 and dataset[0][0].shape == (3, 8, 8)
    with pytest.raises(DatasetError, match="cannot decode") as caught:
        _all_items(dataset)
    assert str(broken) in str(caught.value)


def test_imagefolder_decodes_to_spec_geometry(tmp_path):
    root = _write_png_folder(tmp_path, {"train": {"a": 1}, "test": {"a": 1}}, size=10)
    gray = ImageFolderDataset(root, "test", 1, 6, 4)
    image, label = gray[0]
    assert image.shape == (1, 6, 4) and image.dtype == torch.uint8 and label == 0


@pytest.mark.parametrize("layout, message", [
    ({"train": {}}, "no class folders"),
    ({"train": {"a": 0, "b": 0}}, "no image files"),
    ({"other": {"a": 1}}, "no train folder"),
])
def test_imagefolder_empty_or_missing_split(tmp_path, layout, message):
    root = _write_png_folder(tmp_path, layout)
    with pytest.raises(DatasetError, match=message) as caught:
        ImageFolderDataset(root, "train", 3, 8, 8)
    assert str(root) in str(caught.value)


# ---------------------------------------------------------------- names, splits, roots


def test_unknown_name_and_split_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="allowed: cifar10, digits, highres, imagenet, mnist") as caught:
        open_dataset("svhn", tmp_path, "train")
    assert not isinstance(caught.value, DatasetError)
    with pytest.raises(UserError, match="split"):
        open_dataset("mnist", tmp_path, "validation")
    with pytest.raises(DatasetError, match="no such dataset folder"):
        open_dataset(str(tmp_path / "nowhere"), tmp_path, "train")


def test_specs_and_default_root(monkeypatch, tmp_path):
    assert {name: spec.family for name, spec in DATASETS.items()} == {
        "mnist": "mnist", "cifar10": "cifar10", "imagenet": "imagenet", "highres": "highres", "digits": "mnist",
        "python-docs": "text"}
    assert DATASETS["imagenet"].image_shape == (3, 224, 224) and DATASETS["imagenet"].train_size == 1_280_000
    assert DATASETS["highres"].num_classes == 1000 and DATASETS["highres"].image_shape == (3, 512, 512)
    with pytest.raises(ValueError, match="channels"):
        datasets.DatasetSpec("x", "imagefolder", 2, 8, 8, 10, 100, "mnist")
    monkeypatch.setenv("DDLSCOPE_DATA", str(tmp_path))
    assert datasets.default_data_root() == tmp_path
    monkeypatch.delenv("DDLSCOPE_DATA")
    assert datasets.default_data_root() == Path.home() / ".cache" / "ddlscope" / "data"


# ---------------------------------------------------------------- digits


@pytest.fixture(scope="module")
def digits_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("data")
    materialize_digits(root)
    return root


def test_digits_materialized_real_images(digits_root):
    from sklearn.datasets import load_digits

    train, spec = open_dataset("digits", digits_root, "train")
    test, _ = open_dataset("digits", digits_root, "test")
    assert len(train) + len(test) == 1797 and len(train) == spec.train_size
    assert spec.image_shape == (1, 28, 28) and spec.family == "mnist"
    for split in (train, test):
        assert split.classes == [str(d) for d in range(10)] and set(split.labels.tolist()) == set(range(10))
    digits = load_digits()
    for index in range(0, len(test), 40):
        image, label = test[index]
        source = int(Path(test.samples[index][0]).stem)  # file name = index in load_digits()
        assert image.shape == (1, 28, 28) and image.dtype == torch.uint8 and image.max() > 200
        assert label == digits.target[source]
        assert torch.equal(image[0], torch.from_numpy(digit_to_mnist_geometry(digits.images[source])))
        assert image[0, :4].max() == 0 and image[0, :, -4:].max() == 0  # MNIST-like 4 pixel border


def test_digits_materialization_is_idempotent(digits_root):
    marker = digits_root / "digits" / MARKER_NAME
    before = marker.stat().st_mtime_ns
    assert materialize_digits(digits_root) == digits_root / "digits"
    open_dataset("digits", digits_root, "test")
    assert marker.stat().st_mtime_ns == before
    assert sorted(os.listdir(digits_root)) == ["digits"]


def test_digits_refuses_incomplete_tree(tmp_path):
    (tmp_path / "digits" / "train").mkdir(parents=True)
    with pytest.raises(DatasetError, match="not a complete digits tree"):
        materialize_digits(tmp_path)


def test_dataloader_workers_decode_with_spawn(digits_root):
    dataset, spec = open_dataset("digits", digits_root, "train", transform=train_transform(spec=DATASETS["digits"]))
    loader = torch.utils.data.DataLoader(dataset, batch_size=32, shuffle=True, num_workers=1,
                                         multiprocessing_context="spawn")
    images, labels = next(iter(loader))
    assert images.shape == (32, *spec.image_shape) and images.dtype == torch.float32
    assert labels.dtype == torch.int64 and labels.max() < spec.num_classes


# ---------------------------------------------------------------- transforms


def test_to_float_and_normalize_math():
    image = torch.full((3, 4, 5), 51, dtype=torch.uint8)
    as_float = ToFloat()(image)
    assert as_float.dtype == torch.float32 and torch.allclose(as_float, torch.full((3, 4, 5), 0.2))
    normalized = Normalize((0.1, 0.2, 0.4), (0.5, 0.25, 0.1))(as_float)
    assert normalized.shape == (3, 4, 5)
    assert torch.allclose(normalized[:, 0, 0], torch.tensor([0.2, 0.0, -2.0]))
    assert torch.allclose(Normalize((0.2,), (0.1,))(as_float), torch.zeros(3, 4, 5), atol=1e-6)
    with pytest.raises(TypeError):
        ToFloat()(as_float)
    with pytest.raises(TypeError):
        Normalize((0.5,), (0.5,))(image)
    with pytest.raises(ValueError):
        Normalize((0.5, 0.5), (0.5, 0.5))(as_float)


def test_random_crop_keeps_shape_and_takes_a_window():
    image = torch.arange(2 * 6 * 6, dtype=torch.uint8).view(2, 6, 6)
    padded = F.pad(image, (2, 2, 2, 2))
    crop = RandomCrop(6, padding=2)
    torch.manual_seed(0)
    outputs = [crop(image) for _ in range(30)]
    windows = [padded[:, t:t + 6, l:l + 6] for t in range(5) for l in range(5)]
    assert all(o.shape == image.shape and o.dtype == torch.uint8 for o in outputs)
    assert all(any(torch.equal(o, w) for w in windows) for o in outputs)
    assert len({o.numpy().tobytes() for o in outputs}) > 1
    assert torch.equal(RandomCrop((6, 6))(image), image)
    with pytest.raises(ValueError):
        RandomCrop(9, padding=1)(image)


def test_horizontal_flip():
    image = torch.arange(12, dtype=torch.uint8).view(1, 3, 4)
    assert torch.equal(RandomHorizontalFlip(p=1.0)(image), image[:, :, [3, 2, 1, 0]])
    assert torch.equal(RandomHorizontalFlip(p=0.0)(image), image)


@pytest.mark.parametrize("name", sorted(n for n, spec in DATASETS.items() if spec.format != datasets.TEXT))
def test_pipelines_per_dataset(name):
    spec = DATASETS[name]
    image = torch.randint(0, 256, spec.image_shape, dtype=torch.uint8)
    train, evaluation = train_transform(spec), eval_transform(spec)
    for transform in (train, evaluation, train_transform(spec, augment=False)):
        out = transform(image)
        assert out.shape == spec.image_shape and out.dtype == torch.float32
    flips = any(isinstance(t, RandomHorizontalFlip) for t in train.transforms)
    assert flips == (spec.family != "mnist")
    crop = train.transforms[0]
    expected_padding = {"mnist": 2, "cifar10": 4}.get(spec.family, spec.height // 8)
    assert isinstance(crop, RandomCrop) and crop.padding == expected_padding
    mean, std = normalization_stats(spec)
    assert len(mean) == len(std) == spec.channels
    constant = torch.full(spec.image_shape, 255, dtype=torch.uint8)
    expected = (1 - torch.tensor(mean)) / torch.tensor(std)
    assert torch.allclose(evaluation(constant)[:, 0, 0], expected)


def test_digits_use_mnist_statistics_and_transforms_pickle():
    assert normalization_stats(DATASETS["digits"]) == ((0.1307,), (0.3081,))
    transform = train_transform(DATASETS["cifar10"])
    restored = pickle.loads(pickle.dumps(transform))
    assert isinstance(restored, Compose) and len(restored.transforms) == len(transform.transforms)
    image = torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8)
    torch.manual_seed(7)
    first = transform(image)
    torch.manual_seed(7)
    assert torch.equal(restored(image), first)
