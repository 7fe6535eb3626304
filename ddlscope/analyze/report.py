"""Reports: a Markdown and an HTML page with PNG plots, and a summary table for the terminal.

``write_report`` takes run comparisons (see :mod:`ddlscope.analyze.compare`; :func:`build_comparisons`
makes them) and writes, into one folder: ``report.md``, ``report.html`` (rendered from the Markdown
by markdown-it-py, :func:`markdown_to_html`), ``summary.json`` and the plots

- ``step_breakdown.png``: stacked mean step time per worker, by step part
  (:data:`ddlscope.measure.parts.STEP_PARTS`: data loading, forward, backward, communication
  wait, pipeline bubble, optimizer without averaging, averaging);
- ``accuracy.png``: held-out accuracy over training seconds, one line per peer (time-to-accuracy);
- ``loss.png``: training loss over training seconds, one line per peer (the same x axis as the
  accuracy: wall time since the peer's training start, held-out evaluations excluded);
- ``network.png``: TCP bytes sent/received per peer;
- for runs with mixture-of-experts rows, the section "Mixture of experts" and ``moe_expert_load.png``,
  ``moe_servers.png``, ``moe_timeline.png`` (:mod:`ddlscope.analyze.moe`).

Runs are named ``name (run id)`` everywhere (names need not be unique). Runs still marked
``running`` are left out with a note (:func:`build_comparisons`); each run's config is in the
report; near-chance accuracy is flagged and, without a baseline run, there is no speedup.

Over many runs the plots keep their size: bars per run instead of per worker, the baseline and the
runs a plot ranks first, one "others" bar or grey lines for the rest (:mod:`ddlscope.analyze.plots`);
the tables keep every run. benchmarks/report_scale.py times reports of up to hundreds of runs.
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ddlscope.analyze.compare import (Comparison, RunSummary, compare, default_threshold, find_baseline,  # noqa: E402
                                      is_baseline_run, near_chance_level, summarize_run)
from ddlscope.analyze.moe import moe_markdown, write_moe_plots  # noqa: E402
from ddlscope.analyze.plots import DPI, MAX_BARS, MAX_LINES, bar_figure_width_in, top_with_others  # noqa: E402
from ddlscope.analyze.swarm import plot_swarm, swarm_markdown  # noqa: E402
from ddlscope.errors import UserError  # noqa: E402
from ddlscope.measure.parts import PART_LABELS, STEP_PARTS  # noqa: E402

CURVE_X_LABEL = "training seconds (since the peer's training start, held-out evaluations excluded)"
"""The x axis of the accuracy and the loss plot (:mod:`ddlscope.analyze.compare`'s training seconds)."""


@dataclass
class ReportRuns:
    """What a report compares: ``comparisons`` (the baseline first when there is one), the
    time-to-accuracy ``threshold`` (0..1, None: none), the ``baseline`` run (None: no completed run
    of the baseline model among them) and the runs ``excluded`` because they are still ``running``."""

    comparisons: list[Comparison]
    threshold: float | None
    baseline: RunSummary | None
    excluded: list[RunSummary] = field(default_factory=list)


def build_comparisons(summaries: list[RunSummary], threshold: float | None = None) -> ReportRuns:
    """Leave out runs still ``running``, find the baseline and compare.

    A run still ``running`` when the report is made is in progress or stuck where its processes
    cannot be checked (another host, a database that cannot be written; killed runs on this host are
    marked ``interrupted`` when the store is opened): its figures would be partial, so it is
    excluded, and named in the report's note.

    Args:
        summaries: from :func:`ddlscope.analyze.compare.summarize_run`, in the order to show them.
        threshold: time-to-accuracy accuracy (0 < threshold <= 1); default 90 % of the baseline's
            final accuracy (none without a baseline run).

    Raises:
        UserError: no runs, every run still ``running``, or a threshold outside (0, 1].
    """
    if threshold is not None and not 0.0 < threshold <= 1.0:
        raise UserError(f"threshold {threshold} is not an accuracy; allowed: 0 < threshold <= 1 (e.g. 0.8)")
    if not summaries:
        raise UserError("no runs to report on")
    kept = [s for s in summaries if s.status != "running"]
    excluded = [s for s in summaries if s.status == "running"]
    if not kept:
        raise UserError(f"every run is still marked running ({', '.join(s.label for s in excluded)}): nothing to "
                        f"report yet; wait for them to end, or remove stuck ones with 'ddlscope rm RUN_ID'")
    baseline = find_baseline(kept)
    threshold = threshold if threshold is not None else default_threshold(baseline)
    return ReportRuns(compare(baseline, kept, threshold), threshold, baseline, excluded)


def report_runs(db: Path, run_ids: list[str], out_dir: Path, threshold: float | None = None, console=None) -> Path:
    """Summarize runs of the store at ``db``, print the summary table and write the report folder.

    Args:
        console: a :class:`rich.console.Console` for the table (default: one on stdout, the
            terminal's width).

    Returns:
        The path of ``report.html``.

    Raises:
        KeyError: an unknown run id.
        UserError: see :func:`build_comparisons`.
    """
    from ddlscope.store.db import ResultsStore

    with ResultsStore(db) as store:
        summaries = [summarize_run(store, r) for r in run_ids]
    runs = build_comparisons(summaries, threshold)
    print_summary(runs.comparisons, runs.threshold, runs.excluded, console)
    return write_report(runs.comparisons, out_dir, runs.threshold, runs.excluded)


def _fmt(value, spec: str = ".2f", none: str = "-") -> str:
    return none if value is None else format(value, spec)


def _mb(value: float | None) -> float | None:
    """Bytes in MB (1e6 bytes); None stays None (unknown)."""
    return None if value is None else value / 1e6


def _threshold_near_chance(run: RunSummary, threshold: float | None) -> bool:
    return threshold is not None and run.chance_accuracy is not None and threshold <= near_chance_level(run.chance_accuracy)


def summary_rows(comparisons: list[Comparison], threshold: float | None = None) -> list[dict[str, str]]:
    """One row of display strings per run: the table in the terminal and in the report.

    Without a baseline run first (:func:`ddlscope.analyze.compare.is_baseline_run`), speedup and
    accuracy decrease read "no baseline"; near-chance accuracy reads "(near chance)"; a
    time-to-accuracy whose threshold is near the run's chance level reads "not used".
    """
    has_baseline = bool(comparisons) and is_baseline_run(comparisons[0].run)
    no_base = "-" if has_baseline else "no baseline"
    rows = []
    for c in comparisons:
        r = c.run
        tta = ("-" if threshold is None else "not used" if _threshold_near_chance(r, threshold)
               else _fmt(c.time_to_accuracy_s, ".1f", "not reached"))
        rows.append({
            "run": r.name, "id": r.run_id, "status": r.status, "peers": str(r.peers),
            "runtime s": _fmt(r.runtime_s, ".1f"),
            "samples/s": _fmt(r.throughput_samples_per_s, ".1f"),
            "speedup": _fmt(c.speedup, ".2f", no_base),
            "accuracy": _fmt(r.accuracy, ".3f") + (" (near chance)" if r.near_chance else ""),
            "acc. decrease": _fmt(c.accuracy_decrease, "+.3f", no_base),
            "time-to-acc s": tta,
            "net MB/peer": _fmt(_mb(r.mean_net_bytes_per_peer), ".1f"),  # "-": unknown, the reason is in c.notes
            "bottleneck": r.verdict.kind if r.verdict else "-",
        })
    return rows


MAX_VERDICT_LINES = 20
"""Runs up to which the terminal summary prints each run's bottleneck verdict (the report always has them)."""


def _excluded_note(excluded: list[RunSummary]) -> str:
    return (f"Left out, still marked running (in progress, or stuck where its processes cannot be checked): "
            f"{', '.join(s.label for s in excluded)}. Report again when they end, or remove stuck runs with "
            f"'ddlscope rm RUN_ID'.")


def print_summary(comparisons: list[Comparison], threshold: float | None, excluded: list[RunSummary] = (),
                  console=None) -> None:
    """Print the comparison table, verdicts and notes with rich.

    Args:
        excluded: runs left out (still ``running``), named in a note.
        console: a :class:`rich.console.Console`; default one on stdout at the terminal's width.
    """
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = console or Console()
    rows = summary_rows(comparisons, threshold)
    title = "ddlscope: runs vs. baseline" + (f" (time-to-accuracy at {threshold:.3f})" if threshold else "")
    table = Table(title=title)
    for col in rows[0]:
        table.add_column(col, justify="left" if col in ("run", "id", "status", "bottleneck") else "right",
                         overflow="fold")
    for row in rows:
        table.add_row(*(escape(v) for v in row.values()))
    one_line = sum(max(len(k), *(len(r[k]) for r in rows)) + 3 for k in rows[0]) + 1  # every cell on one line
    if one_line > console.width:
        table = _cards(rows, title)  # too narrow for a row per run on one line: a block of rows per run
    console.print(table)
    if not is_baseline_run(comparisons[0].run):
        console.print("no baseline: none of these runs is a completed run of the baseline model, so there is no "
                      "speedup or accuracy decrease")
    if excluded:
        console.print(escape(_excluded_note(list(excluded))))
    verdicts = len(comparisons) <= MAX_VERDICT_LINES
    if not verdicts:
        console.print(f"(the bottleneck verdicts of the {len(comparisons)} runs are in the report)")
    for c in comparisons:
        who = f"[bold]{escape(c.run.label)}[/bold]"
        if c.run.verdict and verdicts:
            console.print(f"{who}: {escape(c.run.verdict.explanation)}")
        if c.run.moe is not None and c.run.moe.verdict and verdicts:
            console.print(f"{who} experts: {escape(c.run.moe.verdict.explanation)}")
        if c.run.status != "completed":
            console.print(f"{who} {c.run.status}: {escape(str(c.run.reason))}")
        for note in c.notes:
            console.print(f"{who} [yellow]warning[/yellow]: {escape(note)}")


def _cards(rows: list[dict[str, str]], title: str):
    """The summary as one ``figure | value`` block per run, for terminals too narrow for its columns."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=title, show_header=False)
    table.add_column("figure", style="bold", no_wrap=True)
    table.add_column("value", overflow="fold")
    for i, row in enumerate(rows):
        for key, value in row.items():
            table.add_row(escape(key), escape(value))
        if i < len(rows) - 1:
            table.add_section()
    return table


# ---------------------------------------------------------------------- plots
def _mean_phases(s: RunSummary) -> dict[str, float]:
    """The run's mean step parts (s) over its workers that measured steps."""
    measured = [w for w in s.workers if w.steps]
    return {p: sum(w.mean_phase_s[p] for w in measured) / len(measured) for p in STEP_PARTS}


def _bar_label(s: RunSummary, worker: int | None = None) -> str:
    """A bar's tick label: the run's name, then its id (and the worker) on a second line."""
    return f"{s.name}\n{s.run_id}" + (f" w{worker}" if worker is not None else "")


def _step_bars(summaries: list[RunSummary]) -> tuple[list[tuple[str, dict[str, float]]], str]:
    """Bars of the step breakdown and a note on what they are: one per worker while they fit in
    :data:`~ddlscope.analyze.plots.MAX_BARS`, else one per run (mean over its workers): the baseline,
    the runs with the longest steps and one bar for the mean of the others. Labels: :func:`_bar_label`."""
    per_worker = [(_bar_label(s, w.worker_index), w.mean_phase_s) for s in summaries for w in s.workers if w.steps]
    if len(per_worker) <= MAX_BARS:
        return per_worker, ""
    runs = [(s, _mean_phases(s)) for s in summaries if any(w.steps for w in s.workers)]
    baseline = runs[0] if runs and runs[0][0] is summaries[0] else None
    shown, others = top_with_others(runs, lambda r: sum(r[1].values()), MAX_BARS - 1, first=baseline)
    bars = [(_bar_label(s), phases) for s, phases in shown]
    if not others:
        return bars, "one bar per run, mean over its workers"
    bars.append((f"others\n({len(others)} runs)", {p: sum(ph[p] for _, ph in others) / len(others) for p in STEP_PARTS}))
    return bars, (f"per run, mean over its workers: the baseline and the {len(shown) - (baseline is not None)} runs "
                  f"with the longest steps of {len(runs)}; 'others' = their mean; every run is in the tables")


def _bar_axis(ax, labels: list[str]) -> None:
    """Bars sit at positions 0..n-1, one per label: equal labels never merge."""
    ax.set_xticks(range(len(labels)), labels, fontsize=7, rotation=40 if len(labels) > 8 else 0,
                  ha="right" if len(labels) > 8 else "center")


def plot_step_breakdown(summaries: list[RunSummary], path: Path) -> None:
    """Stacked mean step time by step part: per worker, or per run when there are many (:func:`_step_bars`)."""
    bars, note = _step_bars(summaries)
    fig, ax = plt.subplots(figsize=(bar_figure_width_in(len(bars)), 4.5))
    bottoms = [0.0] * len(bars)
    for part in STEP_PARTS:
        heights = [b[1][part] * 1000 for b in bars]
        ax.bar(range(len(bars)), heights, bottom=bottoms, label=PART_LABELS[part])
        bottoms = [a + b for a, b in zip(bottoms, heights)]
    _bar_axis(ax, [b[0] for b in bars])
    ax.set_ylabel("mean step time (ms), warm-up excluded")
    ax.set_title("Where each step's time goes" + (f"\n({note})" if note else ""), fontsize=10 if note else None)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    _save(fig, path)


def _last_value(points: list[tuple[float, float]]) -> float | None:
    return next((y for _, y in reversed(points) if y is not None and y == y), None)


CURVES = {"eval_curves": ("Held-out accuracy over training time, one line per peer", "held-out accuracy", True),
          "loss_curves": ("Training loss over training time, one line per peer", "training loss", False)}
"""Per-peer curve attribute of :class:`RunSummary` -> (plot title, y label, higher is better)."""
LINE_STYLES = ("-", "--", ":", "-.")


def plot_curves(summaries: list[RunSummary], attr: str, path: Path, threshold: float | None = None) -> None:
    """One line per peer of ``attr`` (``eval_curves`` or ``loss_curves``, see :data:`CURVES`) over
    training seconds; a run's peers share its colour, told apart by line style. With more than
    :data:`~ddlscope.analyze.plots.MAX_LINES` runs, the baseline and the best by their last value
    (highest accuracy, lowest loss, best peer) are labelled, the others drawn thin and grey under one
    legend entry.

    Raises:
        KeyError: ``attr`` is not in :data:`CURVES`.
    """
    title, ylabel, higher_is_better = CURVES[attr]
    curves = [(s, getattr(s, attr)) for s in summaries if getattr(s, attr)]
    baseline = curves[0] if curves and curves[0][0] is summaries[0] else None

    def score(c) -> float:
        lasts = [v for v in (_last_value(pts) for pts in c[1].values()) if v is not None]
        if not lasts:
            return float("-inf")
        return max(lasts) if higher_is_better else -min(lasts)

    shown, others = top_with_others(curves, score, MAX_LINES, first=baseline)
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    if others:
        from matplotlib.collections import LineCollection

        lines = [[(x, y) for x, y in pts if y is not None] for _, per_peer in others for pts in per_peer.values()]
        ax.add_collection(LineCollection(lines, colors="0.75", linewidths=0.6, label=f"{len(others)} other runs"))
        ax.autoscale_view()
    for n, (s, per_peer) in enumerate(shown):
        color = f"C{n % 10}"
        for k, (peer, points) in enumerate(sorted(per_peer.items())):
            label = (s.label + (f", {len(per_peer)} peers" if len(per_peer) > 1 else "")) if k == 0 else None
            ax.plot([p[0] for p in points], [p[1] for p in points], color=color, linestyle=LINE_STYLES[k % len(LINE_STYLES)],
                    marker="." if higher_is_better else None, label=label, linewidth=1)
    if threshold is not None and higher_is_better:
        ax.axhline(threshold, color="grey", linestyle="--", linewidth=0.8, label=f"threshold {threshold:.3f}")
    ax.set_xlabel(CURVE_X_LABEL, fontsize=8)
    ax.set_ylabel(ylabel)
    if others:
        title += (f"\nthe baseline and the {len(shown) - (baseline is not None)} runs with the "
                  f"{'highest' if higher_is_better else 'lowest'} last value of {len(curves)}")
    ax.set_title(title, fontsize=10)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="lower right" if higher_is_better else "upper right")
    _save(fig, path)


