"""The ``ddlscope`` command line.

Commands: ``quickstart`` (the main job), ``models``, ``run``, ``suite``, ``sweep``, ``sweep-report``,
``matchmaking``, ``datapipe``, ``peer``, ``serve-experts``, ``bootstrap``, ``report``, ``runs``, ``rm``, ``export``, ``data``, and the
predictor's ``profile``, ``calibrate``, ``recommend`` and ``validate`` (``predict/commands.py``). User errors
print one line ``error: ...`` and exit with status 2.

Conventions shared by every command: help texts are shown literally (no rich markup, so ``[run]``
stays ``[run]``); a command that prints a table takes ``--json`` and then prints one strict JSON
document on stdout (:func:`echo_json`) and everything else on stderr (:func:`stdout_to_stderr`);
tables take the terminal's width; an option has one name in every command (units in it, e.g.
``--matchmaking-time-s``), a renamed one keeps its old spelling as a hidden alias (:func:`renamed`).
"""

from __future__ import annotations

import json
import math
import numbers
import os
import sys
import time
from contextlib import contextmanager, nullcontext, redirect_stdout
from pathlib import Path
from typing import Any, Optional

import typer

from ddlscope.errors import UserError
from ddlscope.store.db import default_db_path

HELP_WIDTH_MAX = 120
"""Help text is wrapped to the terminal's width, at most this many columns (click's default is 80)."""

# rich_markup_mode=None: help texts are printed as written; rich markup would eat "[run]", "[dmoe]" ...
app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
                  context_settings={"max_content_width": HELP_WIDTH_MAX},
                  help="Measure, compare and explain distributed deep-learning training.")
data_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None,
                       help="Prepare datasets: the built-in digits, synthetic copies.")
app.add_typer(data_app, name="data")

DbOption = typer.Option(None, "--db", help="results database (default ./ddlscope-results/ddlscope.db)")
JSON_HELP = "print one JSON document on stdout instead of the table (everything else goes to stderr)"


def _finite(value: Any) -> Any:
    """``value`` with every non-finite float (NaN, +-Infinity) replaced by None, recursively through
    dicts, lists and tuples; other real numbers that are not int (numpy floats) become float."""
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral):
        value = float(value)
        return value if math.isfinite(value) else None
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    return value


def strict_json(value: Any) -> str:
    """``value`` (dicts, lists, numbers, strings, None) as strict JSON text, indented by 2.

    NaN and +-Infinity, which Python's json would write as the invalid tokens ``NaN`` and
    ``Infinity``, become ``null`` (unknown); anything else json cannot encode (paths, times) is
    written as its ``str``.
    """
    return json.dumps(_finite(value), indent=2, allow_nan=False, default=str)


def echo_json(value: Any) -> None:
    """Print ``value`` on stdout as one strict JSON document (:func:`strict_json`)."""
    typer.echo(strict_json(value))


def stdout_to_stderr(enabled: bool):
    """A context in which whatever is printed to stdout (progress bars, notes, tables) goes to stderr,
    when ``enabled`` (``--json``): stdout then holds only the JSON document printed after it."""
    return redirect_stdout(sys.stderr) if enabled else nullcontext()


def renamed(ctx: typer.Context, name: str, old_name: str) -> Any:
    """The value of the option parameter ``name``, taking its old spelling, the hidden parameter
    ``old_name``, when that was given instead (with a deprecation note on stderr).

    Raises:
        UserError: both spellings given.
    """
    flags = {p.name: p.opts[0] for p in ctx.command.params}
    old_value = ctx.params.get(old_name)
    if old_value is None:
        return ctx.params[name]
    if ctx.get_parameter_source(name).name != "DEFAULT":
        raise UserError(f"{flags[old_name]} is the old name of {flags[name]}; give {flags[name]} only")
    typer.echo(f"note: {flags[old_name]} is deprecated; it is now {flags[name]}", err=True)
    return old_value


def _db(db: Optional[Path]) -> Path:
    return Path(db) if db else default_db_path()


def _parse_sets(sets: list[str]) -> dict[str, Any]:
    """``key=value`` pairs (``key`` a field or ``table.field``); values parsed as TOML values
    (numbers, booleans, quoted strings, arrays), else taken as the bare string.

    Raises:
        UserError: no ``=``, an empty name or name part, or a name set both as a value and as a table
            (``--set batch_size=3 --set batch_size.x=1``).
    """
    import tomllib

    out: dict[str, Any] = {}
    for item in sets:
        if "=" not in item:
            raise UserError(f"--set {item!r}: expected key=value, e.g. --set batch_size=64")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        if not all(p.strip() for p in parts):
            raise UserError(f"--set {item!r}: {key.strip()!r} is not a field name; allowed: a field or "
                            f"table.field, e.g. --set batch_size=64 or --set distributed.backend='\"gloo\"'")
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        target = out
        *parents, leaf = (p.strip() for p in parts)
        for i, p in enumerate(parents):
            target = target.setdefault(p, {})
            if not isinstance(target, dict):
                raise UserError(f"--set {item!r}: {'.'.join(parts[:i + 1])} is set to a value by another --set, "
                                f"so it cannot be a table too; give one of them")
        if isinstance(target.get(leaf), dict):
            raise UserError(f"--set {item!r}: {'.'.join(parts)} is a table set by another --set "
                            f"({'.'.join(parts)}.<field>=...), so it cannot be a value too; give one of them")
        target[leaf] = value
    return out


def _writable_db(db: Optional[Path]) -> Path:
    """The results database a command that stores runs writes to, checked before anything starts.

    A missing file is fine (it is created, with its folders, when the run starts); nothing is
    created here.

    Raises:
        UserError: the path is a folder; an existing file that is not SQLite or cannot be written;
            a file where a folder of the path should be; a folder that cannot be written.
    """
    import sqlite3

    path = _db(db)
    hint = "allowed: a new file or an existing ddlscope results database (default ./ddlscope-results/ddlscope.db)"
    if path.is_dir():
        raise UserError(f"--db {path} is a folder; {hint}")
    if path.exists():
        if not os.access(path, os.R_OK | os.W_OK) or not os.access(path.parent, os.W_OK | os.X_OK):
            raise UserError(f"--db {path} cannot be written (it or its folder is read-only); {hint}")
        try:
            con = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
            try:
                con.execute("SELECT count(*) FROM sqlite_master").fetchone()
            finally:
                con.close()
        except sqlite3.DatabaseError as err:
            raise UserError(f"--db {path} is not a ddlscope results database (SQLite): {err}; {hint}") from None
        return path
    folder = path.absolute().parent
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise UserError(f"--db {path}: {folder} is a file, not a folder; {hint}")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UserError(f"--db {path}: the folder {folder} cannot be written; {hint}")
    return path


