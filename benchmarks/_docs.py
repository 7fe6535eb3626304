"""Write a benchmark's latest results into a marked block of a docs page (docs/validation.md).

The results tables in the docs are written by the benchmarks, not typed: each benchmark renders
its result (the same dict it writes to ``benchmarks/results/<name>.json``) as Markdown and
replaces the block between ``<!-- <name>:begin -->`` and ``<!-- <name>:end -->`` with it, under a
header that says when, on what machine and at which commit it was measured. Everything outside
the markers is kept byte for byte.

    from _docs import update_docs_block, predictor_markdown
    update_docs_block(DOCS_PAGE, "predictor", predictor_markdown(result))

Used by ``benchmarks/predictor.py``, ``benchmarks/overhead.py``, ``benchmarks/peers.py`` and ``benchmarks/dmoe_overhead.py``; tested by
``tests/test_docs.py``. Torch-free (the machine description asks torch only if it is installed).
"""

from __future__ import annotations

import importlib.util
import os
import platform
import re
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ddlscope.errors import UserError

REPO = Path(__file__).resolve().parent.parent
DOCS_PAGE = REPO / "docs" / "validation.md"
"""The page whose blocks the benchmarks rewrite."""

_NAME = re.compile(r"[a-z][a-z0-9_-]*")


def markers(name: str) -> tuple[str, str]:
    """The begin and end markers of block ``name``: ``<!-- name:begin -->``, ``<!-- name:end -->``.

    Raises:
        UserError: ``name`` is not lower-case letters, digits, ``-`` or ``_`` (starting with a letter).
    """
    if not _NAME.fullmatch(name):
        raise UserError(f"docs block name {name!r}: allowed: lower-case letters, digits, '-' and '_', "
                        "starting with a letter")
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def replace_block(text: str, name: str, body: str) -> str:
    """``text`` with the lines between block ``name``'s markers replaced by ``body``.

    The marker lines stay; ``body`` goes between them on lines of its own; everything before the
    begin marker and after the end marker is unchanged.

    Raises:
        UserError: a marker is missing or appears more than once, or the end marker comes first
            (the message names the markers to add).
    """
    begin, end = markers(name)
    counts = {m: text.count(m) for m in (begin, end)}
    bad = [f"{m!r} {'is missing' if n == 0 else f'appears {n} times'}" for m, n in counts.items() if n != 1]
    if bad:
        raise UserError(f"docs block {name!r}: {'; '.join(bad)}; allowed: exactly one {begin} line followed by "
                        f"one {end} line, around the block the benchmark rewrites")
    head, rest = text.split(begin, 1)
    if end not in rest:
        raise UserError(f"docs block {name!r}: {end!r} comes before {begin!r}; allowed: begin first, then end")
    tail = rest.split(end, 1)[1]
    return f"{head}{begin}\n{body.strip()}\n{end}{tail}"


def _with_block(path: Path, name: str, body: str) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"docs page not found: {path}; allowed: an existing page with the block's markers "
                        f"({' ... '.join(markers(name))})") from None
    return replace_block(text, name, body)


def add_docs_from_arguments(parser) -> None:
    """``--docs-from FILE`` and ``--block NAME`` on a benchmark's argparse ``parser``: render a result
    written elsewhere (e.g. on a lent GPU machine) into the docs, measuring nothing (:func:`docs_from`)."""
    parser.add_argument("--docs-from", type=Path, default=None, help="render this result file's block; measure nothing")
    parser.add_argument("--block", default=None, help="with --docs-from: the docs block to rewrite (default: the "
                                                      "result's own, e.g. an earlier pass kept under another name)")


def docs_from(result_file: Path, docs: Path, block: str | None, default_block, markdown) -> None:
    """Rewrite block ``block`` (default ``default_block(result)``) of ``docs`` with ``markdown(result)``
    of the JSON result in ``result_file``, and say so."""
    import json

    result = json.loads(Path(result_file).read_text())
    block = block or default_block(result)
    update_docs_block(docs, block, markdown(result))
    print(f"rewrote the '{block}' block of {docs}")


def check_docs_block(path: Path, name: str) -> None:
    """Check that the page at ``path`` has block ``name`` (a benchmark calls this before it measures,
    so that a long run does not fail at its last step). Raises what :func:`update_docs_block` raises."""
    _with_block(path, name, "")