def plot_network(summaries: list[RunSummary], path: Path) -> None:
    """TCP bytes sent and received: per peer, or per run (mean per peer) when there are many. Peers and
    runs whose bytes are unknown have no bar (not a 0 bar); the title counts them, the warnings say why."""
    counted = [s for s in summaries if s.workers and s.net_unknown_reason is None]
    bars = [(_bar_label(s, w.worker_index), w.net_sent_bytes / 1e6, w.net_recv_bytes / 1e6)
            for s in summaries for w in s.workers if w.net_unknown_reason is None]
    unknown = sum(1 for s in summaries for w in s.workers if w.net_unknown_reason is not None)
    title = "Network bytes per peer" + (f"\n({unknown} peer(s) not shown: bytes unknown, see the warnings)"
                                        if unknown else "")
    if len(bars) > MAX_BARS:
        runs = [(_bar_label(s), sum(w.net_sent_bytes for w in s.workers) / len(s.workers) / 1e6,
                 sum(w.net_recv_bytes for w in s.workers) / len(s.workers) / 1e6) for s in counted]
        baseline = runs[0] if counted and counted[0] is summaries[0] else None
        shown, others = top_with_others(runs, lambda r: r[1] + r[2], MAX_BARS - 1, first=baseline)
        bars = shown + ([(f"others\n({len(others)} runs)", sum(r[1] for r in others) / len(others),
                          sum(r[2] for r in others) / len(others))] if others else [])
        title += "\n(per run, mean per peer" + (f": the baseline and the {len(shown) - (baseline is not None)} runs "
                                                f"sending most of {len(runs)}; 'others' = their mean)" if others else ")")
    fig, ax = plt.subplots(figsize=(bar_figure_width_in(len(bars)), 4))
    xs = range(len(bars))
    ax.bar([x - 0.2 for x in xs], [b[1] for b in bars], width=0.4, label="sent")
    ax.bar([x + 0.2 for x in xs], [b[2] for b in bars], width=0.4, label="received")
    _bar_axis(ax, [b[0] for b in bars])
    ax.set_ylabel("TCP payload (MB)")
    ax.set_title(title, fontsize=10 if "\n" in title else None)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    _save(fig, path)


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


