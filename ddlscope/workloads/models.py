"""Model zoo of the benchmark suite (thesis Appendix A), written in plain PyTorch.

Networks: ``resnet18``, ``resnet50``, ``resnet152``, ``vgg11``, ``vgg16``, ``mobilenet_v2`` and
``tiny_cnn`` (a ~4k-parameter CNN for tests), and the two networks with a mixture-of-experts layer
that the ``dmoe`` distribution model trains, ``moe_cnn`` (image families ``mnist``, ``digits``,
``cifar10``) and ``moe_lm`` (family ``text``): see :data:`MOE_NETWORKS`. Each CNN has a variant per
dataset family (see ``DATASET_FAMILIES``):

* small families (``mnist``, its alias ``digits``, ``cifar10``) get the CIFAR-style variants of
  the thesis: no early downsampling (3x3 stride-1 stems, no stem max pool), VGG pools skipped once
  the feature map is 1x1, global average pooling and a single linear classifier;
* large families (``imagenet``, ``highres``) get the standard ImageNet architectures; their
  parameter counts equal the usual reference models (resnet18 11,689,512; resnet50 25,557,032;
  resnet152 60,192,808; vgg11_bn 132,868,840; vgg16_bn 138,365,992; mobilenet_v2 3,504,872).

Layer layout: every zoo model is a :class:`SequentialNet` (an ``nn.Sequential``) whose top-level
children are, in order: the stem, one child per block (residual block, inverted-residual block,
or VGG conv/max-pool unit), ``pool`` (pooling + flatten, output ``(N, features)``) and
``classifier`` (output ``(N, num_classes)``). ``forward`` applies the children in order, so
``list(model.children())`` is a ready-made list of pipeline-parallel stage boundaries. The
mixture-of-experts networks follow the same layout with their own children (see
:data:`MOE_NETWORKS`), the whole mixture being one child named ``moe``.
"""

from __future__ import annotations

import importlib
from collections import OrderedDict
from dataclasses import dataclass
from functools import partial
from typing import Callable

from torch import nn

from ddlscope.errors import UserError

__all__ = [
    "DATASET_FAMILIES",
    "MOE_NETWORKS",
    "NETWORKS",
    "InputSpec",
    "SequentialNet",
    "build_model",
    "count_parameters",
    "input_spec",
]


@dataclass(frozen=True)
class InputSpec:
    """Geometry of a dataset family: inputs are ``(N, channels, height, width)``, logits ``(N, num_classes)``."""

    channels: int
    height: int
    width: int
    num_classes: int


DATASET_FAMILIES: dict[str, InputSpec] = {
    "mnist": InputSpec(1, 28, 28, 10),
    "digits": InputSpec(1, 28, 28, 10),  # alias of the mnist geometry
    "cifar10": InputSpec(3, 32, 32, 10),
    "imagenet": InputSpec(3, 224, 224, 1000),
    "highres": InputSpec(3, 512, 512, 1000),
}
_SMALL_FAMILIES = frozenset({"mnist", "digits", "cifar10"})


class SequentialNet(nn.Sequential):
    """Base class of every zoo model: ``forward(x)`` applies the top-level children in order.

    Children (named): stem, blocks, ``pool`` -> ``(N, features)``, ``classifier`` -> ``(N, classes)``.
    Any contiguous run of ``list(model.children())`` is a valid pipeline stage.
    """


# --------------------------------------------------------------------------- shared layers


def conv_bn(
    in_ch: int,
    out_ch: int,
    kernel: int = 3,
    stride: int = 1,
    groups: int = 1,
    act: Callable[..., nn.Module] | None = nn.ReLU,
    bias: bool = False,
) -> nn.Sequential:
    """Conv ("same" padding) + BatchNorm (+ activation unless ``act`` is None)."""
    layers: list[nn.Module] = [
        nn.Conv2d(in_ch, out_ch, kernel, stride, padding=kernel // 2, groups=groups, bias=bias),
        nn.BatchNorm2d(out_ch),
    ]
    if act is not None:
        layers.append(act(inplace=True))
    return nn.Sequential(*layers)


def _global_pool() -> nn.Sequential:
    """(N, C, H, W) -> (N, C) by averaging over all positions (works for any H, W)."""
    return nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())


# --------------------------------------------------------------------------- ResNet