def update_docs_block(path: Path, name: str, body: str) -> None:
    """Replace block ``name`` of the page at ``path`` with ``body`` (see :func:`replace_block`).

    The page is rewritten only when the block was found, so a failure leaves it as it was.

    Raises:
        UserError: the page does not exist, or its markers are missing or out of order.
    """
    Path(path).write_text(_with_block(path, name, body), encoding="utf-8")


# ---------------------------------------------------------------------------- provenance

def git_commit(repo: Path = REPO) -> str:
    """The short commit hash of ``repo``'s HEAD, with ``+uncommitted changes`` when the work tree
    differs from it; ``"unknown"`` when git or the repository is unavailable. ``DDLSCOPE_COMMIT``,
    when set, is returned as it is: the commit of a copied tree without ``.git`` (a lent GPU machine)."""
    if os.environ.get("DDLSCOPE_COMMIT"):
        return os.environ["DDLSCOPE_COMMIT"]
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True,
                              timeout=30).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{commit}+uncommitted changes" if dirty else commit


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _gpu() -> str:
    if importlib.util.find_spec("torch") is None:
        return "no GPU"
    import torch

    if not torch.cuda.is_available():
        return "no GPU"
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return ", ".join(f"{names.count(n)} x {n}" for n in dict.fromkeys(names))


def machine_description() -> str:
    """This machine in one line: cores this process may use (of all), CPU model, GPUs, OS.

    E.g. ``"2 cores (of 2), Intel(R) Xeon(R) Processor, no GPU, Linux 6.18"``.
    """
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (f"{usable} cores (of {os.cpu_count()}), {_cpu_model()}, {_gpu()}, "
            f"{platform.system()} {platform.release().split('-')[0]}")


def provenance(script: str, measured_at: str | None = None, machine: str | None = None,
               commit: str | None = None) -> str:
    """The header line of a generated block: which script wrote it, when, where, at which commit.

    Args:
        script: the benchmark's path as a user runs it, e.g. ``"benchmarks/predictor.py"``.
        measured_at: ``"YYYY-MM-DD HH:MM"`` (default: now, local time); machine, commit: default
            :func:`machine_description` and :func:`git_commit`.
    """
    measured_at = measured_at or time.strftime("%Y-%m-%d %H:%M")
    machine = machine or machine_description()
    commit = commit or git_commit()
    return (f"*Written by `python {script}` on {measured_at}; machine: {machine}; commit {commit}. "
            f"Do not edit by hand: the next run of the benchmark replaces this block.*")


# ---------------------------------------------------------------------------- tables

def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """A GitHub Markdown table (cells as given, ``|`` escaped)."""
    def line(cells: list[str]) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    return "\n".join([line(header), line(["---"] * len(header)), *(line(r) for r in rows)])


def _pct(v: float | None, signed: bool = False) -> str:
    return "–" if v is None else format(100 * v, "+.1f" if signed else ".1f") + " %"


def _seconds(v: float | None) -> str:
    if v is None:
        return "–"
    return "< 0.001 s" if v < 0.001 else f"{v:.3f} s" if v < 10 else f"{v:.1f} s"


