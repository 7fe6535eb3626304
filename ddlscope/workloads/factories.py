"""User factories for a run: model, dataset, loss and optimizer given as import strings or callables.

A run's workers are separate processes (``python -m ddlscope.train.worker``, or torchrun's); they read
the run's config from the results store and import what it names. So a factory travels as an import
string ``"package.module:attribute"`` (attribute may be dotted, e.g. ``"mylib.nets:Factories.small"``), and
a Python callable is accepted only where a worker can import it by that name (:func:`import_string_of`):
defined at the top level of an importable module. One defined in the script being run (``__main__``),
a lambda, a function defined inside another function (a closure), a ``functools.partial`` or an object
instance cannot be imported by name and is refused with a message saying what is allowed.

What a worker calls (docs/api.md):

- model: ``factory(num_classes=<int>, in_channels=<int>)``, plus ``image_size=(height, width)`` when the
  factory takes an ``image_size`` parameter (or ``**kwargs``): an ``nn.Module`` producing logits
  ``(N, num_classes)``;
- dataset: ``factory(split)`` with ``split`` ``"train"`` or ``"test"``: a ``torch.utils.data.Dataset`` of
  ``(input tensor, int label)`` items, preprocessed by the factory itself (ddlscope applies no transform),
  with a ``num_classes`` attribute or a ``classes`` list (:func:`open_user_dataset`);
- loss: a callable ``loss(logits, labels) -> scalar tensor``; a class (e.g. ``torch.nn.CrossEntropyLoss``) is
  instantiated without arguments first (:func:`build_loss`);
- optimizer: ``factory(params, lr=<learning_rate>)``, e.g. ``torch.optim.RMSprop`` (:func:`build_optimizer_from`).
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable

from ddlscope.errors import UserError

_IMPORT_STRING = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
FACTORY_FIELDS = ("model", "dataset", "loss", "optimizer")
"""Run-config fields that may name a user factory."""
DEFAULT_LOSS = "cross_entropy"
"""The built-in loss (:func:`ddlscope.workloads.step.loss_function`)."""
ALLOWED = ("allowed: a function or class defined at the top level of an importable module (e.g. a file "
           "my_factories.py next to your script, imported as `from my_factories import make_model`), or its "
           "import string 'my_factories:make_model'")


def is_import_string(value: Any) -> bool:
    """Whether ``value`` looks like ``"package.module:attribute"`` (syntax only; nothing is imported)."""
    return isinstance(value, str) and bool(_IMPORT_STRING.match(value))


def check_import_string(field: str, value: str) -> None:
    """A ``module:attribute`` value of ``field`` is well-formed and does not name ``__main__``.

    Raises:
        UserError: malformed, or the module is ``__main__`` (a worker's ``__main__`` is ddlscope's worker,
            not the user's script).
    """
    if not is_import_string(value):
        raise UserError(f"{field} = {value!r} is not an import string; allowed: 'package.module:attribute'")
    module = value.partition(":")[0]
    if module == "__main__":
        raise UserError(f"{field} = {value!r} names the script being run (__main__): ddlscope's workers are "
                        f"separate processes and cannot import it; {ALLOWED}")


def import_string_of(field: str, value: Any) -> str:
    """The import string a worker can use for ``value`` (a string is returned as it is).

    Raises:
        UserError: ``value`` is not a string and cannot be imported by name by another process: defined in
            ``__main__``, a lambda or closure, an instance (e.g. an ``nn.Module`` instead of its factory), a
            ``functools.partial``; the message names it and says what is allowed.
    """
    if isinstance(value, str):
        return value
    shown = _describe(value)
    try:
        import torch

        if isinstance(value, torch.nn.Module):
            return _refuse(field, shown, "is a model instance; a run builds a fresh model in every worker, so it "
                                         "needs the factory that makes it (a function or the class itself)")
    except ImportError:
        pass
    if not callable(value):
        return _refuse(field, shown, "is neither an import string nor a callable")
    module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
    if not isinstance(qualname, str) or not isinstance(module, str):
        return _refuse(field, shown, "has no importable name (a functools.partial or a callable object?)")
    if module == "__main__":
        return _refuse(field, shown, "is defined in the script being run (__main__): ddlscope's workers are "
                                     "separate processes that import factories by name and cannot see it")
    if "<lambda>" in qualname or "<locals>" in qualname:
        return _refuse(field, shown, "is a lambda or a function defined inside another function (a closure): "
                                     "other processes cannot import it by name")
    target = f"{module}:{qualname}"
    try:
        found = import_object(target, field)
    except UserError:
        found = None
    if found is not value:
        return _refuse(field, shown, f"cannot be found again as {target!r}")
    return target


def _describe(value: Any) -> str:
    name = getattr(value, "__qualname__", None) or type(value).__name__
    return f"{name!r}" if isinstance(name, str) else repr(value)


def _refuse(field: str, shown: str, why: str) -> str:
    raise UserError(f"{field} = {shown} {why}; {ALLOWED}")


def import_object(target: str, field: str) -> Any:
    """Import ``"package.module:attribute"`` (dotted attribute allowed), the working folder first on the path
    as for a worker started there.

    Raises:
        UserError: malformed, ``__main__``, the import fails (with the error), or no such attribute.
    """
    check_import_string(field, target)
    module_name, _, attr = target.partition(":")
    added = os.getcwd() not in sys.path
    if added:
        sys.path.insert(0, os.getcwd())
    try:
        obj = importlib.import_module(module_name)
    except Exception as exc:  # any failure while importing user code is the user's to fix
        raise UserError(f"{field} = {target!r}: cannot import {module_name!r}: {type(exc).__name__}: {exc}") from None
    finally:
        if added and os.getcwd() in sys.path:
            sys.path.remove(os.getcwd())
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UserError(f"{field} = {target!r}: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def import_callable(target: str, field: str) -> Callable:
    """:func:`import_object`, which must be callable.

    Raises:
        UserError: see :func:`import_object`, or the object is not callable.
    """
    obj = import_object(target, field)
    if not callable(obj):
        raise UserError(f"{field} = {target!r} is a {type(obj).__name__}, not callable; allowed: a function or class")
    return obj


def module_root(target: str) -> Path | None:
    """The folder a worker needs on its ``PYTHONPATH`` to import ``target``'s module (None: unknown, e.g. a
    module without a file). For ``a.b:f`` loaded from ``/x/a/b.py`` it is ``/x``."""
    module = sys.modules.get(target.partition(":")[0])
    path = getattr(module, "__file__", None)
    if not path:
        return None
    root = Path(path).resolve().parent
    depth = target.partition(":")[0].count(".") + (Path(path).name == "__init__.py")
    for _ in range(depth):
        root = root.parent
    return root


def accepts_keyword(fn: Callable, name: str) -> bool:
    """Whether ``fn`` takes a keyword argument ``name`` (by name or through ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) or p.kind == p.VAR_KEYWORD
               for p in params)