class _ResidualBlock(nn.Module):
    """``relu(body(x) + shortcut(x))``; subclasses fill in ``body`` and set ``expansion``."""

    expansion = 1

    def __init__(self, in_ch: int, width: int, stride: int) -> None:
        super().__init__()
        out_ch = width * self.expansion
        self.body = self._make_body(in_ch, width, out_ch, stride)
        if stride == 1 and in_ch == out_ch:
            self.shortcut: nn.Module = nn.Identity()
        else:  # projection shortcut: 1x1 conv with the block's stride
            self.shortcut = conv_bn(in_ch, out_ch, 1, stride, act=None)
        self.relu = nn.ReLU(inplace=True)

    def _make_body(self, in_ch: int, width: int, out_ch: int, stride: int) -> nn.Sequential:
        raise NotImplementedError

    def forward(self, x):
        return self.relu(self.body(x) + self.shortcut(x))


class BasicBlock(_ResidualBlock):
    """Two 3x3 convs (ResNet-18/34); the first carries the stride."""

    expansion = 1

    def _make_body(self, in_ch: int, width: int, out_ch: int, stride: int) -> nn.Sequential:
        return nn.Sequential(conv_bn(in_ch, width, 3, stride), conv_bn(width, out_ch, 3, act=None))


class Bottleneck(_ResidualBlock):
    """1x1 reduce, 3x3 (with the stride), 1x1 expand by 4 (ResNet-50/101/152)."""

    expansion = 4

    def _make_body(self, in_ch: int, width: int, out_ch: int, stride: int) -> nn.Sequential:
        return nn.Sequential(
            conv_bn(in_ch, width, 1),
            conv_bn(width, width, 3, stride),
            conv_bn(width, out_ch, 1, act=None),
        )


def _resnet(
    block: type[_ResidualBlock], depths: tuple[int, ...], spec: InputSpec, small: bool, num_classes: int
) -> SequentialNet:
    parts: OrderedDict[str, nn.Module] = OrderedDict()
    if small:  # 3x3 stride-1 stem, no max pool: 28x28 -> stages at 28, 14, 7, 4
        parts["stem"] = conv_bn(spec.channels, 64, 3, 1)
    else:  # 7x7 stride-2 stem + 3x3 stride-2 max pool: 224x224 -> stages at 56, 28, 14, 7
        parts["stem"] = nn.Sequential(*conv_bn(spec.channels, 64, 7, 2), nn.MaxPool2d(3, 2, padding=1))
    in_ch = 64
    for stage, (width, depth) in enumerate(zip((64, 128, 256, 512), depths), start=1):
        for i in range(depth):
            stride = 2 if stage > 1 and i == 0 else 1
            parts[f"layer{stage}_{i}"] = block(in_ch, width, stride)
            in_ch = width * block.expansion
    parts["pool"] = _global_pool()
    parts["classifier"] = nn.Linear(in_ch, num_classes)
    return SequentialNet(parts)


# --------------------------------------------------------------------------- VGG