def predictor_markdown(result: Mapping[str, Any], header: str | None = None) -> str:
    """The block of ``benchmarks/predictor.py``: grid, per-model errors, recommendation and speed.

    Args:
        result: the dict written to ``benchmarks/results/predictor.json``: ``grid`` (the
            validation grid's fields), ``speed`` (``profile_and_predict_s``, ``further_cluster_s``,
            ``further_strategy_s``), ``validation_wall_s`` (this invocation) and ``runs_s`` (the
            grid's stored runs, those it reused included; shown where present), ``summary`` (``ValidationSummary.to_dict()``:
            ``per_model`` / ``per_reference`` of ``{count, median_abs_error, max_abs_error,
            median_error, median_run_spread}`` as fractions (and ``per_link`` / ``per_link_reference``, keyed
            ``"<model> @ <link>"``, on emulated links), ``targets`` of ``{name, value, threshold, comparison,
            passed}``, ``top1_correct``, ``top1_determined``, ``median_regret``, ``tau_pooled``,
            ``cells``), ``measured_at`` and ``speed_targets_s`` (``{profile_and_predict_s, further_s}``).
        header: the line above the tables (default: :func:`provenance` of this machine, now).

    Raises:
        UserError: ``result`` lacks one of those keys (not a predictor result).
    """
    try:
        grid, speed, summary = result["grid"], result["speed"], result["summary"]
        per_model, per_ref, targets = summary["per_model"], summary["per_reference"], summary["targets"]
    except (KeyError, TypeError) as e:
        raise UserError(f"not a benchmarks/predictor.py result: missing {e}; allowed: the dict it writes to "
                        "benchmarks/results/predictor.json") from None
    header = header or provenance("benchmarks/predictor.py", str(result.get("measured_at", ""))[:16] or None)
    met = {True: "yes", False: "**no**", None: "no data"}

    def target(name: str) -> list[str]:
        t = next((t for t in targets if t["name"] == name), None)
        if t is None:
            return ["", ""]
        shown = _pct(t["threshold"]) if t["threshold"] <= 1 else f"{t['threshold']:g}"
        return [f"{t.get('comparison', '<=')} {shown}", met[t.get("passed")]]

    def speed_target(values: list[float | None], limit_s: float | None) -> list[str]:
        if limit_s is None:
            return ["", ""]
        return [f"<= {limit_s:g} s", met[None if None in values else max(values) <= limit_s]]

    threads = grid.get("threads_per_device")
    wall = result.get("runs_s") or result.get("validation_wall_s")  # runs_s: reused runs' time too
    lines = [header, "",
             f"Grid `{grid.get('name', '?')}`: {', '.join(grid.get('datasets', []))} x "
             f"{', '.join(grid.get('networks', []))}; global batch {grid.get('batch_size', '?')}; "
             f"{grid.get('workers', '?')} workers"
             + (f" of {threads} core(s) each" if threads else " sharing the cores evenly")
             + f" against one such device; {grid.get('warmup_batches', '?')} warm-up + "
             f"{grid.get('measured_batches', '?')} measured batches per run ("
             + "".join(f"{m} {n}, " for m, n in (grid.get("measured_batches_by_model") or {}).items()
                       if n != grid.get("measured_batches"))
             + f"target batch size "
             f"{grid.get('target_batch_size') or grid.get('batch_size', '?')}, matchmaking time "
             f"{grid.get('matchmaking_time_s', '?')} s"
             + (f", chunk timeout {grid['next_chunk_timeout_s']:g} s" if grid.get("next_chunk_timeout_s") else "")
             + f"); {summary.get('cells', '?')} cells"
             + (f", each run {grid['repeats']} times (interleaved; a cell shows its median run, the spread is "
                f"(max - min) / median of its runs)" if (grid.get("repeats") or 1) > 1 else "")
             + ("; each round of runs profiled just before it and predicted from that profile"
                if grid.get("profile_each_repeat") and (grid.get("repeats") or 1) > 1 else "")
             + (f"; the real runs took {wall / 60:.1f} min." if wall else "."), ""]
    rows = []
    per_link, per_link_ref = summary.get("per_link") or {}, summary.get("per_link_reference") or {}
    for name, m in [*per_model.items(), *per_link.items()]:
        model, _, link = name.partition(" @ ")
        refs = [f"{key.split(' ', 1)[1].split(' @ ')[0]}: {_pct(r.get('median_abs_error'))}"
                for key, r in (per_link_ref if link else per_ref).items()
                if key.split(" ", 1)[0] == model and key.partition(" @ ")[2] == link]
        count = m.get("count")
        rows.append([name, "–" if count is None else str(count), _pct(m.get("median_abs_error")),
                     _pct(m.get("max_abs_error")), _pct(m.get("median_error"), signed=True),
                     _pct(m.get("median_run_spread")), _pct(m.get("median_abs_error_at_run_compute")),
                     ", ".join(refs), *target(f"median abs error {name}")])
    # results written before the error at the runs' own compute was computed have no such column
    held = any(m.get("median_abs_error_at_run_compute") is not None for m in [*per_model.values(), *per_link.values()])
    goodput = {c.get("link"): c.get("link_goodput") for c in result.get("cells", []) if c.get("link")}
    if goodput:
        lines += ["Emulated links, measured before predicting their cells: the share of its rate a link carried each "
                  "way with both ways busy (`ddlscope.network.duplex`): "
                  + ", ".join(f"{link} {'–' if g is None else f'{g:.3f}'}" for link, g in goodput.items()) + ".", ""]
    # one share per link, or one per round of runs where each round measured its own
    # fsdp's and hivemind's shares depend on the workload's sizes: named per workload where a grid has several
    workloads = {(c.get("dataset"), str(c.get("network")).split(" @ ")[0]) for c in result.get("cells", []) if c.get("link")}

    def where(c: dict) -> str:
        return f"{c.get('network')} on {c.get('dataset')}" if len(workloads) > 1 else c.get("link")

    averaging = {where(c): c.get("averaging_goodput_rounds") or [c.get("averaging_goodput")]
                 for c in result.get("cells", []) if c.get("link") and c.get("averaging_goodput") is not None}
    if averaging:
        rounds = max(len(g) for g in averaging.values()) > 1
        lines += ["The share of its rate hivemind's averaging rounds reached over the same links, each peer on one core "
                  "(`ddlscope.network.averaging_probe`; the collaborative model's rounds run at it)"
                  + (", measured before each round of runs" if rounds else "") + ": "
                  + ", ".join(f"{link} " + " / ".join("–" if x is None else f"{x:.3f}" for x in g)
                              for link, g in averaging.items()) + ".", ""]
    gloo = {where(c): c["fsdp_goodput"] for c in result.get("cells", [])
            if c.get("link") and c.get("fsdp_goodput") is not None}
    if gloo:
        lines += ["The share of the slowest link's rate fsdp's unit collectives reached over the same links on gloo, "
                  "each worker on one core (`ddlscope.network.collective_probe`, at the profile's unit sizes; the fsdp "
                  "model's collectives run at it): " + ", ".join(f"{link} {g:.3f}" for link, g in gloo.items()) + ".", ""]
    every = [f for c in result.get("cells", []) for f in c.get("hivemind_fits") or []]
    fits = [f for i, f in enumerate(every) if f not in every[:i]]  # a round's fit is listed by each of its cells

    def fit_text(f: dict) -> str:
        if f.get("epoch_overhead_s") is None:
            return f"none ({f['measured']})"
        return (f"{f['epoch_overhead_s']:.3g} s + {f['overhead_steps']:.3g} x step per global epoch"
                + ("" if f.get("compute_overhead_s") is None else f", {f['compute_overhead_s']:.3g} s of it in the steps")
                + f", overshoot {f['overshoot_steps']:.2f} steps"
                + ("" if f.get("measured") in ("now", "cached") else f" ({f['measured']})"))

    rounds = [f for f in fits if not f.get("workload")]
    if rounds:
        lines += ["hivemind's overhead and overshoot, measured again right before each round (hivemind swarms of the "
                  "grid's network on its workers, `ddlscope.profiling.calibrate.calibrate_hivemind`; the collaborative "
                  "cells of that round are predicted with it): "
                  + "; ".join(f"round {f['round']} {fit_text(f)}" for f in rounds) + ".", ""]
    workloads = [f for f in fits if f.get("workload")]
    if workloads:
        per_round = any(f["round"] > 1 for f in workloads)
        lines += ["hivemind's overhead and overshoot, measured for each workload at its batch per peer (hivemind swarms "
                  "of that network on the grid's workers, `hivemind_per_workload`; its collaborative cells are "
                  "predicted with it): "
                  + "; ".join(f"{f['workload']}" + (f" (round {f['round']})" if per_round else "")
                              + f" {fit_text(f)}" for f in workloads) + ".", ""]
    def label(c: dict) -> str:  # a cell in a sentence: its link, or its workload on a grid without links
        return where(c) if c.get("link") else f"{c.get('network')} on {c.get('dataset')}"

    past = [(label(c), o)
            for c in result.get("cells", []) for o in c.get("outcomes", []) if o.get("overshoot_steps_per_run")]
    if past:
        lines += ["How far collaborative peers ran past the target batch, in steps per peer per global epoch "
                  "(`ddlscope.analyze.swarm.global_epochs`), each run against the prediction (the hivemind fit's "
                  "overshoot): "
                  + "; ".join(f"{label} " + " / ".join(f"{x:.2f}" for x in o["overshoot_steps_per_run"])
                              + ("" if o.get("predicted_overshoot_steps") is None
                                 else f" (predicted {o['predicted_overshoot_steps']:.2f})") for label, o in past)
                  + ".", ""]
    # a repeat that did not complete is left out of its cell's median and spread: say which and why
    lost = [f"{label(c)}, {o.get('strategy')}: "
            + re.sub(r" \(log: [^)]*\)", "", o["reason"])
            for c in result.get("cells", []) for o in c.get("outcomes", [])
            if o.get("status") == "completed" and "repeats did not complete" in (o.get("reason") or "")]
    if lost:
        lines += ["Runs that did not complete (left out of their cell's median and spread): " + "; ".join(lost) + ".", ""]
    columns = ["distribution model (@ emulated link)", "cells", "median abs error", "max abs error",
               "median error (signed)", "run-to-run spread (median)", "median abs error at the runs' compute",
               "thesis reference: median abs error", "target", "met"]
    if not held:
        columns.pop(6)
        rows = [row[:6] + row[7:] for row in rows]
    lines += [markdown_table(columns, rows), ""]
    if held:
        lines += ["*At the runs' compute*: the prediction with its forward, backward and optimizer times taken from the "
                  "run (per epoch), so what is left is the error of the rest (communication waits, bubbles, averaging, "
                  "data loading); the target is checked on the plain error.", ""]
    top1 = f"{summary.get('top1_correct', '–')} / {summary.get('top1_determined', '–')}"
    tau = summary.get("tau_pooled")
    limits = result.get("speed_targets_s", {})
    first = [speed.get("profile_and_predict_s")]
    further = [speed.get("further_cluster_s"), speed.get("further_strategy_s")]
    figures = [
        ["recommendation = measured fastest (cells)", top1, *target("top-1 rate")],
        ["median regret", _pct(summary.get("median_regret")), *target("median regret")],
        ["Kendall tau, predicted vs. measured order (pooled)", "–" if tau is None else f"{tau:.2f}", "", ""],
        ["profile ResNet-18 + predict every model", _seconds(first[0]),
         *speed_target(first, limits.get("profile_and_predict_s"))],
        ["a further cluster / a further distribution model", " / ".join(_seconds(v) for v in further),
         *speed_target(further, limits.get("further_s"))],
    ]
    lines.append(markdown_table(["figure", "value", "target", "met"], figures))
    memory = summary.get("per_model_memory") or {}
    runtime = summary.get("per_model_runtime_memory") or {}
    mem_rows = [[name, str(m.get("count")), _pct(m.get("median_error"), signed=True), _pct(m.get("max_abs_error")),
                 _pct((runtime.get(name) or {}).get("median_error"), signed=True)]
                for name, m in memory.items() if m.get("count")]
    if mem_rows:
        lines += ["", "Peak memory of the largest worker, predicted against measured (CPU: what the model and its "
                  "training added to the resident set, and the resident set before the model; runs stored before "
                  "2026-12-04: from the start of training):", "",
                  markdown_table(["distribution model", "runs", "allocator part: median error", "max abs error",
                                  "runtime part: median error"], mem_rows)]
    return "\n".join(lines)


