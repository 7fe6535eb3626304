"""Tests for ddlscope.workloads.models (the thesis Appendix A model zoo).

Small-family variants run on real tensors; imagenet/highres variants are built and run on the
meta device, so nothing large is allocated and the file stays fast on 2 CPU cores.
"""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch
from torch import nn

from ddlscope.errors import UserError
from ddlscope.workloads.models import (
    DATASET_FAMILIES,
    NETWORKS,
    InputSpec,
    SequentialNet,
    build_model,
    count_parameters,
    input_spec,
)

SMALL_FAMILIES = ("mnist", "digits", "cifar10")
LARGE_FAMILIES = ("imagenet", "highres")
ZOO = ("resnet18", "resnet50", "resnet152", "vgg11", "vgg16", "mobilenet_v2", "tiny_cnn")


def _run(model: nn.Module, spec: InputSpec, device: torch.device | str = "cpu") -> torch.Tensor:
    x = torch.randn(2, spec.channels, spec.height, spec.width, device=device)
    model.eval()
    with torch.no_grad():
        return model(x)


def test_registry_contents() -> None:
    assert NETWORKS == ZOO + ("moe_cnn", "moe_lm")  # the CNN zoo, then the mixture-of-experts networks (dmoe)
    assert set(DATASET_FAMILIES) == set(SMALL_FAMILIES + LARGE_FAMILIES)
    assert input_spec("mnist") == InputSpec(1, 28, 28, 10)
    assert input_spec("digits") == input_spec("mnist")
    assert input_spec("cifar10") == InputSpec(3, 32, 32, 10)
    assert input_spec("imagenet") == InputSpec(3, 224, 224, 1000)
    assert input_spec("highres") == InputSpec(3, 512, 512, 1000)
    with pytest.raises(Exception):
        input_spec("mnist").channels = 3  # type: ignore[misc]  # frozen


@pytest.mark.parametrize("family", SMALL_FAMILIES)
@pytest.mark.parametrize("name", ZOO)
def test_small_variants_give_logits(name: str, family: str) -> None:
    torch.manual_seed(0)
    model = build_model(name, family)
    assert isinstance(model, SequentialNet)
    out = _run(model, input_spec(family))
    assert out.shape == (2, 10)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("family", LARGE_FAMILIES)
@pytest.mark.parametrize("name", ZOO)
def test_large_variants_give_logits_on_meta(name: str, family: str) -> None:
    with torch.device("meta"):
        model = build_model(name, family)
    assert isinstance(model, SequentialNet)
    out = _run(model, input_spec(family), device="meta")
    assert out.shape == (2, 1000)
    assert out.device.type == "meta"


# Reference counts of the standard ImageNet architectures (1000 classes, BN in VGG).
IMAGENET_PARAMS = {
    "resnet18": 11_689_512,
    "resnet50": 25_557_032,
    "resnet152": 60_192_808,
    "vgg11": 132_868_840,
    "vgg16": 138_365_992,
    "mobilenet_v2": 3_504_872,
}


@pytest.mark.parametrize("family", LARGE_FAMILIES)
@pytest.mark.parametrize("name", sorted(IMAGENET_PARAMS))
def test_imagenet_parameter_counts_match_reference(name: str, family: str) -> None:
    with torch.device("meta"):
        model = build_model(name, family)
    assert count_parameters(model) == IMAGENET_PARAMS[name]


@pytest.mark.parametrize(
    ("name", "expected"),
    # well-known CIFAR-10 counts (3x3 stem, no max pool, global pool + Linear(features, 10))
    [("resnet18", 11_173_962), ("resnet50", 23_520_842), ("vgg16", 14_728_266)],
)
def test_cifar_parameter_counts_match_reference(name: str, expected: int) -> None:
    with torch.device("meta"):
        model = build_model(name, "cifar10")
    assert count_parameters(model) == expected


def test_tiny_cnn_is_tiny_and_accepts_any_input_size() -> None:
    model = build_model("tiny_cnn", "mnist")
    assert count_parameters(model) < 50_000
    model.eval()
    for size in (1, 5, 28, 41):
        assert model(torch.randn(2, 1, size, size)).shape == (2, 10)


def test_num_classes_override() -> None:
    assert _run(build_model("resnet18", "mnist", num_classes=7), input_spec("mnist")).shape == (2, 7)
    with torch.device("meta"):
        model = build_model("mobilenet_v2", "imagenet", num_classes=5)
    assert _run(model, input_spec("imagenet"), device="meta").shape == (2, 5)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_bad_num_classes_is_user_error(bad: object) -> None:
    with pytest.raises(UserError, match="num_classes"):
        build_model("tiny_cnn", "mnist", num_classes=bad)  # type: ignore[arg-type]


def test_unknown_network_is_user_error_naming_it() -> None:
    with pytest.raises(UserError) as info:
        build_model("resnet9000", "cifar10")
    message = str(info.value)
    assert "resnet9000" in message
    assert "resnet18" in message and "mobilenet_v2" in message


def test_unknown_family_is_user_error_naming_it() -> None:
    with pytest.raises(UserError) as info:
        build_model("resnet18", "svhn")
    message = str(info.value)
    assert "svhn" in message
    assert "cifar10" in message and "imagenet" in message
    with pytest.raises(UserError, match="svhn"):
        input_spec("svhn")


# --------------------------------------------------------------------------- variant geometry


def _shapes_after_children(model: nn.Module, spec: InputSpec) -> dict[str, tuple[int, ...]]:
    x = torch.randn(2, spec.channels, spec.height, spec.width)
    shapes = {}
    model.eval()
    with torch.no_grad():
        for child_name, child in model.named_children():
            x = child(x)
            shapes[child_name] = tuple(x.shape[1:])
    return shapes