_VGG11 = (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")
_VGG16 = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")


def _vgg(config: tuple[int | str, ...], spec: InputSpec, small: bool, num_classes: int) -> SequentialNet:
    parts: OrderedDict[str, nn.Module] = OrderedDict()
    in_ch, height, width = spec.channels, spec.height, spec.width
    n_conv = n_pool = 0
    for item in config:
        if item == "M":
            if small and min(height, width) < 2:  # thesis: mnist 28->14->7->3->1, last pool skipped
                continue
            n_pool += 1
            parts[f"maxpool{n_pool}"] = nn.MaxPool2d(2, 2)
            height, width = height // 2, width // 2
        else:
            n_conv += 1
            parts[f"conv{n_conv}"] = conv_bn(in_ch, int(item), 3, bias=True)
            in_ch = int(item)
    if small:
        parts["pool"] = _global_pool()
        parts["classifier"] = nn.Linear(in_ch, num_classes)
    else:
        parts["pool"] = nn.Sequential(nn.AdaptiveAvgPool2d((7, 7)), nn.Flatten())
        parts["classifier"] = nn.Sequential(
            nn.Linear(in_ch * 7 * 7, 4096), nn.ReLU(inplace=True), nn.Dropout(),
            nn.Linear(4096, 4096), nn.ReLU(inplace=True), nn.Dropout(),
            nn.Linear(4096, num_classes),
        )  # fmt: skip
    return SequentialNet(parts)


# --------------------------------------------------------------------------- MobileNetV2

# (expansion t, output channels c, repeats n) per stage; strides per variant below.
_MBV2_STAGES = ((1, 16, 1), (6, 24, 2), (6, 32, 3), (6, 64, 4), (6, 96, 3), (6, 160, 3), (6, 320, 1))
_MBV2_STRIDES = {
    False: (1, 2, 2, 2, 1, 2, 1),  # standard (imagenet, highres); stem stride 2
    True: (1, 1, 2, 2, 1, 2, 1),  # thesis Tables A.4/A.7 (mnist, cifar10); stem stride 1
}


class InvertedResidual(nn.Module):
    """1x1 expand (skipped when t == 1), 3x3 depthwise (with the stride), 1x1 linear projection.

    Adds the input back when the stride is 1 and the channel count is unchanged.
    """

    def __init__(self, in_ch: int, out_ch: int, stride: int, expansion: int) -> None:
        super().__init__()
        hidden = in_ch * expansion
        layers = [] if expansion == 1 else [conv_bn(in_ch, hidden, 1, act=nn.ReLU6)]
        layers += [
            conv_bn(hidden, hidden, 3, stride, groups=hidden, act=nn.ReLU6),
            conv_bn(hidden, out_ch, 1, act=None),
        ]
        self.body = nn.Sequential(*layers)
        self.use_residual = stride == 1 and in_ch == out_ch

    def forward(self, x):
        out = self.body(x)
        return x + out if self.use_residual else out


def _mobilenet_v2(spec: InputSpec, small: bool, num_classes: int) -> SequentialNet:
    parts: OrderedDict[str, nn.Module] = OrderedDict()
    parts["stem"] = conv_bn(spec.channels, 32, 3, 1 if small else 2, act=nn.ReLU6)
    in_ch = 32
    for stage, ((t, c, n), s) in enumerate(zip(_MBV2_STAGES, _MBV2_STRIDES[small]), start=1):
        for i in range(n):
            parts[f"block{stage}_{i}"] = InvertedResidual(in_ch, c, s if i == 0 else 1, t)
            in_ch = c
    parts["conv_last"] = conv_bn(in_ch, 1280, 1, act=nn.ReLU6)
    parts["pool"] = _global_pool()
    parts["classifier"] = nn.Sequential(nn.Dropout(0.2), nn.Linear(1280, num_classes))
    return SequentialNet(parts)


# --------------------------------------------------------------------------- tiny CNN


def _tiny_cnn(spec: InputSpec, small: bool, num_classes: int) -> SequentialNet:
    """Two 3x3 convs (8 and 16 channels, the second stride 2), 4x4 adaptive pool, linear; any input size."""
    del small  # one layout for all families
    return SequentialNet(
        OrderedDict(
            conv1=nn.Sequential(nn.Conv2d(spec.channels, 8, 3, padding=1), nn.ReLU(inplace=True)),
            conv2=nn.Sequential(nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU(inplace=True)),
            pool=nn.Sequential(nn.AdaptiveAvgPool2d(4), nn.Flatten()),
            classifier=nn.Linear(16 * 4 * 4, num_classes),
        )
    )


# --------------------------------------------------------------------------- public API

_BUILDERS: dict[str, Callable[[InputSpec, bool, int], SequentialNet]] = {
    "resnet18": partial(_resnet, BasicBlock, (2, 2, 2, 2)),
    "resnet50": partial(_resnet, Bottleneck, (3, 4, 6, 3)),
    "resnet152": partial(_resnet, Bottleneck, (3, 8, 36, 3)),
    "vgg11": partial(_vgg, _VGG11),
    "vgg16": partial(_vgg, _VGG16),
    "mobilenet_v2": _mobilenet_v2,
    "tiny_cnn": _tiny_cnn,
}

MOE_NETWORKS: tuple[str, ...] = ("moe_cnn", "moe_lm")
"""Zoo networks with a mixture-of-experts layer (:mod:`ddlscope.moe.networks`), built with the
experts held in-process (``placement = "local"``) and the zoo's ``[dmoe]`` settings
(:func:`ddlscope.distribution.dmoe.zoo_config`: the table's defaults, with ``transformer`` experts
for ``moe_lm``), so that the profiler measures the network the ``dmoe`` cost model reads. As
:class:`SequentialNet` with the forward order of children:

* ``moe_cnn``: ``trunk`` (convolutions to ``[N, hidden]``), ``moe`` (the mixture), ``head``
  (``[N, classes]``);
* ``moe_lm``: ``embed`` (byte ids ``[N, 128]`` -> embeddings plus positions ``[N, 128, hidden]``),
  ``moe`` (the mixture of ``transformer`` experts, with an all-False padding mask), ``norm``,
  ``head`` (logits ``[N, 128, 256]``).

The children are the very modules :func:`ddlscope.moe.networks.build_moe_network` builds (same
parameters, same initialisation), re-ordered so that applying them in turn is the forward pass."""

NETWORKS: tuple[str, ...] = tuple(_BUILDERS) + MOE_NETWORKS


def input_spec(family: str) -> InputSpec:
    """Input geometry and class count of a dataset family.

    Raises:
        UserError: ``family`` is not a key of ``DATASET_FAMILIES``; the message lists the allowed ones.
    """
    try:
        return DATASET_FAMILIES[family]
    except (KeyError, TypeError):
        raise UserError(
            f"unknown dataset family {family!r}; allowed: {', '.join(DATASET_FAMILIES)}"
        ) from None


def build_model(name: str, family: str, num_classes: int | None = None,
                input_shape: tuple[int, int, int] | None = None) -> nn.Module:
    """Build a freshly initialised model for one dataset family.

    Args:
        name: a zoo network from ``NETWORKS``, or a user factory ``"package.module:function"``.
            The factory is called as ``function(num_classes=<int>, in_channels=<int>)``, plus
            ``image_size=(height, width)`` when it takes an ``image_size`` parameter (or
            ``**kwargs``), and must return an ``nn.Module`` mapping ``(N, in_channels, H, W)`` to
            ``(N, num_classes)``; exceptions raised inside it propagate unchanged.
        family: a key of ``DATASET_FAMILIES``; picks the variant and the input geometry.
        num_classes: overrides the family's class count when given.
        input_shape: ``(channels, height, width)`` of the dataset's samples, for a user factory
            (default: the family's); zoo networks take the family's geometry.

    Returns:
        The model (zoo models are :class:`SequentialNet`) on the current default device, mapping
        ``(N, C, H, W)`` of the family's geometry to logits ``(N, num_classes)``.

    Raises:
        UserError: unknown network or family (or a family the network does not take: the
            networks of :data:`MOE_NETWORKS` take their own, ``moe_lm`` the ``text`` family),
            ``num_classes`` not a positive int, a factory string that is malformed, cannot be
            imported or names no callable, or a factory that returns something other than an
            ``nn.Module``.
    """
    if isinstance(name, str) and name in MOE_NETWORKS:
        return _build_moe(name, family, num_classes)
    spec = input_spec(family)
    classes = spec.num_classes if num_classes is None else num_classes
    if isinstance(classes, bool) or not isinstance(classes, int) or classes < 1:
        raise UserError(f"num_classes must be a positive integer, got {num_classes!r}")
    if isinstance(name, str) and ":" in name:
        channels, height, width = input_shape or (spec.channels, spec.height, spec.width)
        return _build_user_model(name, channels, classes, (height, width))
    builder = _BUILDERS.get(name) if isinstance(name, str) else None
    if builder is None:
        raise UserError(
            f"unknown network {name!r}; allowed: {', '.join(NETWORKS)}, "
            "or a user factory 'package.module:function'"
        )
    model = builder(spec, family in _SMALL_FAMILIES, classes)
    _init_weights(model)
    return model


class _Embed(nn.Module):
    """``moe_lm``'s input child: byte ids ``[N, T]`` -> ``embed(ids) + positions[:, :T]`` ``[N, T, hidden]``."""

    def __init__(self, embed: nn.Embedding, positions: nn.Parameter) -> None:
        super().__init__()
        self.embed = embed
        self.positions = positions

    def forward(self, x):
        return self.embed(x) + self.positions[:, : x.shape[1]]


class _SequenceMixture(nn.Module):
    """``moe_lm``'s mixture child: ``mixture(h, padding)`` with an all-False ``[N, T]`` padding mask
    (nothing padded), as :class:`ddlscope.moe.networks.MoELanguageModel` calls it."""

    def __init__(self, mixture: nn.Module) -> None:
        super().__init__()
        self.mixture = mixture

    def forward(self, h):
        import torch

        return self.mixture(h, torch.zeros(h.shape[:2], dtype=torch.bool, device=h.device))


def _build_moe(name: str, family: str, num_classes: int | None) -> SequentialNet:
    """A network of :data:`MOE_NETWORKS` as a :class:`SequentialNet` (see there).

    Raises:
        UserError: ``num_classes`` not a positive int, or a family the network does not take
            (:func:`ddlscope.moe.networks.network_family_ok`; e.g. ``moe_cnn`` on ``imagenet``).
    """
    from ddlscope.distribution.dmoe import zoo_config
    from ddlscope.moe.networks import build_moe_network, network_family_ok

    why = network_family_ok(name, family)
    if why:
        raise UserError(why)
    classes = num_classes
    if classes is None:  # moe_lm predicts byte values whatever it is given
        classes = DATASET_FAMILIES[family].num_classes if family in DATASET_FAMILIES else 256
    if isinstance(classes, bool) or not isinstance(classes, int) or classes < 1:
        raise UserError(f"num_classes must be a positive integer, got {num_classes!r}")
    net = build_moe_network(name, family, classes, zoo_config(name))
    if hasattr(net, "trunk"):  # moe_cnn
        parts = OrderedDict(trunk=net.trunk, moe=net.moe, head=net.head)
    else:  # moe_lm
        parts = OrderedDict(embed=_Embed(net.embed, net.positions), moe=_SequenceMixture(net.moe), norm=net.norm,
                            head=net.head)
    return SequentialNet(parts)


def network_takes(name: str, family: str) -> str | None:
    """Why zoo network ``name`` cannot train on a dataset of ``family`` (None: it can, or ``name``
    is a user factory, which only building it can tell). The CNNs take the image families of
    :data:`DATASET_FAMILIES`; the mixture-of-experts networks those of
    :func:`ddlscope.moe.networks.network_family_ok`. The reason names ``model`` and what is allowed."""
    if ":" in name or name not in NETWORKS:
        return None
    if name in MOE_NETWORKS:
        from ddlscope.moe.networks import network_family_ok

        return network_family_ok(name, family)
    if family not in DATASET_FAMILIES:
        fitting = [n for n in MOE_NETWORKS if _moe_takes(n, family)]
        return (f"model = {name!r} takes image datasets (families {', '.join(DATASET_FAMILIES)}), not {family!r} "
                f"ones; allowed for {family!r}: {', '.join(fitting) or 'none of the zoo'}")
    return None


def _moe_takes(name: str, family: str) -> bool:
    from ddlscope.moe.networks import network_family_ok

    return network_family_ok(name, family) is None


def count_parameters(model: nn.Module) -> int:
    """Total number of parameter elements (trainable or not); works for models on the meta device."""
    return sum(p.numel() for p in model.parameters())


def _build_user_model(target: str, in_channels: int, num_classes: int,
                      image_size: tuple[int, int] | None = None) -> nn.Module:
    from ddlscope.workloads.factories import ALLOWED, accepts_keyword

    module_name, _, attr = target.partition(":")
    if not module_name or not attr or ":" in attr:
        raise UserError(f"bad model factory {target!r}; expected 'package.module:function'")
    if module_name == "__main__":
        raise UserError(f"model factory {target!r} names the script being run (__main__): ddlscope's workers are "
                        f"separate processes and cannot import it; {ALLOWED}")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any failure while importing user code is the user's to fix
        raise UserError(f"cannot import model factory {target!r}: {type(exc).__name__}: {exc}") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise UserError(f"model factory {target!r}: module {module_name!r} has no callable {attr!r}")
    kwargs: dict = dict(num_classes=num_classes, in_channels=in_channels)
    if image_size is not None and accepts_keyword(factory, "image_size"):
        kwargs["image_size"] = tuple(image_size)
    model = factory(**kwargs)
    if not isinstance(model, nn.Module):
        raise UserError(f"model factory {target!r} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def _init_weights(model: nn.Module) -> None:
    """He init for convs, unit/zero BatchNorm, small normal for linear layers, zero biases."""
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
        elif isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0.0, 0.01)
        else:
            continue
        if m.bias is not None:
            nn.init.zeros_(m.bias)