VERDICT_SHOWN = {"met": "yes", "missed": "**no**", "unsettled": "unsettled"}
"""How a block shows a paired verdict (``benchmarks/_paired.py``)."""


def overhead_markdown(result: Mapping[str, Any], header: str | None = None) -> str:
    """The block of ``benchmarks/overhead.py``: ms per step plain vs. instrumented and the overhead,
    one row per workload.

    Args:
        result: the dict written to ``benchmarks/results/overhead.json``: ``workloads``, a list of
            dicts with ``model``, ``dataset``, ``batch_size``, ``timed_steps``, ``repeats``,
            ``plain_step_ms``, ``ddlscope_step_ms``, ``overhead_fraction``, ``target_fraction``,
            ``meets_target`` (and ``device``), plus ``device`` and ``gpu`` of the run; or one such
            dict alone (the format before ``--device``). ``measured_at`` optional. Since the
            paired reading, a workload also has ``overhead_interval`` (the 95 % interval of the
            median pair's overhead, or None) and ``verdict`` (``met``, ``missed``, ``unsettled``);
            a result without them shows "–" and its ``meets_target``.
        header: the line above the table (default: :func:`provenance` of this machine, now).

    Raises:
        UserError: ``result`` lacks one of those keys (not an overhead result).
    """
    try:
        rows = [[f"{w['model']} / {w['dataset']}, batch {w['batch_size']}", str(w["timed_steps"]), str(w["repeats"]),
                 f"{w['plain_step_ms']:.1f}", f"{w['ddlscope_step_ms']:.1f}", _pct(w["overhead_fraction"], signed=True),
                 " .. ".join(_pct(v, signed=True) for v in w["overhead_interval"]) if w.get("overhead_interval")
                 else "–", f"< {_pct(w['target_fraction'])}",
                 VERDICT_SHOWN[w["verdict"]] if "verdict" in w else "yes" if w["meets_target"] else "**no**"]
                for w in result.get("workloads", [result])]
    except (KeyError, TypeError) as e:
        raise UserError(f"not a benchmarks/overhead.py result: missing {e}; allowed: the dict it writes to "
                        "benchmarks/results/overhead.json") from None
    header = header or provenance("benchmarks/overhead.py", str(result.get("measured_at", ""))[:16] or None,
                                  result.get("machine"), result.get("commit"))
    device = result.get("device")
    where = f"\n\nDevice: {result.get('gpu') or device}." if device else ""
    table = markdown_table(["workload", "timed steps", "repeats (pairs)", "plain ms/step", "ddlscope ms/step",
                            "overhead (median pair)", "95 % interval", "target", "met"], rows)
    return f"{header}{where}\n\n{table}"