def test_resnet_small_stage_sizes() -> None:
    shapes = _shapes_after_children(build_model("resnet18", "mnist"), input_spec("mnist"))
    assert shapes["stem"] == (64, 28, 28)  # no stride, no max pool
    stage_ends = [shapes[f"layer{s}_1"] for s in (1, 2, 3, 4)]
    assert stage_ends == [(64, 28, 28), (128, 14, 14), (256, 7, 7), (512, 4, 4)]
    shapes = _shapes_after_children(build_model("resnet18", "cifar10"), input_spec("cifar10"))
    assert [shapes[f"layer{s}_1"][1] for s in (1, 2, 3, 4)] == [32, 16, 8, 4]


def test_resnet_large_stem_downsamples_by_four() -> None:
    with torch.device("meta"):
        model = build_model("resnet50", "imagenet")
        stem_out = model.stem(torch.empty(1, 3, 224, 224))
    assert tuple(stem_out.shape) == (1, 64, 56, 56)
    assert any(isinstance(m, nn.MaxPool2d) for m in model.stem.modules())


def test_vgg_small_skips_pool_at_1x1() -> None:
    model = build_model("vgg11", "mnist")
    pools = [n for n, m in model.named_children() if isinstance(m, nn.MaxPool2d)]
    assert len(pools) == 4  # 28 -> 14 -> 7 -> 3 -> 1, fifth pool skipped
    shapes = _shapes_after_children(model, input_spec("mnist"))
    assert [shapes[p][1] for p in pools] == [14, 7, 3, 1]
    assert isinstance(model.classifier, nn.Linear) and model.classifier.in_features == 512
    cifar = build_model("vgg16", "cifar10")
    assert sum(isinstance(m, nn.MaxPool2d) for m in cifar.children()) == 5
    assert sum(isinstance(m, nn.Conv2d) for m in cifar.modules()) == 13


def test_mobilenet_small_strides() -> None:
    shapes = _shapes_after_children(build_model("mobilenet_v2", "mnist"), input_spec("mnist"))
    assert shapes["stem"] == (32, 28, 28)
    assert shapes["block2_1"] == (24, 28, 28)  # thesis: second stage keeps stride 1
    assert shapes["block7_0"] == (320, 4, 4)
    assert shapes["conv_last"] == (1280, 4, 4)


# --------------------------------------------------------------------------- sequential layout


@pytest.mark.parametrize(("name", "family"), [("tiny_cnn", "mnist"), ("resnet18", "mnist")])
def test_children_in_order_reproduce_forward(name: str, family: str) -> None:
    torch.manual_seed(0)
    model = build_model(name, family).eval()
    spec = input_spec(family)
    x = torch.randn(2, spec.channels, spec.height, spec.width)
    with torch.no_grad():
        expected = model(x)
        y = x
        for child in list(model.children()):
            y = child(y)
    torch.testing.assert_close(y, expected, rtol=0, atol=0)


@pytest.mark.parametrize("name", ZOO)
def test_children_layout_ends_with_pool_and_classifier(name: str) -> None:
    with torch.device("meta"):
        model = build_model(name, "imagenet")
    names = [n for n, _ in model.named_children()]
    assert names[-2:] == ["pool", "classifier"]
    assert len(names) >= 4


# --------------------------------------------------------------------------- user factories

FACTORY_MODULE = "ddlscope_test_user_models"


@pytest.fixture
def factory_module(tmp_path, monkeypatch):
    """Write a tiny user module into a temp dir on sys.path; yield a function to (re)write it."""

    def write(source: str) -> str:
        (tmp_path / f"{FACTORY_MODULE}.py").write_text(textwrap.dedent(source))
        sys.modules.pop(FACTORY_MODULE, None)
        return FACTORY_MODULE

    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        yield write
    finally:
        sys.modules.pop(FACTORY_MODULE, None)


def test_user_factory_is_called_with_classes_and_channels(factory_module) -> None:
    module = factory_module(
        """
        from torch import nn
        CALLS = []
        def make(num_classes, in_channels):
            CALLS.append((num_classes, in_channels))
            return nn.Sequential(nn.Flatten(), nn.LazyLinear(num_classes))
        """
    )
    model = build_model(f"{module}:make", "mnist", num_classes=3)
    assert sys.modules[module].CALLS == [(3, 1)]
    assert _run(model, input_spec("mnist")).shape == (2, 3)
    build_model(f"{module}:make", "cifar10")
    assert sys.modules[module].CALLS[-1] == (10, 3)


def test_user_factory_import_failure_is_user_error() -> None:
    target = "no_such_package_for_ddlscope.models:make"
    with pytest.raises(UserError) as info:
        build_model(target, "mnist")
    message = str(info.value)
    assert target in message
    assert "No module named" in message


def test_user_factory_import_time_error_is_user_error(factory_module) -> None:
    module = factory_module("raise RuntimeError('broken user module')\n")
    with pytest.raises(UserError, match="broken user module"):
        build_model(f"{module}:make", "mnist")


def test_user_factory_missing_attribute_or_bad_return(factory_module) -> None:
    module = factory_module("def not_a_model(num_classes, in_channels):\n    return 42\n")
    with pytest.raises(UserError, match="make"):
        build_model(f"{module}:make", "mnist")
    with pytest.raises(UserError, match="not a torch.nn.Module"):
        build_model(f"{module}:not_a_model", "mnist")
    with pytest.raises(UserError, match="package.module:function"):
        build_model(f"{module}:", "mnist")