# ---------------------------------------------------------------------- documents
def _cell(text: Any) -> str:
    """A Markdown table cell: ``|`` escaped, on one line."""
    return str(text).replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def _flatten(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": "1"}``: a config's settings as dotted keys and JSON values."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value if isinstance(value, str) else json.dumps(value, default=str)
    return out


def config_markdown(summaries: list[RunSummary]) -> list[str]:
    """The report's "## Run configurations" section: the settings every run shares, then a table of
    those that differ (one row per run; '-' where a run has no such setting)."""
    flat = [_flatten(s.config) for s in summaries]
    keys = sorted({k for f in flat for k in f})
    common = [k for k in keys if all(k in f and f[k] == flat[0][k] for f in flat)]
    differing = [k for k in keys if k not in common]
    lines = ["", "## Run configurations", ""]
    if common:
        lines += [f"Settings {'all these runs share' if len(summaries) > 1 else 'of the run'}:", "",
                  "| setting | value |", "|---|---|"]
        lines += [f"| {_cell(k)} | {_cell(flat[0][k])} |" for k in common]
    if differing:
        lines += ["", "Settings that differ between the runs:", "",
                  "| run | id | " + " | ".join(_cell(k) for k in differing) + " |", "|" + "---|" * (len(differing) + 2)]
        lines += [f"| {_cell(s.name)} | {s.run_id} | " + " | ".join(_cell(f.get(k, "-")) for k in differing) + " |"
                  for s, f in zip(summaries, flat)]
    return lines


def _markdown(comparisons: list[Comparison], threshold: float | None, plots: list[str],
              excluded: list[RunSummary] = ()) -> str:
    rows = summary_rows(comparisons, threshold)
    first = comparisons[0].run
    lines = ["# ddlscope report", ""]
    if is_baseline_run(first):
        lines.append(f"Baseline: **{_cell(first.name)}** (`{first.run_id}`). Runtime = max over peers; "
                     "accuracy = max over peers' final held-out accuracy; system metrics averaged over peers (thesis 000).")
    else:
        lines.append("No baseline: none of these runs is a completed run of the baseline model (`single`), so there "
                     "is no speedup and no accuracy decrease. Runtime = max over peers; accuracy = max over peers' "
                     "final held-out accuracy; system metrics averaged over peers (thesis 000).")
    lines.append("")
    if threshold is not None:
        lines += [f"Time-to-accuracy threshold: {threshold:.3f}.", ""]
    if excluded:
        lines += [f"**Note**: {_excluded_note(list(excluded))}", ""]
    warned = [c for c in comparisons if c.notes]
    if warned:
        lines += ["## Warnings", ""]
        lines += [f"- **{_cell(c.run.name)}** (`{c.run.run_id}`): {note}." for c in warned for note in c.notes]
        lines.append("")
    lines += ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(_cell(v) for v in r.values()) + " |" for r in rows]
    lines += ["", "## Bottleneck verdicts", ""]
    for c in comparisons:
        r = c.run
        lines.append(f"- **{_cell(r.name)}** (`{r.run_id}`, {r.status}): "
                     f"{r.verdict.explanation if r.verdict else 'no steps measured'}")
        if r.reason:
            lines.append(f"  - reason: {r.reason}")
    head = ["run", "id", "worker", "status", "steps", *(PART_LABELS[p] for p in STEP_PARTS), "samples/s", "CPU %",
            "background CPU ms", "peak RSS MB", "sent MB", "recv MB", "rounds (failed)", "mean group"]
    lines += ["", "## Per-worker step-time breakdown (mean ms per step, warm-up excluded)", "",
              "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in comparisons:
        for w in c.run.workers:
            phases = " | ".join(f"{w.mean_phase_s[p] * 1000:.1f}" for p in STEP_PARTS)
            lines.append(
                f"| {_cell(c.run.name)} | {c.run.run_id} | {w.worker_index} | {w.status} | {w.steps} | {phases} | "
                f"{_fmt(w.throughput_samples_per_s, '.1f')} | {_fmt(w.mean_cpu_percent, '.0f')} | "
                f"{_fmt(w.mean_background_cpu_s * 1000 if w.mean_background_cpu_s is not None else None, '.0f')} | "
                f"{_fmt(w.peak_rss_bytes / 1e6 if w.peak_rss_bytes else None, '.0f')} | {_fmt(_mb(w.net_sent_bytes), '.1f')} | "
                f"{_fmt(_mb(w.net_recv_bytes), '.1f')} | {w.averaging_rounds} ({w.averaging_rounds_failed}) | "
                f"{_fmt(w.mean_group_size, '.1f')} |")
    lines += swarm_section([c.run for c in comparisons])
    lines += config_markdown([c.run for c in comparisons])
    lines += moe_markdown([c.run.moe for c in comparisons if c.run.moe is not None])
    lines += ["", "## Plots", ""] + [f"![{p}]({p})\n" for p in plots]
    return "\n".join(lines) + "\n"


HTML_STYLE = """
body{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;color:#222;line-height:1.4}
table{border-collapse:collapse;font-size:13px;display:block;overflow-x:auto;margin:0.5em 0}
td,th{border:1px solid #ccc;padding:3px 6px;text-align:right;white-space:nowrap}
th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}
code{background:#f3f3f3;padding:0 3px;border-radius:3px;font-size:90%}
img{max-width:100%;height:auto}
"""
"""The CSS of the HTML pages :func:`markdown_to_html` writes."""


MAX_SWARM_TABLES = 20
"""Collaborative runs whose per-peer table a report shows (runs with churn first)."""
MAX_SWARM_PLOTS = 8
"""Runs with churn whose swarm-size figure a report draws."""


def _swarms(summaries: list[RunSummary]) -> list[RunSummary]:
    """Collaborative runs with per-peer figures, those with churn first, at most :data:`MAX_SWARM_TABLES`."""
    runs = [s for s in summaries if s.swarm is not None]
    return sorted(runs, key=lambda s: not s.swarm.has_churn)[:MAX_SWARM_TABLES]


def swarm_plot_name(s: RunSummary) -> str:
    return f"swarm-{s.run_id}.png"


def swarm_section(summaries: list[RunSummary]) -> list[str]:
    """The report's "## Peers of collaborative runs" section (:mod:`ddlscope.analyze.swarm`): a table per
    run, and the swarm-size figure of runs with churn; empty without collaborative runs."""
    runs = _swarms(summaries)
    if not runs:
        return []
    lines = ["", "## Peers of collaborative runs", "",
             "Samples each peer contributed, its averaging rounds (and how many failed) and the seconds it spent "
             "in them, the bytes it sent, churn (joins, leaves, kills), samples lost with a killed peer "
             "(accumulated after its last round), and hivemind's state loads when a peer (re)joined.", ""]
    plotted = [s for s in runs if s.swarm.has_churn][:MAX_SWARM_PLOTS]
    for s in runs:
        lines.append(swarm_markdown(s.swarm, swarm_plot_name(s) if s in plotted else None))
    more = len([s for s in summaries if s.swarm is not None]) - len(runs)
    if more > 0:
        lines.append(f"({more} more collaborative runs: see `summary.json`.)")
    return lines


def write_swarm_plots(summaries: list[RunSummary], out_dir: Path) -> list[str]:
    """Swarm-size figures of the runs with churn that :func:`swarm_section` shows; their file names."""
    plotted = [s for s in _swarms(summaries) if s.swarm.has_churn][:MAX_SWARM_PLOTS]
    return [plot_swarm(s.swarm, out_dir / swarm_plot_name(s)).name for s in plotted]


def markdown_to_html(markdown: str, title: str | None = None) -> str:
    """Render Markdown (CommonMark plus tables, by markdown-it-py) as a complete HTML page with a small CSS.

    Raw HTML in ``markdown`` is escaped, not passed through. ``title``: the page's title, default the
    first level-1 heading's text without code and bold marks (else "ddlscope report").
    """
    from markdown_it import MarkdownIt

    if title is None:
        title = next((line[2:].strip().replace("`", "").replace("**", "") for line in markdown.splitlines()
                      if line.startswith("# ")), "ddlscope report")
    body = MarkdownIt("commonmark", {"html": False}).enable("table").render(markdown)
    return (f"<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>{html.escape(title)}</title><style>{HTML_STYLE}</style></head>\n<body>\n{body}</body></html>\n")


def write_report(comparisons: list[Comparison], out_dir: Path, threshold: float | None = None,
                 excluded: list[RunSummary] = ()) -> Path:
    """Write the report folder and return the path of ``report.html``.

    Args:
        comparisons: from :func:`build_comparisons` (or :func:`ddlscope.analyze.compare.compare`), baseline first.
        out_dir: created if missing; existing report files in it are replaced.
        threshold: the accuracy used for time-to-accuracy (drawn on the accuracy plot).
        excluded: runs left out because they are still ``running`` (named in a note).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    summaries = [c.run for c in comparisons]
    plots = ["step_breakdown.png", "accuracy.png", "loss.png", "network.png"]
    plot_step_breakdown(summaries, out_dir / plots[0])
    plot_curves(summaries, "eval_curves", out_dir / plots[1], threshold)
    plot_curves(summaries, "loss_curves", out_dir / plots[2])
    plot_network(summaries, out_dir / plots[3])
    plots += write_moe_plots([s.moe for s in summaries if s.moe is not None], out_dir)
    write_swarm_plots(summaries, out_dir)  # shown in their runs' sections, not under "Plots"
    md = _markdown(comparisons, threshold, plots, excluded)
    (out_dir / "report.md").write_text(md)
    (out_dir / "report.html").write_text(markdown_to_html(md))
    payload = [dict(c.run.to_dict(), speedup=c.speedup, accuracy_decrease=c.accuracy_decrease,
                    time_to_accuracy_s=c.time_to_accuracy_s, notes=c.notes) for c in comparisons]
    for p in payload:
        p.pop("loss_curves", None)
    doc = {"threshold": threshold, "baseline_run_id": summaries[0].run_id if is_baseline_run(summaries[0]) else None,
           "runs": payload, "excluded": [{"run_id": s.run_id, "name": s.name, "status": s.status} for s in excluded]}
    (out_dir / "summary.json").write_text(json.dumps(doc, indent=2, default=str))
    return out_dir / "report.html"