def gpu_markdown(result: Mapping[str, Any], header: str | None = None) -> str:
    """The block of ``benchmarks/gpu.py``: profile vs run (step, allocator peak, runtime) per workload,
    the scaling bands checked, and the fit search of a workload too big for the GPU.

    Args:
        result: the dict written to ``benchmarks/results/gpu-<kind>.json``: ``gpu``, ``runs`` (each
            with ``model``, ``dataset``, ``batch_size``, ``predicted`` and ``measured`` dicts of
            ``step_s``, ``allocator_bytes``, ``runtime_bytes``, and the ``*_error`` fractions),
            ``bands`` (``what``, ``source``, ``target``, ``batch_size``, ``predicted_step_s``,
            ``measured_step_s``, ``low``, ``high``, ``factor``, ``measured_factor``, ``inside``; ``workload``
            optional, "-" where missing) and
            ``big`` (None or the fit search); ``machine``, ``commit``, ``measured_at`` optional.
        header: the line above the tables (default: :func:`provenance` of the result's machine).

    Raises:
        UserError: ``result`` lacks one of those keys (not a gpu result).
    """
    mib = lambda b: "-" if b is None else f"{b / 2**20:,.0f}"  # noqa: E731
    try:
        runs = [[f"{r['model']} / {r['dataset']}, batch {r['batch_size']}",
                 f"{r['predicted']['step_s'] * 1e3:.2f}", f"{r['measured']['step_s'] * 1e3:.2f}",
                 _pct(r["step_error"], True), mib(r["predicted"]["allocator_bytes"]),
                 mib(r["measured"]["allocator_bytes"]), _pct(r["allocator_error"], True),
                 "yes" if r["allocator_within_target"] else "**no**",
                 mib(r["predicted"]["runtime_bytes"]), mib(r["measured"]["runtime_bytes"])] for r in result["runs"]]
        bands = [[b["what"], b.get("workload", "-"), b["source"], b["target"], f"{b['batch_size']}",
                  f"{b['predicted_step_s'] * 1e3:.2f}",
                  f"{b['measured_step_s'] * 1e3:.2f}", f"x{b['factor']:.3g} [{b['low']:.3g}, {b['high']:.3g}]",
                  f"x{b['measured_factor']:.3g}", "yes" if b["inside"] else "**no**"] for b in result["bands"]]
        big, gpu = result["big"], result["gpu"]
    except (KeyError, TypeError) as e:
        raise UserError(f"not a benchmarks/gpu.py result: missing {e}; allowed: the dict it writes to "
                        "benchmarks/results/gpu-<kind>.json") from None
    header = header or provenance("benchmarks/gpu.py", str(result.get("measured_at", ""))[:16] or None,
                                  result.get("machine"), result.get("commit"))
    parts = [header, f"Device: {gpu}. Profile vs a real `single` run (step: whole step with data loading; "
                     f"memory: allocator peak vs `max_memory_allocated`, runtime vs device memory beyond the "
                     f"allocator; target +-10 % for the allocator peak):",
             markdown_table(["workload", "predicted ms/step", "measured ms/step", "step error",
                             "predicted allocator MiB", "measured allocator MiB", "allocator error", "within 10 %",
                             "predicted runtime MiB", "measured runtime MiB"], runs)]
    if bands:
        parts += ["Scaling bands (compute step: forward, backward, optimizer; the band is the estimate x/÷ 2):",
                  markdown_table(["scaled", "workload", "profiled on", "to", "batch", "predicted ms", "measured ms",
                                  "factor [band]", "measured factor", "inside"], bands)]
    if big:
        fit = (f"{big['largest_fitting_batch_size']}" if big["largest_fitting_batch_size"] else "the asked batch")
        parts.append(f"Fit search: `{big['model']}` / {big['dataset']}, batch {big['batch_size']}: largest batch "
                     f"that fits: {fit} (of {mib(big['memory_available_bytes'])} MiB available); measured at "
                     f"{big['measured_batch_sizes']}; the asked batch {'extrapolated' if big['extrapolated'] else 'measured'}"
                     f" at {big['step_s'] * 1e3:.1f} ms/step, predicted peak {mib(big['predicted_peak_bytes'])} MiB; "
                     f"profile took {big['seconds']:.0f} s. Note: {big['fit_note'] or '-'}")
    return "\n\n".join(parts)


