"""``ddlscope.run(...)``: train a user's model, data, loss and optimizer with ddlscope's loop, measured.

The run is what ``ddlscope run`` does with a config (:func:`ddlscope.config.validate_config`,
:func:`ddlscope.config.check_runnable`, :func:`ddlscope.launch.local.run_local`): workers are separate
processes under the chosen distribution model, so the factories travel as import strings
(:mod:`ddlscope.workloads.factories`). A callable that a worker cannot import is refused before anything
starts; the folder its module was imported from is put on the workers' ``PYTHONPATH``.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator



class RunFailed(RuntimeError):
    """A run started but did not complete.

    Attributes:
        run_id: the run's id in the results store (its measurements up to the failure are there).
        status: ``failed`` or ``interrupted``.
        reason: why, as stored with the run (e.g. the worker's exception and its log).
        record: the run's record (see :func:`run`).
    """

    def __init__(self, record: dict[str, Any]):
        self.record = record
        self.run_id, self.status, self.reason = record["run_id"], record["status"], record.get("reason")
        super().__init__(f"run {self.run_id} {self.status}: {self.reason}")


def run(model: Any = "resnet18", dataset: Any = "digits", *, loss: Any = "cross_entropy", optimizer: Any = "sgd",
        db: str | Path | None = None, group: str | None = None, progress: bool = False, **config: Any
        ) -> dict[str, Any]:
    """Train one run with ddlscope's loop and return its record; raise :class:`RunFailed` if it did not complete.

    Args:
        model: a zoo network name, an import string ``"package.module:factory"``, or the factory itself (a
            function or ``nn.Module`` class defined at the top level of an importable module), called in every
            worker as ``factory(num_classes=..., in_channels=...)`` plus ``image_size=(height, width)`` when it
            takes that parameter.
        dataset: a dataset name, a folder (MNIST idx, CIFAR-10 python, ImageFolder), or a factory
            ``factory(split)`` (``"train"`` / ``"test"``) returning a Dataset of preprocessed ``(tensor, int
            label)`` items with ``num_classes`` or ``classes``.
        loss: ``"cross_entropy"`` or a loss ``loss(logits, labels) -> scalar tensor`` (a class is instantiated
            without arguments), as an import string or a callable.
        optimizer: ``"sgd"``, ``"adam"``, ``"adamw"``, or a factory ``factory(params, lr=learning_rate)`` (e.g.
            ``torch.optim.RMSprop``), as an import string or a callable.
        db: results store (default ``./ddlscope-results/ddlscope.db``).
        group: label tying runs together for reports.
        progress: show progress bars.
        **config: any other run-config field (docs/config.md), e.g. ``strategy="ddp"``, ``peers=2``,
            ``batch_size=32``, ``sample_budget=3200``, ``distributed={"backend": "gloo"}``.

    Returns:
        The run's record: every ``runs`` column (``run_id``, ``name``, ``status`` ...), ``config`` (the stored
        config) and ``workers`` (their rows), as ``ddlscope runs --json`` shows it.

    Raises:
        UserError: bad config or a factory that a worker cannot import (named, with what is allowed),
            before anything starts; a model, dataset, loss or optimizer that fails on a first batch
            (:func:`ddlscope.config.check_runnable`).
        RunFailed: the run failed or was interrupted (its reason and record attached).
        KeyboardInterrupt: Ctrl-C; the run is stored ``interrupted``.
    """
    from ddlscope.config import check_runnable, validate_config
    from ddlscope.launch.local import run_local
    from ddlscope.store.db import ResultsStore, default_db_path
    from ddlscope.workloads.factories import import_string_of, module_root

    values = dict(config, model=model, dataset=dataset, loss=loss, optimizer=optimizer)
    roots: list[Path] = []
    for field in ("model", "dataset", "loss", "optimizer"):
        if not isinstance(values[field], str):
            values[field] = import_string_of(field, values[field])
            root = module_root(values[field])
            if root is not None:
                roots.append(root)
    cfg = validate_config(values)
    db_path = Path(db) if db is not None else default_db_path()
    with _python_path(roots):
        check_runnable(cfg)
        run_id = run_local(cfg, db_path, group, progress)
    with ResultsStore(db_path) as store:
        record = store.run_record(run_id)
    if record["status"] != "completed":
        raise RunFailed(record)
    return record


@contextmanager
def _python_path(roots: list[Path]) -> Iterator[None]:
    """``PYTHONPATH`` (inherited by the workers) with ``roots`` in front while the run goes."""
    extra = [str(r) for r in dict.fromkeys(roots) if str(r) != os.getcwd()]
    if not extra:
        yield
        return
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([*extra, *([before] if before else [])])
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before
