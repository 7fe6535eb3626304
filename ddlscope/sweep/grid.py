"""Sweep grids: a base run config and axes whose cross product gives the cells.

A grid file (TOML)::

    name = "bs-lr"                 # optional; default: the file name without .toml
    [base]                         # RunConfig fields shared by every cell
    model = "resnet18"
    sample_budget = 3200
    [base.collaborative]
    matchmaking_time_s = 2.0
    [axes]                         # field path -> list of values; cells = cross product
    batch_size = [32, 64]
    "collaborative.target_batch_size" = [128, 512]   # quoted or not: both name the field
    peers = [1, 2]                 # coupled with total_vcpus: vcpus_per_peer = total_vcpus / peers
    total_vcpus = 2                # default: all cores this process may use
    repeats = 2                    # repeat index 0..N-1; seed = base seed + repeat index

``axes`` may also be an array of tables (``[[axes]]``): the cells are then the union of each
table's cross product (thesis 000's Table 5.2 is two such sub-grids).

Rules applied to every cell, in order:

1. ``peers`` (when an axis): ``vcpus_per_peer = total_vcpus // peers`` (``total_vcpus`` must be a
   multiple of every peer count); ``peers = 1`` is the registry's baseline model (``single``),
   ``peers > 1`` uses the base strategy, or, when the base strategy runs on one worker only, the
   model whose config table the grid sets (``[base.collaborative]`` or ``collaborative.*`` axes:
   ``collaborative``) (thesis 000, ch. 5: one node with all vCPUs vs. N peers whose vCPUs sum to
   the baseline's).
2. A cell ignores the axes of other models' config tables (a ``single`` cell ignores
   ``collaborative.*`` axes: they do not apply), so it is kept once.
3. ``repeats``: ``seed = base seed + repeat index`` and the index is part of the cell.
4. Cells with the same effective config are kept once.

A cell (:class:`ddlscope.experiments.runner.Cell`) has as its **key** the canonical JSON (sorted
keys, no spaces) of its overrides; the experiment runner stores it with the cell's run so that a
rerun of the same sweep skips finished cells.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddlscope import distribution
from ddlscope.config import RunConfig, available_cores, read_toml
from ddlscope.errors import UserError
from ddlscope.experiments.runner import Cell

DEFAULT_MAX_CELLS = 200
MAX_REPEAT_INDEX = 100_000
"""Largest repeat index a ``repeats`` list may name (the seed of repeat i is the base seed + i)."""
REPEAT_KEY = "repeat"
SPECIAL_AXES = ("repeats", "total_vcpus")
_NOT_AXES = ("name", *distribution.config_tables())  # a run's label is set per cell; model tables are tables of axes
_SHORT = {"batch_size": "bs", "learning_rate": "lr", "collaborative.target_batch_size": "tbs",
          "collaborative.use_local_updates": "lu", "gradient_accumulation_steps": "gas",
          "collaborative.matchmaking_time_s": "mm", "peers": "p", "vcpus_per_peer": "v", REPEAT_KEY: "r",
          "sample_budget": "budget"}


def allowed_axes() -> list[str]:
    """Names an ``[axes]`` table accepts: RunConfig fields, ``<model table>.<field>`` (e.g.
    ``collaborative.target_batch_size``), repeats, total_vcpus."""
    fields = [f for f in RunConfig.model_fields if f not in _NOT_AXES]
    fields += [f"{table}.{f}" for table, cls in distribution.config_tables().items() for f in cls.model_fields]
    return fields + list(SPECIAL_AXES)


@dataclass
class Sweep:
    """A named, expanded and validated grid.

    Each cell's ``key`` is :func:`cell_key` of its overrides (field path -> value set on top of
    the base, derived fields such as ``vcpus_per_peer`` and ``strategy`` of a peers axis included;
    ``repeat`` is the repeat index), its label e.g. ``bs32-lr0.01-p2-v1-r0``, its config's
    ``name`` ``<sweep>/<label>``; every cell's config is validated.
    """

    name: str
    base: dict[str, Any]
    cells: list[Cell]


def cell_key(overrides: dict[str, Any]) -> str:
    """Canonical JSON of a cell's overrides: sorted keys, no whitespace (stable across reruns)."""
    return json.dumps(overrides, sort_keys=True, separators=(",", ":"), default=str)


def cell_label(overrides: dict[str, Any]) -> str:
    """A short name for a cell from its overrides, e.g. ``single-bs32-lr0.01-r1``."""
    parts = []
    for path, value in overrides.items():
        if path == "strategy":
            parts.insert(0, str(value))
            continue
        short = _SHORT.get(path, path.split(".")[-1])
        text = {True: "1", False: "0"}.get(value, value) if isinstance(value, bool) else value
        parts.append(f"{short}{text}")
    return "-".join(str(p) for p in parts) or "base"