@contextmanager
def _interruptible():
    """Ctrl-C during a run: the launcher has stopped every worker and stored the run; exit 130."""
    try:
        yield
    except KeyboardInterrupt:
        typer.echo("interrupted: every worker was stopped; what was measured is stored", err=True)
        raise typer.Exit(130) from None


def _echo_outcome(db: Path, run_id: str) -> None:
    """One line: the run's id, status and, if it did not complete, why; exit 1 if it failed."""
    from ddlscope.store.db import ResultsStore

    with ResultsStore(db) as store:
        row = store.run(run_id)
    line = f"run {run_id} {row['status']}" + (f": {row['reason']}" if row["reason"] else "") + f" (stored in {db})"
    typer.echo(line, err=row["status"] != "completed")
    if row["status"] != "completed":
        raise typer.Exit(130 if row["status"] == "interrupted" else 1)


def _report_json(path: Path) -> dict[str, Any]:
    """The report written at ``path`` (``report.html``) as a JSON-ready dict: ``report``, the path, and
    the fields of its ``summary.json`` (:func:`ddlscope.analyze.report.write_report`: the threshold, the
    baseline and every run's summary with speedup, accuracy decrease and time-to-accuracy)."""
    return {"report": str(path), **json.loads((path.parent / "summary.json").read_text())}


@app.command()
def quickstart(
    db: Optional[Path] = DbOption,
    model: str = typer.Option("resnet18", help="zoo network (thesis 000 uses ResNet-18)"),
    dataset: str = typer.Option("digits", help="dataset name or local path"),
    sample_budget: int = typer.Option(3200, help="samples shared by all peers of a run"),
    batch_size: int = typer.Option(32, help="samples per peer per step"),
    target_batch_size: int = typer.Option(128, help="collaborative: samples per global epoch"),
    matchmaking_time_s: float = typer.Option(2.0, help="collaborative: seconds to form an averaging group"),
    peers: int = typer.Option(2, help="collaborative peers; the cores are split evenly among them"),
    progress: bool = typer.Option(True, help="show progress bars"),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
):
    """The main job: one machine versus collaborating Hivemind peers with the same total CPUs.

    Trains the baseline ('single') on all cores, then --peers collaborative peers with an equal
    share of the cores each, on the same sample budget and real data (the bundled handwritten
    digits), and writes a report comparing runtime, throughput, accuracy and where the time went.
    """
    from ddlscope.analyze.report import report_runs
    from ddlscope.config import available_cores, check_runnable, validate_config
    from ddlscope.launch.local import run_local

    cores = available_cores()
    if peers > len(cores):
        raise UserError(f"--peers {peers} needs one core per peer, this machine gives {len(cores)}; allowed: 1..{len(cores)}")
    group = f"quickstart-{time.strftime('%Y%m%d-%H%M%S')}"
    common = dict(model=model, dataset=dataset, sample_budget=sample_budget, batch_size=batch_size,
                  eval_every_steps=10, loader_workers=1)
    baseline = validate_config(dict(common, name="baseline-single", strategy="single",
                                    vcpus_per_peer=len(cores)))
    collab = validate_config(dict(common, name=f"collaborative-{peers}peers", strategy="collaborative", peers=peers,
                                  vcpus_per_peer=len(cores) // peers,
                                  collaborative=dict(target_batch_size=target_batch_size,
                                                     matchmaking_time_s=matchmaking_time_s, averaging_timeout_s=60)))
    db_path = _writable_db(db)
    check_runnable(baseline)  # the peers train the same model on the same data
    with stdout_to_stderr(as_json):
        typer.echo(f"baseline: {model} on {dataset}, {len(cores)} cores, budget {sample_budget} samples")
        with _interruptible():
            run_ids = [run_local(baseline, db_path, group, progress)]
            typer.echo(f"collaborative: {peers} peers x {len(cores) // peers} core(s), "
                       f"target batch size {target_batch_size}")
            run_ids.append(run_local(collab, db_path, group, progress))
        path = report_runs(db_path, run_ids, db_path.parent / "reports" / group)
        typer.echo(f"report: {path}")
    if as_json:
        echo_json(dict(group=group, **_report_json(path)))


