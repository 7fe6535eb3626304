"""Expert blocks of a mixture-of-experts layer: building them, their sample inputs and schemas.

An expert is named as in ``dmoe.expert``: one of hivemind 1.1.12's blocks
(``hivemind.moe.server.layers.name_to_block``: ``ffn`` — Linear(H, 4H), GELU, Linear(4H, H),
residual and LayerNorm; ``transformer`` — one encoder layer with 16 heads and a 4H feed-forward,
taking ``[batch, 128, H]`` and a ``[batch, 128]`` key-padding mask) or a user factory
``"package.module:factory"`` called as ``factory(hidden_dim)``, which takes ``[batch, H]``.

Every expert maps its first input to an output of the same shape: hivemind's servers declare
their experts with the sample input's shapes, and the mixture averages the experts' outputs.
"""

from __future__ import annotations

import importlib

import torch
from torch import nn

from ddlscope.distribution.dmoe import BUILTIN_EXPERTS
from ddlscope.errors import UserError

_ALLOWED = f"{', '.join(BUILTIN_EXPERTS)} or 'package.module:factory' (called as factory(hidden_dim))"


def _builtin_layers() -> tuple[dict, dict]:
    from hivemind.moe.server.layers import name_to_block, name_to_input  # importing registers the blocks

    return name_to_block, name_to_input


def expert_seed(seed: int, uid: str) -> int:
    """Seed an expert's parameters are initialised from: ``seed + sum of the code points of uid``,
    so an expert (a restarted server's, or the in-process copy of ``placement = "local"``)
    starts the same wherever it is built."""
    return seed + sum(map(ord, uid))


def make_expert(expert: str, hidden_dim: int) -> nn.Module:
    """A new expert block (parameters from the global torch generator).

    Args:
        expert: ``"ffn"``, ``"transformer"`` or ``"package.module:factory"`` (``dmoe.expert``).
        hidden_dim: width of the expert's input and output (``dmoe.hidden_dim``).

    Raises:
        UserError: naming ``dmoe.expert``: a malformed name, a module that fails to import, a
            missing or non-callable factory, a factory that raises, or one that returns no
            ``torch.nn.Module``.
    """
    if expert in BUILTIN_EXPERTS:
        name_to_block, _ = _builtin_layers()
        return name_to_block[expert](hidden_dim)
    module_name, _, attr = expert.partition(":")
    if not module_name or not attr or ":" in attr:
        raise UserError(f"dmoe.expert = {expert!r}: allowed: {_ALLOWED}")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any failure while importing user code is the user's to fix
        raise UserError(f"dmoe.expert = {expert!r}: cannot import {module_name!r} "
                        f"({type(exc).__name__}: {exc}); allowed: {_ALLOWED}") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise UserError(f"dmoe.expert = {expert!r}: module {module_name!r} has no callable {attr!r}; "
                        f"allowed: {_ALLOWED}")
    try:
        block = factory(hidden_dim)
    except Exception as exc:
        raise UserError(f"dmoe.expert = {expert!r}: {attr}({hidden_dim}) raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(block, nn.Module):
        raise UserError(f"dmoe.expert = {expert!r}: {attr}({hidden_dim}) returned {type(block).__name__}, "
                        "not a torch.nn.Module")
    return block


def _input_descriptions(expert: str, batch: int, hidden_dim: int) -> list[tuple[torch.Size, torch.dtype]]:
    """``(shape, dtype)`` of each positional input (hivemind's ``name_to_input`` for built-ins)."""
    if expert not in BUILTIN_EXPERTS:
        return [(torch.Size([batch, hidden_dim]), torch.float32)]
    _, name_to_input = _builtin_layers()
    sample = name_to_input[expert](batch, hidden_dim)
    return [(t.shape, t.dtype) for t in (sample if isinstance(sample, tuple) else (sample,))]


def expert_sample_input(expert: str, batch: int, hidden_dim: int) -> tuple[torch.Tensor, ...]:
    """A sample of the expert's positional inputs for ``batch`` samples.

    Shapes and dtypes are hivemind's (``name_to_input``) for the built-in experts: ``ffn``
    ``([batch, H] float32,)``; ``transformer`` ``([batch, 128, H] float32, [batch, 128] bool)``.
    A user factory's expert takes ``([batch, H] float32,)``. Values: standard normal floats
    (from the global torch generator), all-False masks (nothing padded).
    """
    return tuple(torch.randn(shape, dtype=dtype) if dtype.is_floating_point else torch.zeros(shape, dtype=dtype)
                 for shape, dtype in _input_descriptions(expert, batch, hidden_dim))


def check_expert(expert: str, hidden_dim: int) -> None:
    """Build one expert and run it on a sample input of 2 samples: the pre-flight check of
    ``dmoe.expert`` (a user factory is imported and called once), before anything starts.

    Raises:
        UserError: naming ``dmoe.expert``: what :func:`make_expert` raises; a forward that fails
            on the sample input (with its shapes); an output that is not one tensor, or whose
            shape differs from the first input's (the shape hivemind's servers declare).
    """
    block = make_expert(expert, hidden_dim)
    sample = expert_sample_input(expert, 2, hidden_dim)
    shapes = ", ".join(f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in sample)
    try:
        with torch.no_grad():
            out = block(*sample)
    except Exception as exc:
        raise UserError(f"dmoe.expert = {expert!r} (hidden_dim = {hidden_dim}) fails on inputs of shape {shapes}: "
                        f"{type(exc).__name__}: {exc}") from exc
    if not isinstance(out, torch.Tensor):
        raise UserError(f"dmoe.expert = {expert!r} returns {type(out).__name__} on inputs of shape {shapes}; "
                        f"allowed: one tensor of the first input's shape {list(sample[0].shape)}")
    if out.shape != sample[0].shape:
        raise UserError(f"dmoe.expert = {expert!r} (hidden_dim = {hidden_dim}) maps inputs of shape {shapes} to "
                        f"{list(out.shape)}; allowed: an output of the first input's shape {list(sample[0].shape)}")


def args_schema(expert: str, hidden_dim: int) -> tuple:
    """The expert's positional-argument schema for a hivemind ``ModuleBackend``: one
    ``hivemind.utils.tensor_descr.BatchTensorDescriptor`` per input of
    :func:`expert_sample_input` (batch dimension free), as ``hivemind.moe.Server.create`` makes it
    (no compression). Draws nothing from the torch generator."""
    from hivemind.utils.tensor_descr import DUMMY_BATCH_SIZE, BatchTensorDescriptor

    return tuple(BatchTensorDescriptor.from_tensor(torch.zeros(shape, dtype=dtype))
                 for shape, dtype in _input_descriptions(expert, DUMMY_BATCH_SIZE, hidden_dim))