def load_grid(path: Path, max_cells: int = DEFAULT_MAX_CELLS, name: str | None = None) -> Sweep:
    """Read a grid TOML file and expand it (see the module docstring for the format).

    Raises:
        UserError: missing, unreadable or empty file, bad TOML, unknown tables or axes, or any invalid cell.
    """
    data = read_toml(path, "grid file")
    if not data:
        raise UserError(f"grid file {path} sets nothing; a grid needs a [base] table of run config fields and an "
                        f"[axes] table of field = [values], e.g. [base] model = \"tiny_cnn\" [axes] batch_size = [16, 32]")
    return expand_grid(data, name or data.get("name") or Path(path).stem, max_cells)


def expand_grid(data: dict[str, Any], name: str, max_cells: int = DEFAULT_MAX_CELLS,
                cores: list[int] | None = None) -> Sweep:
    """Expand a grid (the parsed TOML: ``base`` and ``axes`` tables) into validated cells.

    Args:
        data: ``{"base": {...}, "axes": {...} or [{...}, ...], "name": ...}``.
        name: the sweep's name (the runs' group name).
        max_cells: refuse grids with more cells than this (counted before de-duplication).
        cores: core ids the default ``total_vcpus`` is taken from (default: this process's).

    Raises:
        UserError: unknown top-level keys or axes (the message lists the allowed ones), an axis
            that is not a non-empty list, conflicting axes (``seed`` with ``repeats``,
            ``vcpus_per_peer`` with ``peers``, ``total_vcpus`` without ``peers`` or not a multiple
            of a peer count), zero cells, more than ``max_cells`` cells, or a cell that
            :func:`ddlscope.config.validate_config` rejects (the first one is named, with a count).
    """
    unknown = set(data) - {"name", "base", "axes"}
    if unknown:
        raise UserError(f"grid: unknown top-level key(s) {sorted(unknown)}; allowed: name, [base], [axes]")
    if not isinstance(name, str) or not name.strip():
        raise UserError(f"grid: name must be a non-empty string, got {name!r}")
    base = data.get("base", {})
    if not isinstance(base, dict):
        raise UserError("grid: [base] must be a table of run config fields")
    tables = data.get("axes", {})
    tables = [tables] if isinstance(tables, dict) else tables
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise UserError("grid: [axes] must be a table, or an array of tables [[axes]]")
    cores = cores if cores is not None else available_cores()
    parsed = [_parse_axes(t, i, len(tables), len(cores)) for i, t in enumerate(tables or [{}])]
    many_peers = _many_peers_model(base, [axes for axes, _ in parsed])
    total = sum(math.prod(len(v) for v in axes.values()) for axes, _ in parsed)
    if total == 0:
        empty = sorted({k for axes, _ in parsed for k, v in axes.items() if not v})
        raise UserError(f"grid expands to zero cells: axis/axes {empty} have no values; give each axis at least one value")
    if total > max_cells:
        sizes = " + ".join(" x ".join(f"{k}({len(v)})" for k, v in axes.items()) or "1" for axes, _ in parsed)
        raise UserError(f"grid expands to {total} cells ({sizes}), more than --max-cells {max_cells}; "
                        f"remove values or raise --max-cells")
    cells, seen = [], set()
    for axes, total_vcpus in parsed:
        for combo in itertools.product(*axes.values()):
            overrides = _derive(dict(zip(axes, combo)), base, total_vcpus, many_peers)
            values = _apply(base, overrides)
            identity = cell_key(dict(values, **{REPEAT_KEY: overrides.get(REPEAT_KEY)}))
            if identity in seen:
                continue
            seen.add(identity)
            label = cell_label(overrides)
            values["name"] = f"{name}/{label}"
            cells.append((overrides, label, values))
    return Sweep(name, base, _validate_cells(cells))


