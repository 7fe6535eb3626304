"""Networks with a mixture-of-experts layer (``net.moe``) for the ``dmoe`` distribution model.

* ``moe_cnn`` (image families ``mnist``, ``digits``, ``cifar10``): conv 3x3 (16) + ReLU + max
  pool 2, conv 3x3 (32) + ReLU + max pool 2, adaptive average pool to 4x4, flatten,
  Linear(512, H) + ReLU, the mixture on ``[batch, H]``, Linear(H, classes). Experts: ``ffn`` or a
  user factory (``[batch, H]`` in and out).
* ``moe_lm`` (family ``text``, e.g. ``python-docs``): a byte-level masked language model:
  Embedding(257, H) (256 byte values and the mask id) plus learned positions for
  ``TRANSFORMER_SEQUENCE_LENGTH`` = 128 positions, the mixture of ``transformer`` experts on
  ``[batch, 128, H]`` with an all-False ``[batch, 128]`` padding mask as second argument,
  LayerNorm, Linear(H, 256) -> logits ``[batch, 128, 256]``.

The mixture is hivemind's ``RemoteMixtureOfExperts`` (``dmoe.placement = "remote"``, built by the
strategy and passed in), :class:`~ddlscope.moe.layers.LocalMixtureOfExperts` (``"local"``) or
:class:`~ddlscope.moe.layers.DenseExpert` (``"dense"``). Only the dmoe strategy builds these
networks; the model zoo (``ddlscope.workloads.models``) does not list them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ddlscope.distribution.dmoe import TRANSFORMER_SEQUENCE_LENGTH
from ddlscope.errors import UserError
from ddlscope.moe.experts import expert_seed, make_expert
from ddlscope.moe.layers import DenseExpert, LocalMixtureOfExperts
from ddlscope.workloads.models import DATASET_FAMILIES
from ddlscope.workloads.text import MASK_TOKEN, SEQUENCE_LENGTH, TEXT_FAMILY, VOCAB_SIZE

if TYPE_CHECKING:
    from ddlscope.distribution.dmoe import DMoEConfig

MOE_NETWORKS: tuple[str, ...] = ("moe_cnn", "moe_lm")
"""Networks the ``dmoe`` model trains (``model`` of a dmoe run)."""

MOE_CNN_FAMILIES: tuple[str, ...] = ("mnist", "digits", "cifar10")
"""Image families ``moe_cnn`` takes (input geometry from ``ddlscope.workloads.models.DATASET_FAMILIES``)."""

_SEQUENCE_EXPERT = "transformer"
_NETWORK_FAMILIES = {"moe_cnn": MOE_CNN_FAMILIES, "moe_lm": (TEXT_FAMILY,)}

if SEQUENCE_LENGTH != TRANSFORMER_SEQUENCE_LENGTH:  # the text windows must fit the transformer expert's schema
    raise ImportError(f"text windows of {SEQUENCE_LENGTH} bytes, transformer expert of {TRANSFORMER_SEQUENCE_LENGTH}")


def network_family_ok(name: str, family: str, expert: str | None = None) -> str | None:
    """Why network ``name`` cannot train on a dataset of ``family`` with ``expert`` (None: it can).

    ``moe_cnn`` takes the image families of :data:`MOE_CNN_FAMILIES` with ``ffn`` or user-factory
    experts; ``moe_lm`` takes ``text`` datasets with ``transformer`` experts. ``expert`` None
    checks the family only. The reason names ``model`` / ``dmoe.expert`` and what is allowed.
    """
    if name not in MOE_NETWORKS:
        return f"model = {name!r}: the dmoe model trains a network with a mixture-of-experts layer; " \
               f"allowed: {', '.join(MOE_NETWORKS)}"
    families = _NETWORK_FAMILIES[name]
    if family not in families:
        fitting = [n for n, f in _NETWORK_FAMILIES.items() if family in f]
        hint = f" (for {family!r} datasets use model = {fitting[0]!r})" if fitting else ""
        return f"model = {name!r} does not take a dataset of family {family!r}; allowed families: " \
               f"{', '.join(families)}{hint}"
    if expert is not None:
        sequence = name == "moe_lm"
        if sequence and expert != _SEQUENCE_EXPERT:
            return f"dmoe.expert = {expert!r} does not fit model = {name!r} (its experts take [batch, " \
                   f"{TRANSFORMER_SEQUENCE_LENGTH}, hidden] sequences); allowed: {_SEQUENCE_EXPERT!r}"
        if not sequence and expert == _SEQUENCE_EXPERT:
            return f"dmoe.expert = {expert!r} does not fit model = {name!r} (its experts take [batch, hidden]); " \
                   f"allowed: 'ffn' or 'package.module:factory'"
    return None


def build_moe_network(name: str, family: str, num_classes: int, dmoe: "DMoEConfig", mixture: nn.Module | None = None,
                      seed: int | None = None) -> nn.Module:
    """The network ``name`` with its mixture-of-experts layer as ``net.moe``.

    Args:
        name: ``moe_cnn`` or ``moe_lm``.
        family: the dataset's family (``DatasetSpec.family``).
        num_classes: classes of ``moe_cnn``'s head (``moe_lm`` predicts 256 byte values).
        dmoe: the run's ``[dmoe]`` settings (expert, hidden_dim, grid_size, k_best, placement).
        mixture: the mixture layer to use (the strategy's ``RemoteMixtureOfExperts`` for
            placement ``remote``); None builds it from ``dmoe.placement``: ``local`` ->
            :class:`LocalMixtureOfExperts` with one :func:`make_expert` per id of
            ``dmoe.expert_uids()``, ``dense`` -> :class:`DenseExpert`.
        seed: None: the experts' parameters come from the global torch generator (the training
            loop seeds it with ``cfg.seed``, so all trainers start equal); an int: expert ``uid``
            is initialised from :func:`~ddlscope.moe.experts.expert_seed` ``(seed, uid)`` (the
            dense expert as the grid's first), as the expert servers initialise theirs, without
            drawing from the global generator.

    Construction order: the mixture (its gate ``proj`` first), then the trunk and the head, so
    with ``seed`` given a ``local`` network starts with the same parameters as a ``remote`` one
    built from the same generator state.

    Raises:
        UserError: the network does not take ``family`` or ``dmoe.expert`` (see
            :func:`network_family_ok`), what :func:`make_expert` raises, or placement ``remote``
            without a ``mixture``.
    """
    why = network_family_ok(name, family, dmoe.expert)
    if why:
        raise UserError(why)
    if mixture is None:
        mixture = _build_mixture(dmoe, seed)
    if name == "moe_lm":
        return MoELanguageModel(mixture, dmoe.hidden_dim)
    return MoEConvNet(mixture, DATASET_FAMILIES[family].channels, dmoe.hidden_dim, num_classes)


def _build_mixture(dmoe: "DMoEConfig", seed: int | None) -> nn.Module:
    uids = dmoe.expert_uids()

    def expert(uid: str) -> nn.Module:
        if seed is None:
            return make_expert(dmoe.expert, dmoe.hidden_dim)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(expert_seed(seed, uid))
            return make_expert(dmoe.expert, dmoe.hidden_dim)

    if dmoe.placement == "dense":
        return DenseExpert(expert(uids[0]))
    if dmoe.placement == "local":
        return LocalMixtureOfExperts(dmoe.hidden_dim, dmoe.grid_size, expert, dmoe.k_best)
    raise UserError(f"dmoe.placement = {dmoe.placement!r}: the mixture of remote experts comes from the dmoe "
                    "strategy (it joins the expert servers); allowed without it: 'local', 'dense'")


class MoEConvNet(nn.Module):
    """``moe_cnn``: images ``[batch, C, H, W]`` -> class logits ``[batch, classes]`` (see the module).

    Attributes: ``trunk`` (convolutions to ``[batch, hidden]``), ``moe`` (the mixture), ``head``.
    """

    def __init__(self, mixture: nn.Module, in_channels: int, hidden_dim: int, num_classes: int):
        super().__init__()
        self.moe = mixture
        self.trunk = nn.Sequential(
            nn.Conv2d(in_channels, 16, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(32 * 4 * 4, hidden_dim), nn.ReLU(inplace=True))
        self.head = nn.Linear(hidden_dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.moe(self.trunk(x)))


class MoELanguageModel(nn.Module):
    """``moe_lm``: byte ids ``[batch, T]`` (0..255 and ``MASK_TOKEN``, ``T <= 128``) -> logits
    ``[batch, T, 256]`` (see the module). Positions are initialised N(0, 0.02^2).

    Attributes: ``embed``, ``positions`` (``[1, 128, hidden]``), ``moe`` (the mixture), ``norm``, ``head``.
    """

    def __init__(self, mixture: nn.Module, hidden_dim: int):
        super().__init__()
        self.moe = mixture
        self.embed = nn.Embedding(MASK_TOKEN + 1, hidden_dim)
        self.positions = nn.Parameter(torch.randn(1, TRANSFORMER_SEQUENCE_LENGTH, hidden_dim) * 0.02)
        self.norm = nn.LayerNorm(hidden_dim)
        self.head = nn.Linear(hidden_dim, VOCAB_SIZE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.positions[:, :x.shape[1]]
        padding = torch.zeros(x.shape, dtype=torch.bool, device=x.device)  # nothing padded
        return self.head(self.norm(self.moe(h, padding)))