@app.command()
def run(
    config: Optional[Path] = typer.Argument(None, help="TOML run config ([run], [distributed] and the models' own tables)"),
    set_: list[str] = typer.Option([], "--set", metavar="KEY=VALUE",
                                   help="override a field, e.g. --set batch_size=64 --set collaborative.target_batch_size=512"),
    db: Optional[Path] = DbOption,
    group: Optional[str] = typer.Option(None, help="label tying runs together for reports"),
    local_peers: Optional[int] = typer.Option(None, help="start only this many peers here; the rest join with 'ddlscope peer'"),
    nnodes: int = typer.Option(1, min=1, help="cluster: nodes that each run this same command (models launched by "
                                              "torchrun, see 'ddlscope models')"),
    rdzv_endpoint: Optional[str] = typer.Option(None, help="cluster: HOST:PORT of the rendezvous on the first node"),
    run_id: Optional[str] = typer.Option(None, help="cluster: the same run id on every node"),
    local_addr: Optional[str] = typer.Option(None, help="cluster: this node's address as the other nodes reach it "
                                                         "(its rendezvous role and gloo's interface follow; default: "
                                                         "what the host name resolves to)"),
    progress: bool = typer.Option(True),
    as_json: bool = typer.Option(False, "--json", help="print the stored run (as 'ddlscope runs --json' does) as JSON "
                                                       "on stdout; progress and the outcome line go to stderr"),
):
    """Train one run (any distribution model), measured and stored.

    On a cluster, run the same command on every node with --nnodes, --rdzv-endpoint and --run-id;
    each node starts peers / nnodes workers (torchrun) and stores them in its own database.
    """
    from ddlscope.config import check_runnable, load_config, validate_config
    from ddlscope.launch.local import run_local

    if nnodes > 1 and not (rdzv_endpoint and run_id):
        raise UserError(f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT (the first node) and --run-id NAME, "
                        f"the same on every node")
    if local_addr is not None and nnodes == 1:
        raise UserError(f"--local-addr {local_addr} is for a cluster: it needs --nnodes >= 2 (with --rdzv-endpoint "
                        f"and --run-id)")
    if config is None and not set_:
        raise UserError("give a run config file or --set fields, e.g. ddlscope run --set model='\"tiny_cnn\"' "
                        "--set dataset='\"digits\"' (every field: docs/config.md; the main job: ddlscope quickstart)")
    overrides = _parse_sets(set_)
    cfg = load_config(config, overrides, nnodes) if config else validate_config(overrides, nnodes)
    _check_local_peers(cfg, local_peers, nnodes)
    db_path = _writable_db(db)
    check_runnable(cfg, local_peers or cfg.peers // nnodes)
    if local_addr is not None:
        from ddlscope.launch.local import interface_of

        interface_of(local_addr)  # an address of this host, before anything starts
    with stdout_to_stderr(as_json), _interruptible():
        run_id = run_local(cfg, db_path, group, progress, local_peers, nnodes=nnodes, rdzv_endpoint=rdzv_endpoint,
                           run_id=run_id, local_addr=local_addr)
    if as_json:
        from ddlscope.store.db import ResultsStore

        with ResultsStore(db_path) as store:
            echo_json(_run_record(store, store.run(run_id)))
    with stdout_to_stderr(as_json):
        _echo_outcome(db_path, run_id)


def _check_local_peers(cfg, local_peers: Optional[int], nnodes: int) -> None:
    """``--local-peers``: only for swarm models (the others start every worker themselves), 1..peers.

    Raises:
        UserError: naming the option, the value and what is allowed.
    """
    from ddlscope import distribution

    if local_peers is None:
        return
    swarm = distribution.with_launcher("swarm")
    if cfg.distribution_model.launcher != "swarm":
        raise UserError(f"--local-peers {local_peers}: {cfg.strategy} starts all its workers itself; allowed with "
                        f"{', '.join(swarm)} (the other peers join with 'ddlscope peer')")
    if nnodes > 1:
        raise UserError(f"--local-peers with --nnodes {nnodes}: --nnodes is for models launched by torchrun")
    if not 1 <= local_peers <= cfg.peers:
        raise UserError(f"--local-peers {local_peers}: allowed: 1..{cfg.peers} (peers = {cfg.peers})")


@app.command()
def suite(
    suite_file: str = typer.Argument(..., metavar="SUITE", help="suite TOML file ([suite] table) or a preset: local, thesis"),
    db: Optional[Path] = DbOption,
    out: Optional[Path] = typer.Option(None, help="report folder (default <db folder>/reports/suite-NAME)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="list the cells and exit"),
    rerun: bool = typer.Option(False, help="run cells again even if a completed run of them is stored"),
    report_only: bool = typer.Option(False, "--report-only", help="only (re)write the report from stored cells"),
    progress: bool = typer.Option(True),
    as_json: bool = typer.Option(False, "--json", help="print the cells (with --dry-run: the planned cells) as JSON "
                                                       "on stdout; everything else goes to stderr"),
):
    """Distribution-model benchmark suite: seconds per epoch, speedup and step breakdown per cell (thesis 002 ch. 3)."""
    from ddlscope.store.db import ResultsStore
    from ddlscope.suite.report import print_suite, write_suite_report
    from ddlscope.suite.runner import run_suite, suite_results
    from ddlscope.suite.spec import expand, load_suite

    spec = load_suite(suite_file)
    cells = expand(spec)
    if dry_run:
        planned = [{"label": c.label, "strategy": c.strategy, "batch_size": c.values["batch_size"],
                    "microbatches": (c.values.get("distributed") or {}).get("microbatches")} for c in cells]
        if as_json:
            echo_json({"suite": spec.name, "cells": planned})
            return
        for c in planned:
            mb = f", {c['microbatches']} micro-batches" if c["microbatches"] else ""
            typer.echo(f"{c['label']}: batch {c['batch_size']} per worker{mb}")
        typer.echo(f"{len(cells)} cells")
        return
    with stdout_to_stderr(as_json):
        db_path = _existing_db(db) if report_only else _writable_db(db)
        if not report_only:
            with _interruptible():
                run_suite(spec, db_path, progress=progress, rerun=rerun)
        with ResultsStore(db_path) as store:
            results = suite_results(store, spec.name)
        if not results:
            raise UserError(f"no stored cells of suite {spec.name!r} in {db_path}; run it first without --report-only")
        if not as_json:
            print_suite(results)
        path = write_suite_report(results, out or db_path.parent / "reports" / f"suite-{spec.name}", spec.name)
        typer.echo(f"report: {path}")
    if as_json:
        echo_json({"suite": spec.name, "report": str(path), "cells": [r.to_dict() for r in results]})


@app.command()
def sweep(
    grid: Optional[Path] = typer.Argument(None, help="grid TOML file ([base] and [axes] tables)"),
    preset: Optional[str] = typer.Option(None, help="a built-in grid instead of a file (see --list-presets)"),
    list_presets: bool = typer.Option(False, "--list-presets", help="list the built-in grids and exit"),
    name: Optional[str] = typer.Option(None, help="sweep name = the runs' group (default: the grid's name)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="list the cells with their estimated time; run nothing"),
    max_cells: int = typer.Option(200, min=1, max=100_000, help="refuse grids that expand to more cells than this"),
    retry_failed: bool = typer.Option(True, "--retry-failed/--skip-failed",
                                      help="run cells whose last run failed again (default) or skip them"),
    db: Optional[Path] = DbOption,
    progress: bool = typer.Option(True, help="show the sweep's progress bar"),
    as_json: bool = typer.Option(False, "--json", help="print the cells' outcomes (with --dry-run: the plan; with "
                                                       "--list-presets: the presets) as JSON on stdout; everything "
                                                       "else goes to stderr"),
):
    """Run a grid of runs (one cell after another, stored in the group NAME); reruns skip finished cells."""
    from ddlscope.config import available_cores
    from ddlscope.sweep.grid import expand_grid, load_grid
    from ddlscope.sweep.presets import describe_presets, preset_grid

    if list_presets:
        if as_json:
            echo_json(describe_presets())
            return
        for preset_name, text in describe_presets().items():
            typer.echo(f"{preset_name}: {text}")
        return
    if (grid is None) == (preset is None):
        raise UserError("give either a grid file or --preset NAME (see --list-presets)")
    if grid is not None:
        plan = load_grid(grid, max_cells, name)
    else:
        plan = expand_grid(preset_grid(preset, len(available_cores())), name or preset, max_cells)
    if dry_run:
        cells = _sweep_plan(plan, _db(db))
        if as_json:
            echo_json({"sweep": plan.name, "cells": cells,
                       "estimated_remaining_s": sum(c["estimated_s"] for c in cells if c["stored"] != "completed")})
        else:
            _print_sweep_plan(plan.name, cells)
        return
    from ddlscope.sweep.runner import run_sweep

    _writable_db(db)
    with stdout_to_stderr(as_json), _interruptible():
        outcomes = run_sweep(plan, _db(db), progress, retry_failed)
    counts = {s: sum(o.status == s for o in outcomes) for s in ("completed", "failed", "skipped")}
    if as_json:
        echo_json({"sweep": plan.name, "db": str(_db(db)), "counts": counts,
                   "cells": [{"label": o.cell.label, "key": o.cell.key, "status": o.status, "run_id": o.run_id,
                              "reason": o.reason} for o in outcomes]})
    with stdout_to_stderr(as_json):
        typer.echo(f"sweep {plan.name}: {counts['completed']} completed, {counts['failed']} failed, "
                   f"{counts['skipped']} skipped (already stored) of {len(outcomes)} cells (stored in {_db(db)})")
        for o in outcomes:
            if o.status == "failed":
                typer.echo(f"  failed {o.cell.label} (run {o.run_id}): {o.reason}", err=True)
        typer.echo(f"report: ddlscope sweep-report {plan.name}" + (f" --db {db}" if db else ""))
    if counts["failed"]:
        raise typer.Exit(1)


SWEEP_KEYS_MIN_WIDTH = 140
"""Columns from which ``sweep --dry-run`` shows each cell's key (canonical JSON of its overrides)."""


def _sweep_plan(plan, db_path: Path) -> list[dict[str, Any]]:
    """The --dry-run rows: every cell, its run shape, estimated seconds and its status in the store
    (``-``: not stored)."""
    from ddlscope.store.db import ResultsStore
    from ddlscope.experiments.estimate import estimate_cell_s
    from ddlscope.experiments.runner import stored_cells

    stored = {}
    if db_path.exists():
        with ResultsStore(db_path) as store:
            stored = stored_cells(store, plan.name)
    return [{"index": i, "label": c.label, "strategy": c.config.strategy, "peers": c.config.peers,
             "vcpus_per_peer": c.config.cores_per_peer(), "steps_per_peer": c.config.max_steps_per_peer(),
             "estimated_s": estimate_cell_s(c.config), "stored": stored.get(c.key, {}).get("status", "-"),
             "key": c.key} for i, c in enumerate(plan.cells)]


def _print_sweep_plan(name: str, cells: list[dict[str, Any]]) -> None:
    """The --dry-run table (:func:`_sweep_plan`'s rows) and the estimated time of the cells still to run; the
    cells' keys only in a terminal at least :data:`SWEEP_KEYS_MIN_WIDTH` wide."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console()
    with_keys = console.width >= SWEEP_KEYS_MIN_WIDTH  # a key is as long as the rest of its row
    table = Table(title=f"sweep {name}: {len(cells)} cells",
                  caption=None if with_keys else "cell keys: a wider terminal or --json")
    columns = ("#", "cell", "strategy", "peers x vCPUs", "steps/peer", "est. s", "stored") + ("key",) * with_keys
    for col in columns:
        table.add_column(col, justify="right" if col in ("#", "steps/peer", "est. s") else "left", overflow="fold")
    for c in cells:
        table.add_row(*(Text(v) for v in (str(c["index"]), c["label"], c["strategy"],
                                          f"{c['peers']} x {c['vcpus_per_peer']}", str(c["steps_per_peer"] or "-"),
                                          f"{c['estimated_s']:.0f}", c["stored"], c["key"])[:len(columns)]))
    total = sum(c["estimated_s"] for c in cells if c["stored"] != "completed")
    console.print(table)
    console.print(f"estimated time of the cells still to run: {total / 60:.1f} min "
                  f"(ResNet-18 figures of this project's 2-core machine; see ddlscope/experiments/estimate.py)")


@app.command()
def peer(
    run_id: str = typer.Option(..., help="the run id printed by 'ddlscope run --local-peers'"),
    index: int = typer.Option(..., help="this peer's index (0 .. peers-1), unique in the run"),
    peers: int = typer.Option(..., help="peers in the run"),
    initial_peers: list[str] = typer.Option(..., help="multiaddr of a peer in the swarm (repeatable)"),
    strategy: Optional[str] = typer.Option(None, help="the run's distribution model, one launched as a swarm "
                                                      "(default: the only such model; see 'ddlscope models')"),
    config: Optional[Path] = typer.Option(None, help="the run's TOML config (same as the other peers')"),
    set_: list[str] = typer.Option([], "--set", metavar="KEY=VALUE", help="config overrides, as for 'run'"),
    listen: list[str] = typer.Option([], help="multiaddr to listen on, e.g. /ip4/0.0.0.0/tcp/31337 (default loopback)"),
    cores: Optional[str] = typer.Option(None, help="comma-separated core ids (default: all)"),
    db: Optional[Path] = DbOption,
):
    """Join a swarm run (a model whose launcher is 'swarm') by hand, say from another host; results go to this host's --db."""
    from ddlscope.config import check_runnable, load_config, validate_config
    from ddlscope.launch.processes import reap_when_gone
    from ddlscope.store.db import ResultsStore
    from ddlscope.train.worker import serve_worker

    overrides = dict(_parse_sets(set_), peers=peers, strategy=_swarm_model(strategy), vcpus_per_peer=1)
    cfg = load_config(config, overrides) if config else validate_config(overrides)
    if not 0 <= index < peers:
        raise UserError(f"--index {index}: allowed 0..{peers - 1}")
    core_ids = _core_ids(cores)
    _writable_db(db)
    check_runnable(cfg)
    with ResultsStore(_db(db)) as store:
        store.create_run(cfg.run_label, cfg.strategy, cfg.model_dump(mode="json"), run_id=run_id)
    reap_when_gone()  # hivemind's DHT process and p2pd end with this command, even on SIGKILL
    code = serve_worker(str(_db(db)), run_id, index, peers, core_ids, initial_peers, listen or None)
    with ResultsStore(_db(db)) as store:
        store.finish_run(run_id, {0: "completed", 130: "interrupted"}.get(code, "failed"))
    raise typer.Exit(code)


def _core_ids(cores: Optional[str]) -> list[int]:
    """``--cores 0,1`` -> [0, 1] (default: every core this process may use).

    Raises:
        UserError: an entry that is not a core id this process may use.
    """
    from ddlscope.config import available_cores

    allowed = available_cores()
    if not cores:
        return allowed
    parts = [c.strip() for c in cores.split(",")]
    if not all(p.isdigit() and int(p) in allowed for p in parts):
        raise UserError(f"--cores {cores!r}: allowed: comma-separated core ids among {allowed}")
    return [int(p) for p in parts]


def _swarm_model(strategy: Optional[str]) -> str:
    """``strategy`` if it is launched as a swarm, else (None) the only registered swarm model.

    Raises:
        UserError: ``strategy`` is unknown or not a swarm model, or None while not exactly one swarm model exists.
    """
    from ddlscope import distribution

    swarm = distribution.with_launcher("swarm")
    if strategy is None:
        if len(swarm) != 1:
            raise UserError(f"give --strategy: 'ddlscope peer' joins a swarm; allowed: {', '.join(swarm) or 'none registered'}")
        return swarm[0]
    launcher = distribution.get(strategy).launcher
    if launcher != "swarm":
        raise UserError(f"--strategy {strategy}: 'ddlscope peer' joins a swarm, but {strategy} is launched by "
                        f"{launcher}; allowed: {', '.join(swarm) or 'none registered'}")
    return strategy


@app.command("serve-experts")
def serve_experts(
    index: int = typer.Option(0, help="this server's index: it hosts every servers-th expert of the grid from the "
                                      "index-th on (dmoe.servers says how many servers share the grid)"),
    config: Optional[Path] = typer.Option(None, help="a run config with the [dmoe] table the trainers use"),
    set_: list[str] = typer.Option([], "--set", metavar="KEY=VALUE", help="config overrides, as for 'run'"),
    initial_peers: list[str] = typer.Option([], help="multiaddr of a running expert server (repeatable); none: this "
                                                     "server starts the swarm"),
    run_id: Optional[str] = typer.Option(None, help="the id this server's measurements get in --db (default: new)"),
    cores: Optional[str] = typer.Option(None, help="comma-separated core ids (default: all)"),
    db: Optional[Path] = DbOption,
):
    """Serve a share of a mixture-of-experts grid from this host until Ctrl-C (a volunteer's machine, say).

    It prints the multiaddrs trainers on other hosts join with --set dmoe.initial_peers='["..."]';
    listen on a public address with --set dmoe.listen_host='"0.0.0.0"'. Its batches, CPU and memory
    go to this host's --db.
    """
    from ddlscope import distribution
    from ddlscope.config import load_config, validate_config
    from ddlscope.launch.processes import reap_when_gone
    from ddlscope.moe.server import serve
    from ddlscope.store.db import ResultsStore

    with_services = [m.name for m in distribution.all_models() if m.services is not None]
    overrides = dict(_parse_sets(set_), strategy=with_services[0])
    cfg = load_config(config, overrides) if config else validate_config(overrides)
    servers = cfg.model_options()["servers"]
    if not 0 <= index < servers:
        raise UserError(f"--index {index}: allowed 0..{servers - 1} (dmoe.servers = {servers})")
    core_ids = _core_ids(cores)
    _writable_db(db)
    with ResultsStore(_db(db)) as store:
        run_id = store.create_run(f"{cfg.run_label}-server{index}", cfg.strategy, cfg.model_dump(mode="json"),
                                  run_id=run_id)
    reap_when_gone()  # the experts' DHT process and p2pd end with this command, even on SIGKILL
    code = serve(str(_db(db)), run_id, index, 0, core_ids, initial_peers)
    with ResultsStore(_db(db)) as store:
        store.finish_run(run_id, "completed" if code == 0 else "failed")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # hivemind leaves non-daemon threads behind its shutdown


@app.command()
def bootstrap(listen: list[str] = typer.Option(["/ip4/127.0.0.1/tcp/0"], help="multiaddr(s) to listen on")):
    """Run a DHT-only bootstrap peer (the thesis's "messenger") until Ctrl-C; prints its multiaddrs."""
    import hivemind

    from ddlscope.launch.network import p2p_options
    from ddlscope.launch.processes import reap_when_gone

    reap_when_gone()  # the DHT process and p2pd end with this command, even on SIGKILL
    dht = hivemind.DHT(host_maddrs=listen, start=True, **p2p_options())
    for addr in dht.get_visible_maddrs():
        typer.echo(str(addr))
    from ddlscope import distribution

    options = [f"{distribution.get(n).config_table}.initial_peers" for n in distribution.with_launcher("swarm")]
    typer.echo(f"pass these as {' or '.join(options)}; Ctrl-C to stop", err=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        dht.shutdown()


@app.command()
def report(
    run_ids: list[str] = typer.Argument(None, metavar="RUN_ID", help="runs to compare (default: the newest group)"),
    group: Optional[str] = typer.Option(None, help="compare all runs of this group"),
    db: Optional[Path] = DbOption,
    out: Optional[Path] = typer.Option(None, help="report folder"),
    threshold: Optional[float] = typer.Option(None, help="accuracy for time-to-accuracy (default 0.9 x baseline's)"),
    as_json: bool = typer.Option(False, "--json", help="print the comparison (the report's summary.json and its path) "
                                                       "as JSON instead of the table"),
):
    """Compare runs (baseline = first completed run of the baseline model, see 'ddlscope models') and write an HTML/Markdown report."""
    from ddlscope.analyze.report import report_runs
    from ddlscope.store.db import ResultsStore

    db_path = _existing_db(db)
    with ResultsStore(db_path) as store:
        if not run_ids:
            runs = store.runs()
            if not runs:
                raise UserError(f"no runs in {db_path}")
            group = group or runs[0]["group_name"]
            run_ids = [r["run_id"] for r in store.runs(group)] if group else [runs[0]["run_id"]]
        known = {r["run_id"] for r in store.runs()}
        missing = [r for r in run_ids if r not in known]
        if missing:
            raise UserError(f"unknown run id(s) {missing} in {db_path}; see 'ddlscope runs'")
    out = out or db_path.parent / "reports" / (group or "-".join(run_ids))
    with stdout_to_stderr(as_json):  # with --json the table goes to stderr
        path = report_runs(db_path, run_ids, out, threshold)
        typer.echo(f"report: {path}")
    if as_json:
        echo_json(_report_json(path))


@app.command("sweep-report")
def sweep_report(
    name: str = typer.Argument(..., help="the sweep's name (its runs' group)"),
    db: Optional[Path] = DbOption,
    out: Optional[Path] = typer.Option(None, help="report folder (default <db folder>/reports/sweep-NAME)"),
    as_json: bool = typer.Option(False, "--json", help="print the views (the report's sweep_report.json and its path) "
                                                       "as JSON instead of the Markdown"),
):
    """Thesis 000's views over a sweep: plots + tables (Markdown, JSON), matchmaking analysis included."""
    from ddlscope.analyze.sweep_report import write_sweep_report
    from ddlscope.store.db import ResultsStore

    db_path = _existing_db(db)
    with ResultsStore(db_path) as store:
        path = write_sweep_report(store, name, out or db_path.parent / "reports" / f"sweep-{name}")
    if as_json:
        echo_json({"sweep": name, "report": str(path), **json.loads(path.with_name("sweep_report.json").read_text())})
        typer.echo(f"report: {path}", err=True)
        return
    typer.echo(path.read_text())
    typer.echo(f"report: {path}")


@app.command()
def matchmaking(
    run_ids: list[str] = typer.Argument(None, metavar="RUN_ID",
                                        help="run id(s) of a model with matchmaking to analyze together"),
    group: Optional[str] = typer.Option(None, help="analyze every run with matchmaking of this group or sweep"),
    db: Optional[Path] = DbOption,
    as_json: bool = typer.Option(False, "--json", help="print the analysis as JSON instead of the Markdown"),
    out: Optional[Path] = typer.Option(None, "--out", help="also write the analysis as JSON to this file"),
):
    """Averaging rounds of runs whose model forms groups by matchmaking (collaborative): group sizes, solo rounds,
    waits; recommends matchmaking_time_s."""
    from ddlscope.analyze.matchmaking import (analyze_matchmaking, matchmaking_applies, matchmaking_models,
                                              print_matchmaking)
    from ddlscope.store.db import ResultsStore

    if bool(run_ids) == bool(group):
        raise UserError("give run id(s) or --group NAME (not both)")
    if out is not None and out.is_dir():
        raise UserError(f"--out {out} is a folder; allowed: a file path, e.g. {out / 'matchmaking.json'}")
    db_path = _existing_db(db)
    with ResultsStore(db_path) as store:
        ids = [r["run_id"] for r in store.runs(group)] if group else run_ids
        known = {r["run_id"]: r["strategy"] for r in store.runs()}
        missing = [r for r in ids if r not in known]
        if missing or not ids:
            raise UserError(f"unknown run id(s) {missing} in {db_path}; see 'ddlscope runs'" if missing
                            else f"no runs in group {group!r} in {db_path}")
        if not any(matchmaking_applies(known[r]) for r in ids):
            raise UserError(f"no run with matchmaking among {ids}; matchmaking applies to strategy "
                            f"{' or '.join(repr(n) for n in matchmaking_models())}")
        analysis = analyze_matchmaking(store, ids)
    if out is not None:
        out.write_text(strict_json(analysis.to_dict()) + "\n")
    if as_json:
        echo_json(analysis.to_dict())
    else:
        print_matchmaking(analysis)


def _existing_db(db: Optional[Path]) -> Path:
    """The results database a read-only command reads; it must exist, nothing is created.

    Runs still ``running`` whose processes are all gone from this host are marked ``interrupted``
    first (:meth:`ResultsStore.mark_stale_runs`), each with a note on stderr.

    Raises:
        UserError: no database file at the path (a missing file or folder, or a folder), or the file is
            not an SQLite database.
    """
    import sqlite3

    from ddlscope.store.db import ResultsStore

    db_path = _db(db)
    if not db_path.is_file():
        where = f"{db_path} is a folder, not a results database" if db_path.is_dir() else f"no results database at {db_path}"
        raise UserError(f"{where}; one is made by 'ddlscope run', 'quickstart', 'sweep' or 'suite' "
                        f"(default ./ddlscope-results/ddlscope.db), or pass --db PATH of an existing one")
    try:
        with ResultsStore(db_path) as store:
            for run_id in store.mark_stale_runs():
                row = store.run(run_id)
                typer.echo(f"note: run {run_id} marked interrupted: {row['reason']}" if row["status"] != "running" else
                           f"note: run {run_id}'s processes are gone, but it cannot be marked interrupted "
                           f"(the database cannot be written)", err=True)
    except sqlite3.DatabaseError as err:
        raise UserError(f"{db_path} is not a ddlscope results database (SQLite): {err}") from None
    return db_path


@app.command()
def models(as_json: bool = typer.Option(False, "--json", help="print the registry as JSON")):
    """List the registered distribution models: launcher, what a run measures, what the predictor predicts."""
    from ddlscope import distribution

    rows = [{"name": m.name, "summary": m.summary, "launcher": m.launcher, "workers": _workers_text(m),
             "config_table": m.config_table, "measures": m.measures, "predicts": m.predicts,
             "cost_model": m.cost_model is not None, "memory_model": m.memory_model is not None}
            for m in distribution.all_models()]
    if as_json:
        echo_json(rows)
        return
    for r in rows:
        table = f", [{r['config_table']}]" if r["config_table"] else ""
        typer.echo(f"{r['name']:<14} {r['summary']}\n{'':<14} launcher {r['launcher']}, workers {r['workers']}{table}; "
                   f"measures: {r['measures']}; predicts: {r['predicts']}")


def _workers_text(m) -> str:
    if m.max_workers == m.min_workers:
        return str(m.min_workers)
    return f">= {m.min_workers}" if m.max_workers is None else f"{m.min_workers}..{m.max_workers}"


@app.command()
def runs(
    db: Optional[Path] = DbOption,
    status: Optional[str] = typer.Option(None, help="only runs with this status: running, completed, failed or interrupted"),
    group: Optional[str] = typer.Option(None, help="only the runs of this group (or sweep, suite)"),
    as_json: bool = typer.Option(False, "--json", help="print full records (config and workers included) as JSON"),
):
    """List stored runs, newest first, then the full reason of each that did not complete.

    Runs whose processes are gone (killed) are marked interrupted first.
    """
    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from ddlscope.store.db import RUN_STATUSES, ResultsStore

    if status is not None and status not in RUN_STATUSES:
        raise UserError(f"--status {status!r}: allowed: {', '.join(RUN_STATUSES)}")
    with ResultsStore(_existing_db(db)) as store:
        rows = [r for r in store.runs(group) if status is None or r["status"] == status]
        rows.sort(key=lambda r: r["created_at"], reverse=True)
        records = [_run_record(store, r) for r in rows] if as_json else []
    if as_json:
        echo_json(records)
        return
    if not rows:
        which = " and ".join(f for f in (f"status {status}" if status else "", f"group {group!r}" if group else "") if f)
        typer.echo(f"no runs{' with ' + which if which else ''} in {_db(db)}", err=True)
        return
    table = Table(box=box.SIMPLE_HEAD)
    for col in ("id", "group", "name", "strategy", "status", "created"):
        table.add_column(col, overflow="fold", no_wrap=col in ("id", "status", "created"))
    for r in rows:
        table.add_row(*(Text(v) for v in (r["run_id"], r["group_name"] or "", r["name"], r["strategy"], r["status"],
                                          time.strftime("%Y-%m-%d %H:%M", time.localtime(r["created_at"])))))
    console = Console()
    console.print(table)
    reasons = Table.grid(padding=(0, 2))  # full reasons, wrapped to the terminal, below the table
    reasons.add_column(no_wrap=True)
    reasons.add_column(overflow="fold", ratio=1)
    for r in rows:
        if r["reason"]:
            reasons.add_row(Text(r["run_id"]), Text(r["reason"]))
    if reasons.row_count:
        console.print("why runs did not complete:")
        console.print(reasons)


def _run_record(store, row) -> dict[str, Any]:
    """A run as a JSON-ready dict: every ``runs`` column, ``config`` parsed, and its ``workers`` rows."""
    record = {k: row[k] for k in row.keys() if k != "config_json"}
    record["config"] = json.loads(row["config_json"])
    record["workers"] = [dict(w) for w in store.workers(row["run_id"])]
    return record


@app.command("rm")
def rm(
    run_ids: list[str] = typer.Argument(None, metavar="RUN_ID", help="ids of the runs to delete (see 'ddlscope runs')"),
    group: Optional[str] = typer.Option(None, help="delete every run of this group (or sweep, suite)"),
    db: Optional[Path] = DbOption,
    yes: bool = typer.Option(False, "--yes", "-y", help="delete without asking (needed when stdin is not a terminal)"),
    force: bool = typer.Option(False, "--force", help="also delete runs that are still running"),
):
    """Delete runs with every row stored for them (steps, evaluations, host samples, events, workers, predictions)
    and their worker logs."""
    import shutil

    from ddlscope.store.db import ResultsStore

    if bool(run_ids) == bool(group):
        raise UserError("give run id(s) or --group NAME (not both)")
    db_path = _existing_db(db)
    with ResultsStore(db_path) as store:
        if group:
            rows = store.runs(group)
            if not rows:
                raise UserError(f"no runs in group {group!r} in {db_path}; see 'ddlscope runs'")
        else:
            ids = list(dict.fromkeys(run_ids))
            missing = [r for r in ids if store.run(r) is None]
            if missing:
                raise UserError(f"unknown run id(s) {', '.join(missing)} in {db_path}; see 'ddlscope runs'")
            rows = [store.run(r) for r in ids]
        running = [r for r in rows if r["status"] == "running"]
        if running and not force:
            raise UserError(f"run(s) {', '.join(r['run_id'] for r in running)} still running (a process of theirs is "
                            f"alive, or they run on another host); stop them first, or pass --force to delete anyway")
        for r in rows:
            typer.echo(f"{r['run_id']}  {r['group_name'] or '-'}  {r['name']}  {r['status']}")
        if not yes:
            if not sys.stdin.isatty():
                raise UserError(f"rm would delete the {len(rows)} run(s) above; stdin is not a terminal, "
                                f"so pass --yes to confirm")
            if not typer.confirm(f"delete these {len(rows)} run(s) and all their rows from {db_path}?"):
                typer.echo("nothing deleted", err=True)
                raise typer.Exit(1)
        deleted = store.delete_runs([r["run_id"] for r in rows])
    removed_logs = 0
    for r in rows:
        folder = db_path.parent / "logs" / r["run_id"]
        if folder.is_dir():
            shutil.rmtree(folder, ignore_errors=True)
            removed_logs += 1
    rows_text = ", ".join(f"{n} {table} rows" for table, n in deleted.items() if table != "runs")
    logs_text = f"; {removed_logs} log folder(s)" if removed_logs else ""
    typer.echo(f"deleted {deleted.get('runs', 0)} run(s) from {db_path}: {rows_text or 'no other rows'}{logs_text}")


@app.command()
def export(
    run_ids: list[str] = typer.Argument(None, metavar="RUN_ID", help="ids of the runs to export (see 'ddlscope runs')"),
    group: Optional[str] = typer.Option(None, help="export every run of this group (or sweep, suite)"),
    to: str = typer.Option(..., "--to", help="tensorboard | wandb | mlflow | csv | parquet | trace"),
    db: Optional[Path] = DbOption,
    out: Optional[Path] = typer.Option(None, help="output folder (default <db folder>/exports/<target>)"),
):
    """Export runs: TensorBoard event files, W&B offline runs, an MLflow SQLite store, CSV/Parquet tables, or a
    Chrome/Perfetto trace (no server, no network). Details: docs/export.md."""
    from ddlscope.export import OPEN_HINTS, TARGETS, export_runs
    from ddlscope.store.db import ResultsStore

    if to not in TARGETS:
        raise UserError(f"--to {to!r}: unknown export target; allowed: {', '.join(TARGETS)}")
    if bool(run_ids) == bool(group):
        raise UserError("give run id(s) or --group NAME (not both)")
    db_path = _existing_db(db)
    if group:
        with ResultsStore(db_path) as store:
            run_ids = [r["run_id"] for r in store.runs(group)]
        if not run_ids:
            raise UserError(f"no runs in group {group!r} in {db_path}; see 'ddlscope runs'")
    out = out or db_path.parent / "exports" / to
    for path in export_runs(db_path, run_ids, to, out):
        typer.echo(f"wrote {path}")
    typer.echo(f"open: {OPEN_HINTS[to].format(out=out)}")


@app.command()
def datapipe(
    ctx: typer.Context,
    dataset: str = typer.Argument(..., help="dataset name (digits, mnist, cifar10, imagenet, highres) or folder"),
    loader_workers: str = typer.Option("0,1,2", "--loader-workers",
                                       help="loader worker counts to try, comma-separated, each 0..64"),
    old_workers: Optional[str] = typer.Option(None, "--workers", hidden=True, help="old name of --loader-workers"),
    batch_size: Optional[int] = typer.Option(None, help="samples per batch (default: the run's with --run-id, else 32)"),
    step_time_s: Optional[float] = typer.Option(None, help="your measured compute seconds per training step "
                                                             "(forward + backward + optimizer, no data loading)"),
    run_id: Optional[str] = typer.Option(None, "--run-id", help="take the step time and batch size from this stored run"),
    old_run: Optional[str] = typer.Option(None, "--run", hidden=True, help="old name of --run-id"),
    db: Optional[Path] = DbOption,
    model: str = typer.Option("resnet18", help="model whose step time is measured on synthetic input "
                                                 "when neither --step-time-s nor --run-id gives it"),
    compute_steps: int = typer.Option(5, help="steps timed when measuring the step time"),
    samples: int = typer.Option(1024, help="samples timed per strategy and worker count, after a warm-up batch"),
    max_samples: Optional[int] = typer.Option(None, help="use only this many training samples (default: all)"),
    augment: bool = typer.Option(True, "--augment/--no-augment", help="online augmentation (random crop/flip)"),
    data_root: Optional[Path] = typer.Option(None, help="data root (default $DDLSCOPE_DATA or ~/.cache/ddlscope/data)"),
    cache_dir: Optional[Path] = typer.Option(None, help="cache folder (default <out>/cache)"),
    out: Optional[Path] = typer.Option(None, help="report folder (default ./ddlscope-results/datapipe/<dataset>)"),
    json_: bool = typer.Option(False, "--json", help="print the result as JSON instead of the table"),
    progress: bool = typer.Option(True, help="show progress bars"),
):
    """Compare preprocessing strategies x loader workers for a dataset; say which keeps training fed.

    Strategies: decode-every-step (today's loop), cached-decoded-memory, cached-decoded-disk,
    preprocessed (no online augmentation). Measures loader samples/s, storage bytes and one-time
    build seconds; an option is input-bound when it delivers fewer samples/s than training consumes.
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ddlscope.datapipe.options import DatapipeOptions, parse_workers

    loader_workers = renamed(ctx, "loader_workers", "old_workers")
    run_id = renamed(ctx, "run_id", "old_run")
    opts = DatapipeOptions(dataset, parse_workers(loader_workers), batch_size, samples, max_samples, step_time_s,
                           run_id, db, model, compute_steps, augment, data_root)
    opts.check()  # before torch is imported: a bad option is refused at once
    from ddlscope.datapipe import run_datapipe
    from ddlscope.datapipe.report import print_result, write_report

    out = out or Path.cwd() / "ddlscope-results" / "datapipe" / Path(dataset).name
    console = Console(stderr=True)
    bars = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, disable=not (progress and console.is_terminal), transient=True)
    with stdout_to_stderr(json_), bars:
        result = run_datapipe(opts, cache_dir or out / "cache", bars)
    path = write_report(result, out)
    if json_:
        echo_json(result.to_dict())
        typer.echo(f"report: {path}", err=True)
    else:
        print_result(result)
        typer.echo(f"report: {path}")


@data_app.command("digits")
def data_digits(
    ctx: typer.Context,
    data_root: Optional[Path] = typer.Option(None, "--data-root",
                                            help="data root (default $DDLSCOPE_DATA or ~/.cache/ddlscope/data)"),
    old_root: Optional[Path] = typer.Option(None, "--root", hidden=True, help="old name of --data-root"),
):
    """Write scikit-learn's bundled handwritten digits as PNG files at MNIST geometry (once)."""
    from ddlscope.workloads.datasets import default_data_root, materialize_digits

    typer.echo(materialize_digits(renamed(ctx, "data_root", "old_root") or default_data_root()))


@data_app.command("synthetic")
def data_synthetic(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="mnist, cifar10, imagenet or highres"),
    train_size: int = typer.Option(1024, min=1),
    test_size: int = typer.Option(256, min=1),
    data_root: Optional[Path] = typer.Option(None, "--data-root",
                                            help="data root (default $DDLSCOPE_DATA or ~/.cache/ddlscope/data)"),
    old_root: Optional[Path] = typer.Option(None, "--root", hidden=True, help="old name of --data-root"),
    seed: int = typer.Option(0),
):
    """Write a synthetic dataset in the real dataset's standard format (thesis 002 Table 3.2 shapes)."""
    from ddlscope.workloads.datasets import default_data_root, write_synthetic

    root = renamed(ctx, "data_root", "old_root") or default_data_root()
    typer.echo(write_synthetic(name, root, train_size, test_size, seed))


@app.command()
def examples(
    names: list[str] = typer.Argument(None, metavar="NAME", help="only these examples (file names, as listed)"),
    copy: Optional[Path] = typer.Option(None, "--copy", metavar="DIR",
                                        help="copy the examples into this folder (created if missing)"),
    overwrite: bool = typer.Option(False, help="with --copy: replace files there that differ from the shipped ones"),
    as_json: bool = typer.Option(False, "--json", help="print the examples (name, kind, summary, path) or, with --copy, "
                                                       "the files copied, as one JSON document"),
):
    """List the example cluster files, run configs, sweep grid and scripts that ship with ddlscope, or copy them out.

    Commands that read a TOML file (run, sweep, recommend --cluster, ...) take examples/NAME as well:
    when that path does not exist in the current folder, the shipped copy is read.
    """
    from ddlscope.examples import examples_command

    typer.echo(examples_command(copy, names, overwrite, as_json))


from ddlscope.predict.commands import register as _register_predict_commands  # noqa: E402

_register_predict_commands(app)


def main() -> None:
    """Console entry point: user errors — :class:`UserError` and the command line's own (an unknown
    option, a value of the wrong type) — become one ``error:`` line and exit status 2."""
    errors = sys.modules[typer.BadParameter.__module__]  # click's exception classes, as typer ships them

    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    try:
        code = app(standalone_mode=False)
    except UserError as e:
        _error_line(str(e))
        sys.exit(2)
    except errors.NoArgsIsHelpError:  # 'ddlscope' or 'ddlscope data' alone: the help was printed
        sys.exit(2)
    except errors.UsageError as e:
        command = e.ctx.command_path if e.ctx is not None else "ddlscope"
        _error_line(f"{e.format_message()} (see '{command} --help')")
        sys.exit(2)
    except errors.ClickException as e:
        _error_line(e.format_message())
        sys.exit(e.exit_code)
    except typer.Abort:
        typer.echo("Aborted!", err=True)
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)


def _error_line(message: str) -> None:
    """``error: <message>`` on stderr as one line (line breaks inside the message become spaces)."""
    typer.echo("error: " + " ".join(message.split()), err=True)


if __name__ == "__main__":
    main()