def _parse_axes(table: dict[str, Any], index: int, count: int, n_cores: int) -> tuple[dict[str, list], int | None]:
    where = "[axes]" if count <= 1 else f"[[axes]] #{index + 1}"
    table = _flatten(table)
    allowed = allowed_axes()
    unknown = [k for k in table if k not in allowed]
    if unknown:
        raise UserError(f"grid {where}: unknown axis/axes {unknown}; allowed: {', '.join(allowed)}")
    axes: dict[str, list] = {}
    for key, values in table.items():
        if key == "total_vcpus":
            continue
        if key == "repeats":
            if isinstance(values, int) and not isinstance(values, bool):
                if values < 0:
                    raise UserError(f"grid {where}: repeats = {values}; allowed: a count >= 1 or a list of repeat indices")
                values = range(values)  # counted before any cell is built (a count of 10**8 takes no memory)
            elif not (isinstance(values, list) and all(isinstance(v, int) and not isinstance(v, bool)
                                                       and 0 <= v <= MAX_REPEAT_INDEX for v in values)):
                raise UserError(f"grid {where}: repeats = {values!r}; allowed: a count >= 1 or a list of indices "
                                f"0..{MAX_REPEAT_INDEX}")
            axes[REPEAT_KEY] = values
            continue
        if not isinstance(values, list):
            raise UserError(f"grid {where}: axis {key!r} = {values!r} is not a list; write {key} = [{values!r}]")
        axes[key] = values
    if "seed" in axes and REPEAT_KEY in axes:
        raise UserError(f"grid {where}: axes 'seed' and 'repeats' conflict (repeats set the seed); keep one")
    total_vcpus = table.get("total_vcpus")
    if total_vcpus is not None:
        if "peers" not in axes:
            raise UserError(f"grid {where}: total_vcpus needs a peers axis (vcpus_per_peer = total_vcpus / peers)")
        if isinstance(total_vcpus, bool) or not isinstance(total_vcpus, int) or total_vcpus < 1:
            raise UserError(f"grid {where}: total_vcpus = {total_vcpus!r}; allowed: an integer >= 1")
        if total_vcpus > n_cores:
            raise UserError(f"grid {where}: total_vcpus = {total_vcpus} exceeds the {n_cores} core(s) this machine "
                            f"gives ddlscope; allowed: 1..{n_cores}")
    if "peers" in axes:
        if "vcpus_per_peer" in axes:
            raise UserError(f"grid {where}: axes 'peers' and 'vcpus_per_peer' conflict: with a peers axis, "
                            f"vcpus_per_peer = total_vcpus / peers; drop the vcpus_per_peer axis")
        total_vcpus = total_vcpus or n_cores
        for p in axes["peers"]:
            if isinstance(p, bool) or not isinstance(p, int) or p < 1:
                raise UserError(f"grid {where}: peers value {p!r}; allowed: integers >= 1")
            if p > total_vcpus or total_vcpus % p:
                raise UserError(f"grid {where}: peers = {p} does not divide total_vcpus = {total_vcpus} into whole "
                                f"cores per peer; allowed peer counts: "
                                f"{[d for d in range(1, total_vcpus + 1) if total_vcpus % d == 0]}")
    return axes, total_vcpus


def _flatten(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"collaborative": {"target_batch_size": [..]}}`` (TOML's unquoted dotted keys) -> dotted paths."""
    out: dict[str, Any] = {}
    for key, value in table.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _many_peers_model(base: dict[str, Any], axes: list[dict[str, list]]) -> str | None:
    """The model a coupled peers axis runs at ``peers > 1`` when the base strategy runs on one worker
    only (rule 1): the one multi-worker model whose config table the grid sets; None if not exactly one."""
    tables = {t for t in distribution.config_tables() if t in base or any(k.startswith(f"{t}.") for a in axes for k in a)}
    models = [m.name for m in distribution.all_models() if m.multi_worker and m.config_table in tables]
    return models[0] if len(models) == 1 else None


def _derive(overrides: dict[str, Any], base: dict[str, Any], total_vcpus: int | None,
            many_peers: str | None) -> dict[str, Any]:
    """Apply rules 1-3 of the module docstring to one combination of axis values.

    Raises:
        UserError: a peers value > 1 with a one-worker base strategy and no model to run it (rule 1).
    """
    out = dict(overrides)
    default = RunConfig.model_fields["strategy"].default
    if "peers" in out:
        peers = out["peers"]
        out["vcpus_per_peer"] = total_vcpus // peers
        base_strategy = out.get("strategy", base.get("strategy", default))
        if peers == 1:
            out["strategy"] = distribution.baseline().name
        elif distribution.get(base_strategy).multi_worker:
            out["strategy"] = base_strategy
        elif many_peers is not None:
            out["strategy"] = many_peers
        else:
            allowed = [m.name for m in distribution.all_models() if m.multi_worker]
            raise UserError(f"grid: peers = {peers} but strategy {base_strategy!r} runs on one worker; set [base] "
                            f"strategy to a multi-worker model ({', '.join(allowed)}) or a model's table "
                            f"(e.g. [base.collaborative])")
    model = distribution.get(out.get("strategy", base.get("strategy", default)))
    others = [t for t in distribution.config_tables() if t != model.config_table]
    return {k: v for k, v in out.items() if not any(k.startswith(f"{t}.") for t in others)}


def _apply(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """The nested RunConfig values of a cell: the base with the overrides set by field path."""
    values = copy.deepcopy(base)
    for path, value in overrides.items():
        if path == REPEAT_KEY:
            values["seed"] = int(base.get("seed", 0)) + value
            continue
        target = values
        *parents, leaf = path.split(".")
        for p in parents:
            target = target.setdefault(p, {})
        target[leaf] = value
    return values


def _validate_cells(cells: list[tuple[dict, str, dict]]) -> list[Cell]:
    out, errors = [], []
    for overrides, label, values in cells:
        cell = Cell(cell_key(overrides), label, values)
        try:
            cell.config  # noqa: B018 -- validates the values (cached on the cell)
            out.append(cell)
        except UserError as e:
            errors.append(f"cell {label} {cell_key(overrides)}: {e}")
    if errors:
        more = f" ({len(errors) - 1} more invalid cell(s) not shown)" if len(errors) > 1 else ""
        raise UserError(f"{len(errors)} of {len(cells)} cells are invalid; first: {errors[0]}{more}")
    return out