def peers_markdown(result: Mapping[str, Any], header: str | None = None) -> str:
    """The block of ``benchmarks/peers.py``: samples per second of each multi-worker distribution
    model under ``ddlscope run`` and as the plain script a user would write, and their ratios.

    Args:
        result: the dict written to ``benchmarks/results/peers.json``: ``device``, ``gpu``, ``model``,
            ``dataset``, ``batch_size``, ``workers``, ``cores_per_worker``, ``warmup_steps``, ``steps``,
            ``repeats``, ``microbatches``, ``stage_bounds`` (None when no pipeline ran),
            ``target_batch_size``, ``matchmaking_time_s``, ``averaging_timeout_s``; ``models``, each
            ``{model, plain_samples_per_s, ddlscope_samples_per_s, ratio, ddlscope_wall_samples_per_s,
            wall_ratio, target, meets_target, note}`` (figures None and ``meets_target`` None for a
            model that was not run), since the paired reading also ``lower_ratio_interval`` (or None)
            and ``verdict`` (``met``, ``missed``, ``unsettled``); ``measured_at`` optional.
        header: the line above the table (default: :func:`provenance` of this machine, now).

    Raises:
        UserError: ``result`` lacks one of those keys (not a peers result).
    """
    def num(v: float | None, spec: str) -> str:
        return "–" if v is None else format(v, spec)

    met = {True: "yes", False: "**no**", None: "–"}
    try:
        cut = f", cut at layers {result['stage_bounds']}" if result["stage_bounds"] else ""
        intro = (f"{result['model']} / {result['dataset']}, batch {result['batch_size']} per worker; "
                 f"{result['workers']} workers of {result['cores_per_worker']} core each; {result['steps']} measured "
                 f"steps per worker after {result['warmup_steps']} warm-up; {result['repeats']} repeats, plain and "
                 f"ddlscope alternating; pipelines: {result['microbatches']} micro-batches{cut}; collaborative: "
                 f"target batch size {result['target_batch_size']}, matchmaking {result['matchmaking_time_s']:g} s, "
                 f"averaging timeout {result['averaging_timeout_s']:g} s. Samples/s of all workers, median over the "
                 f"repeats; ratios: the median pair of repeats. Plain: from a barrier after the warm-up to a barrier "
                 f"after the last step (swarm: the time every peer trained); ddlscope: what it reports for the stored "
                 f"run (`measure_run`), and its wall-clock window (first measured step's start to the last one's end). "
                 f"Met or missed when the 95 % interval of the median pair's lower ratio lies on one side of the "
                 f"target, else unsettled.")
        rows = [[m["model"], num(m["plain_samples_per_s"], ".1f"), num(m["ddlscope_samples_per_s"], ".1f"),
                 num(m["ratio"], ".3f"), num(m["ddlscope_wall_samples_per_s"], ".1f"), num(m["wall_ratio"], ".3f"),
                 " .. ".join(format(v, ".3f") for v in m["lower_ratio_interval"]) if m.get("lower_ratio_interval")
                 else "–", f">= {m['target']:g}",
                 VERDICT_SHOWN[m["verdict"]] if m.get("verdict") else met[m["meets_target"]], m["note"]]
                for m in result["models"]]
    except (KeyError, TypeError) as e:
        raise UserError(f"not a benchmarks/peers.py result: missing {e}; allowed: the dict it writes to "
                        "benchmarks/results/peers.json") from None
    header = header or provenance("benchmarks/peers.py", str(result.get("measured_at", ""))[:16] or None)
    device = f"Device: {result.get('gpu') or result['device']}."
    table = markdown_table(["model", "plain samples/s", "ddlscope samples/s", "ratio", "ddlscope wall samples/s",
                            "wall ratio", "lower ratio, 95 % interval", "target (both ratios)", "met", "note"], rows)
    return "\n\n".join([header, f"{device} {intro}", table])


