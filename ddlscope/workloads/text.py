"""``python-docs``: a byte-level text corpus that ships with every Python, so nothing is downloaded.

The corpus is CPython's documentation topics (``pydoc_data.topics.topics``: the texts ``help()``
shows, about 80 topics and 0.47 MB of UTF-8 on Python 3.11; the exact text, and so the sizes
below, follow the running Python's version).

Objective: masked-byte prediction. Each topic's text is split by byte position, its first
``1 - TEST_FRACTION`` to the training split and the rest to the test split; a split's parts are
joined (topics in sorted name order, separated by a blank line) and cut into non-overlapping
windows of ``SEQUENCE_LENGTH`` bytes. In every window ``MASKED_PER_WINDOW`` positions are
replaced by ``MASK_TOKEN``; the target is the original byte at those positions and
``IGNORE_INDEX`` everywhere else, so the loss and the accuracy count only the masked bytes.

Why not next-byte prediction: the mixture's ``transformer`` experts (hivemind's
``TunedTransformer``) attend in both directions and accept only a key-padding mask, no causal
mask, so with targets ``x[t + 1]`` every position could read its answer from its right
neighbour. Masked positions carry no trace of their byte, so nothing leaks.

Masks: the test split's are fixed per window (seeded by the window index), so every evaluation
scores the same bytes; the training split draws new positions at each access from the global
torch generator (like the image augmentations; "dynamic masking", Liu et al. 2019, RoBERTa).
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch.utils.data import Dataset

from ddlscope.workloads.step import IGNORE_INDEX

PYTHON_DOCS = "python-docs"
"""Name of the bundled corpus (a key of ``ddlscope.workloads.datasets.DATASETS``)."""

TEXT_FAMILY = "text"
"""Model family of byte-level text datasets (networks that take ``[batch, SEQUENCE_LENGTH]`` byte ids)."""

SEQUENCE_LENGTH = 128
"""Bytes per window; equals hivemind's ``transformer`` expert's declared sequence length."""

VOCAB_SIZE = 256
"""Byte values, i.e. the classes a model predicts at each masked position."""

MASK_TOKEN = 256
"""Input id that replaces a masked byte, so inputs take ``VOCAB_SIZE + 1`` values (embedding size)."""

MASKED_PER_WINDOW = 19
"""Masked positions per window: 15 % of ``SEQUENCE_LENGTH`` rounded down (BERT's rate, Devlin et al. 2019)."""

TEST_FRACTION = 0.1
"""Share of each topic's bytes (its end) that goes to the test split."""

_TOPIC_SEPARATOR = b"\n\n"
_TEST_MASK_SEED = 0x7E57


@functools.lru_cache(maxsize=None)
def corpus_split(split: str) -> bytes:
    """The UTF-8 bytes of one split of ``python-docs``.

    Each topic ``t`` (sorted by name) of ``n`` bytes gives ``[0, floor(0.9 n))`` to ``train`` and
    the rest to ``test``; a split is its parts joined by a blank line.

    Raises:
        ValueError: ``split`` other than ``"train"`` or ``"test"``.
    """
    from pydoc_data.topics import topics  # CPython's own docs, in the standard library

    if split not in ("train", "test"):
        raise ValueError(f"unknown split {split!r}; allowed: train, test")
    parts = []
    for name in sorted(topics):
        text = topics[name].encode("utf-8")
        cut = int(len(text) * (1 - TEST_FRACTION))
        parts.append(text[:cut] if split == "train" else text[cut:])
    return _TOPIC_SEPARATOR.join(parts)


def window_count(split: str) -> int:
    """Windows of ``SEQUENCE_LENGTH`` bytes in a split of ``python-docs`` (its dataset's length)."""
    return len(corpus_split(split)) // SEQUENCE_LENGTH


class MaskedByteWindows(Dataset):
    """Non-overlapping byte windows with masked positions to predict.

    Args:
        data: the text's bytes; the last ``len(data) % length`` bytes are not used.
        length: window length in bytes (>= 1).
        masked: masked positions per window, ``1 .. length``.
        fixed_masks: True: window ``i``'s positions are drawn from a generator seeded with
            ``(seed, i)`` (the same at every access); False: drawn from the global torch
            generator at every access.
        seed: base seed of the fixed masks.
        transform: optional callable applied to the input ``x``.

    Items are ``(x, y)``, both ``torch.int64 [length]``: ``x`` the window's bytes (0..255) with
    ``MASK_TOKEN`` at the masked positions; ``y`` the original byte at the masked positions and
    ``IGNORE_INDEX`` elsewhere.

    Raises:
        ValueError: a length or mask count out of range.
    """

    def __init__(self, data: bytes, length: int = SEQUENCE_LENGTH, masked: int = MASKED_PER_WINDOW,
                 fixed_masks: bool = True, seed: int = _TEST_MASK_SEED, transform=None):
        if length < 1 or not 1 <= masked <= length:
            raise ValueError(f"need length >= 1 and 1 <= masked <= length, got length={length}, masked={masked}")
        windows = len(data) // length
        self.bytes = torch.frombuffer(bytearray(data[:windows * length]), dtype=torch.uint8).view(windows, length)
        self.length, self.masked, self.fixed_masks, self.seed = length, masked, fixed_masks, seed
        self.transform = transform

    def __len__(self) -> int:
        return self.bytes.shape[0]

    def mask_positions(self, index: int) -> torch.Tensor:
        """The masked positions of window ``index`` (int64 ``[masked]``, sorted); with random
        masks a new draw at every call."""
        if self.fixed_masks:
            rng = np.random.default_rng([self.seed, index])
            positions = torch.from_numpy(rng.choice(self.length, self.masked, replace=False))
        else:
            positions = torch.randperm(self.length)[:self.masked]
        return positions.sort().values

    def __getitem__(self, index: int) -> tuple[object, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"window {index} out of range (0..{len(self) - 1})")
        original = self.bytes[index].to(torch.int64)
        positions = self.mask_positions(index % len(self))
        x = original.clone()
        x[positions] = MASK_TOKEN
        y = torch.full_like(original, IGNORE_INDEX)
        y[positions] = original[positions]
        return (self.transform(x) if self.transform else x), y


def python_docs(split: str, transform=None) -> MaskedByteWindows:
    """One split of ``python-docs`` as :class:`MaskedByteWindows` (test: fixed masks; train: new
    masks at every access).

    Raises:
        ValueError: unknown split.
    """
    return MaskedByteWindows(corpus_split(split), fixed_masks=split == "test", transform=transform)