# ------------------------------------------------------------------ loss and optimizer
def build_loss(name: str) -> Callable:
    """The loss a run trains with: ``cross_entropy`` (:func:`ddlscope.workloads.step.loss_function`) or a user
    loss ``module:attribute`` (a class is instantiated without arguments).

    Raises:
        UserError: the import fails, or instantiating the class fails.
    """
    from ddlscope.workloads.step import loss_function

    if name == DEFAULT_LOSS:
        return loss_function()
    obj = import_callable(name, "loss")
    if inspect.isclass(obj):
        try:
            return obj()
        except Exception as exc:
            raise UserError(f"loss = {name!r}: {obj.__name__}() failed: {type(exc).__name__}: {exc}; allowed: a class "
                            f"that takes no arguments, or a function loss(logits, labels)") from None
    return obj


def build_optimizer_from(name: str, params, learning_rate: float):
    """A user optimizer: ``factory(params, lr=learning_rate)`` for ``name`` = ``module:attribute``.

    Raises:
        UserError: the import fails, the call fails, or it returns no ``torch.optim.Optimizer``.
    """
    import torch

    factory = import_callable(name, "optimizer")
    try:
        optimizer = factory(params, lr=learning_rate)
    except Exception as exc:
        raise UserError(f"optimizer = {name!r}: calling it as factory(params, lr={learning_rate}) failed: "
                        f"{type(exc).__name__}: {exc}") from None
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UserError(f"optimizer = {name!r} returned {type(optimizer).__name__}; allowed: a factory returning a "
                        f"torch.optim.Optimizer")
    return optimizer


# ------------------------------------------------------------------ dataset
def open_user_dataset(target: str, split: str):
    """The ``split`` of a user dataset factory and its :class:`~ddlscope.workloads.datasets.DatasetSpec`
    (format ``user``; channels, height and width from the first item, classes from the dataset's
    ``num_classes`` or ``len(classes)``, the family from the image size).

    Raises:
        UserError: the factory cannot be imported or fails, returns no sized dataset, an empty one, items
            that are not ``(C, H, W)`` tensors with an int label, or no class count.
    """
    import torch

    from ddlscope.workloads.datasets import USER, DatasetSpec, family_for_geometry

    factory = import_callable(target, "dataset")
    what = f"dataset = {target!r}"
    try:
        dataset = factory(split)
    except Exception as exc:
        raise UserError(f"{what}: factory({split!r}) failed: {type(exc).__name__}: {exc}") from None
    if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise UserError(f"{what} returned {type(dataset).__name__}; allowed: a torch Dataset with __len__ and __getitem__")
    if len(dataset) == 0:
        raise UserError(f"{what}: the {split} split is empty")
    item = dataset[0]
    if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], torch.Tensor)
            and item[0].dim() == 3 and item[0].shape[0] in (1, 3)):
        got = tuple(item[0].shape) if isinstance(item, (tuple, list)) and item and isinstance(item[0], torch.Tensor) \
            else type(item).__name__
        raise UserError(f"{what}: item 0 of the {split} split is {got}; allowed: (image tensor (C, H, W) with C 1 or "
                        f"3, int label)")
    classes = getattr(dataset, "num_classes", None)
    if classes is None and getattr(dataset, "classes", None) is not None:
        classes = len(dataset.classes)
    if isinstance(classes, bool) or not isinstance(classes, int) or classes < 1:
        raise UserError(f"{what}: the dataset has no class count; allowed: a dataset with an int attribute "
                        f"num_classes or a list attribute classes")
    channels, height, width = (int(v) for v in item[0].shape)
    spec = DatasetSpec(target, USER, channels, height, width, classes, len(dataset),
                       family_for_geometry(height, width))
    return dataset, spec