def dmoe_overhead_markdown(result: Mapping[str, Any], header: str | None = None) -> str:
    """The block of ``benchmarks/dmoe_overhead.py``: ms per step of each pairing of trainer and
    expert servers (plain hivemind or ddlscope's), the overhead against plain hivemind and the noise.

    Args:
        result: the dict written to ``benchmarks/results/dmoe_overhead.json``: ``model``,
            ``dataset``, ``batch_size``, ``expert``, ``hidden_dim``, ``grid_size``, ``k_best``,
            ``servers``, ``trainer_cores``, ``server_cores``, ``steps``, ``timed_steps``, ``repeats``;
            ``pairs`` (each ``{servers, trainer, step_ms, step_ms_min, step_ms_max,
            vs_plain_fraction, median_step_ms, median_step_vs_plain_fraction,
            server_cpu_ms_per_step}``); ``overhead_fraction``, ``trainer_overhead_fraction``,
            ``server_overhead_fraction``, ``median_step_overhead_fraction``,
            ``paired_overhead_fractions``, ``plain_spread_fraction``, ``target_fraction``,
            ``meets_target`` (fractions, not %); ``measured_at`` optional.
        header: the line above the tables (default: :func:`provenance` of this machine, now).

    Raises:
        UserError: ``result`` lacks one of those keys (not a dmoe overhead result).
    """
    try:
        grid = " x ".join(map(str, result["grid_size"]))
        intro = (f"{result['model']} / {result['dataset']}, batch {result['batch_size']}; {result['expert']} experts "
                 f"(hidden {result['hidden_dim']}) on a {grid} grid, k_best {result['k_best']}, "
                 f"{result['servers']} expert servers; trainer on core(s) {result['trainer_cores']}, servers on "
                 f"{', '.join(map(str, result['server_cores']))}; {result['timed_steps']} timed steps per trainer run "
                 f"after {result['steps'] - result['timed_steps']} warm-up; {result['repeats']} repeats, each with "
                 f"every pairing of trainer and servers. ms/step: the run's timed seconds / timed steps, median "
                 f"over the repeats (min – max beside it); median step: the run's median step, median over the "
                 f"repeats (robust to bursts of load, blind to costs that hit few steps).")
        rows = [[p["servers"], p["trainer"], f"{p['step_ms']:.1f}", f"{p['step_ms_min']:.1f} – {p['step_ms_max']:.1f}",
                 _pct(p["vs_plain_fraction"], signed=True), f"{p['median_step_ms']:.1f}",
                 _pct(p["median_step_vs_plain_fraction"], signed=True), f"{p['server_cpu_ms_per_step']:.1f}"]
                for p in result["pairs"]]
        figures = [
            ["overhead: ddlscope trainer + servers vs. plain (ms/step)", _pct(result["overhead_fraction"], signed=True),
             f"< {_pct(result['target_fraction'])}", ("yes" if result["meets_target"] else "**no**")
             + (", within noise" if abs(result["overhead_fraction"]) <= result["plain_spread_fraction"] else "")],
            ["of it, the trainer's / the servers' (the mixed pairings)",
             f"{_pct(result['trainer_overhead_fraction'], signed=True)} / "
             f"{_pct(result['server_overhead_fraction'], signed=True)}", "", ""],
            ["the same by median steps", _pct(result["median_step_overhead_fraction"], signed=True), "", ""],
            ["overhead per repeat (paired, ms/step)",
             ", ".join(_pct(v, signed=True) for v in result["paired_overhead_fractions"]), "", ""],
            ["noise: plain + plain repeats' ms/step, (max - min) / median", _pct(result["plain_spread_fraction"]),
             "", ""],
        ]
    except (KeyError, TypeError) as e:
        raise UserError(f"not a benchmarks/dmoe_overhead.py result: missing {e}; allowed: the dict it writes to "
                        "benchmarks/results/dmoe_overhead.json") from None
    header = header or provenance("benchmarks/dmoe_overhead.py", str(result.get("measured_at", ""))[:16] or None)
    pairs = markdown_table(["expert servers", "trainer", "ms/step", "min – max", "vs. plain + plain", "median step ms",
                            "vs. plain + plain", "servers' CPU ms per trainer step"], rows)
    return "\n".join([header, "", intro, "", pairs, "", markdown_table(["figure", "value", "target", "met"], figures)])
