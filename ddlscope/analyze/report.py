"""Reports: a Markdown and an HTML page with PNG plots, and a summary table for the terminal.

``write_report`` takes run summaries (see :mod:`ddlscope.analyze.compare`) and writes, into one
folder: ``report.md``, ``report.html``, ``summary.json`` and the plots

- ``step_breakdown.png``: stacked mean step time per worker, by step part
  (:data:`ddlscope.measure.parts.STEP_PARTS`: data loading, forward, backward, communication
  wait, pipeline bubble, optimizer without averaging, averaging);
- ``accuracy.png``: held-out accuracy over training time (time-to-accuracy);
- ``loss.png``: training loss over time;
- ``network.png``: TCP bytes sent/received per peer;
- for runs with mixture-of-experts rows, the section "Mixture of experts" and ``moe_expert_load.png``,
  ``moe_servers.png``, ``moe_timeline.png`` (:mod:`ddlscope.analyze.moe`).

Over many runs the plots keep their size: bars per run instead of per worker, the baseline and the
runs a plot ranks first, one "others" bar or grey lines for the rest (:mod:`ddlscope.analyze.plots`);
the tables keep every run. benchmarks/report_scale.py times reports of up to hundreds of runs.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ddlscope.analyze.compare import Comparison, RunSummary  # noqa: E402
from ddlscope.analyze.moe import moe_markdown, write_moe_plots  # noqa: E402
from ddlscope.analyze.plots import DPI, MAX_BARS, MAX_LINES, bar_figure_width_in, top_with_others  # noqa: E402
from ddlscope.measure.parts import PART_LABELS, STEP_PARTS  # noqa: E402


def _fmt(value, spec: str = ".2f", none: str = "-") -> str:
    return none if value is None else format(value, spec)


def summary_rows(comparisons: list[Comparison]) -> list[dict[str, str]]:
    """One row of display strings per run: the table in the terminal and in the report."""
    rows = []
    for c in comparisons:
        r = c.run
        rows.append({
            "run": r.name, "id": r.run_id, "status": r.status, "peers": str(r.peers),
            "runtime s": _fmt(r.runtime_s, ".1f"),
            "samples/s": _fmt(r.throughput_samples_per_s, ".1f"),
            "speedup": _fmt(c.speedup, ".2f"),
            "accuracy": _fmt(r.accuracy, ".3f"),
            "acc. decrease": _fmt(c.accuracy_decrease, "+.3f"),
            "time-to-acc s": _fmt(c.time_to_accuracy_s, ".1f", "not reached"),
            "net MB/peer": f"{r.mean_net_bytes_per_peer / 1e6:.1f}",
            "bottleneck": r.verdict.kind if r.verdict else "-",
        })
    return rows


MAX_VERDICT_LINES = 20
"""Runs up to which the terminal summary prints each run's bottleneck verdict (the report always has them)."""


def print_summary(comparisons: list[Comparison], threshold: float | None) -> None:
    """Print the comparison table with rich."""
    from rich.console import Console
    from rich.table import Table

    rows = summary_rows(comparisons)
    title = "ddlscope: runs vs. baseline" + (f" (time-to-accuracy at {threshold:.3f})" if threshold else "")
    table = Table(title=title)
    for col in rows[0]:
        table.add_column(col, justify="left" if col in ("run", "id", "status", "bottleneck") else "right")
    for row in rows:
        table.add_row(*row.values())
    console = Console(width=200)
    console.print(table)
    verdicts = len(comparisons) <= MAX_VERDICT_LINES
    if not verdicts:
        console.print(f"(the bottleneck verdicts of the {len(comparisons)} runs are in the report)")
    for c in comparisons:
        if c.run.verdict and verdicts:
            console.print(f"[bold]{c.run.name}[/bold]: {c.run.verdict.explanation}")
        if c.run.moe is not None and c.run.moe.verdict and verdicts:
            console.print(f"[bold]{c.run.name}[/bold] experts: {c.run.moe.verdict.explanation}")
        if c.run.status != "completed":
            console.print(f"[bold]{c.run.name}[/bold] {c.run.status}: {c.run.reason}")


# ---------------------------------------------------------------------- plots
def _mean_phases(s: RunSummary) -> dict[str, float]:
    """The run's mean step parts (s) over its workers that measured steps."""
    measured = [w for w in s.workers if w.steps]
    return {p: sum(w.mean_phase_s[p] for w in measured) / len(measured) for p in STEP_PARTS}


def _step_bars(summaries: list[RunSummary]) -> tuple[list[tuple[str, dict[str, float]]], str]:
    """Bars of the step breakdown and a note on what they are: one per worker while they fit in
    :data:`~ddlscope.analyze.plots.MAX_BARS`, else one per run (mean over its workers): the baseline,
    the runs with the longest steps and one bar for the mean of the others."""
    per_worker = [(f"{s.name}\nworker {w.worker_index}", w.mean_phase_s) for s in summaries for w in s.workers if w.steps]
    if len(per_worker) <= MAX_BARS:
        return per_worker, ""
    runs = [(s, _mean_phases(s)) for s in summaries if any(w.steps for w in s.workers)]
    baseline = runs[0] if runs and runs[0][0] is summaries[0] else None
    shown, others = top_with_others(runs, lambda r: sum(r[1].values()), MAX_BARS - 1, first=baseline)
    bars = [(s.name, phases) for s, phases in shown]
    if not others:
        return bars, "one bar per run, mean over its workers"
    bars.append((f"others\n({len(others)} runs)", {p: sum(ph[p] for _, ph in others) / len(others) for p in STEP_PARTS}))
    return bars, (f"per run, mean over its workers: the baseline and the {len(shown) - (baseline is not None)} runs "
                  f"with the longest steps of {len(runs)}; 'others' = their mean; every run is in the tables")


def _bar_axis(ax, labels: list[str]) -> None:
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


def plot_curves(summaries: list[RunSummary], attr: str, ylabel: str, path: Path, threshold: float | None = None) -> None:
    """One line per run of ``attr`` (``eval_curve`` or ``loss_curve``) over training time. With more than
    :data:`~ddlscope.analyze.plots.MAX_LINES` runs, the baseline and the best by their last value (highest
    accuracy, lowest loss) are labelled, the others drawn thin and grey under one legend entry."""
    higher_is_better = attr == "eval_curve"
    curves = [(s, getattr(s, attr)) for s in summaries if getattr(s, attr)]
    baseline = curves[0] if curves and curves[0][0] is summaries[0] else None

    def score(c) -> float:
        last = _last_value(c[1])
        return float("-inf") if last is None else (last if higher_is_better else -last)

    shown, others = top_with_others(curves, score, MAX_LINES, first=baseline)
    fig, ax = plt.subplots(figsize=(7, 4))
    if others:
        from matplotlib.collections import LineCollection

        lines = [[(x, y) for x, y in pts if y is not None] for _, pts in others]
        ax.add_collection(LineCollection(lines, colors="0.75", linewidths=0.6, label=f"{len(others)} other runs"))
        ax.autoscale_view()
    for s, points in shown:
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="." if higher_is_better else None,
                label=s.name, linewidth=1)
    if threshold is not None:
        ax.axhline(threshold, color="grey", linestyle="--", linewidth=0.8, label=f"threshold {threshold:.3f}")
    ax.set_xlabel("training seconds (held-out evaluations excluded)")
    ax.set_ylabel(ylabel)
    if others:
        ax.set_title(f"the baseline and the {len(shown) - (baseline is not None)} runs with the "
                     f"{'highest' if higher_is_better else 'lowest'} last value of {len(curves)}", fontsize=9)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="lower right" if higher_is_better else "upper right")
    _save(fig, path)


def plot_network(summaries: list[RunSummary], path: Path) -> None:
    """TCP bytes sent and received: per peer, or per run (mean per peer) when there are many."""
    bars = [(f"{s.name}\nworker {w.worker_index}", w.net_sent_bytes / 1e6, w.net_recv_bytes / 1e6)
            for s in summaries for w in s.workers]
    title = "Network bytes per peer"
    if len(bars) > MAX_BARS:
        runs = [(s.name, sum(w.net_sent_bytes for w in s.workers) / len(s.workers) / 1e6,
                 sum(w.net_recv_bytes for w in s.workers) / len(s.workers) / 1e6) for s in summaries if s.workers]
        baseline = runs[0] if runs and summaries[0].workers else None
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
def _markdown(comparisons: list[Comparison], threshold: float | None, plots: list[str]) -> str:
    rows = summary_rows(comparisons)
    lines = ["# ddlscope report", "",
             f"Baseline: **{comparisons[0].run.name}** (`{comparisons[0].run.run_id}`). Runtime = max over peers; "
             "accuracy = max over peers' final held-out accuracy; system metrics averaged over peers (thesis 000).",
             ""]
    if threshold is not None:
        lines += [f"Time-to-accuracy threshold: {threshold:.3f}.", ""]
    lines += ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(r.values()) + " |" for r in rows]
    lines += ["", "## Bottleneck verdicts", ""]
    for c in comparisons:
        r = c.run
        lines.append(f"- **{r.name}** ({r.status}): {r.verdict.explanation if r.verdict else 'no steps measured'}")
        if r.reason:
            lines.append(f"  - reason: {r.reason}")
    head = ["run", "worker", "status", "steps", *(PART_LABELS[p] for p in STEP_PARTS), "samples/s", "CPU %", "background CPU ms",
            "peak RSS MB", "sent MB", "recv MB", "rounds (failed)", "mean group"]
    lines += ["", "## Per-worker step-time breakdown (mean ms per step, warm-up excluded)", "",
              "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in comparisons:
        for w in c.run.workers:
            phases = " | ".join(f"{w.mean_phase_s[p] * 1000:.1f}" for p in STEP_PARTS)
            lines.append(
                f"| {c.run.name} | {w.worker_index} | {w.status} | {w.steps} | {phases} | "
                f"{_fmt(w.throughput_samples_per_s, '.1f')} | {_fmt(w.mean_cpu_percent, '.0f')} | "
                f"{_fmt(w.mean_background_cpu_s * 1000 if w.mean_background_cpu_s is not None else None, '.0f')} | "
                f"{_fmt(w.peak_rss_bytes / 1e6 if w.peak_rss_bytes else None, '.0f')} | {w.net_sent_bytes / 1e6:.1f} | "
                f"{w.net_recv_bytes / 1e6:.1f} | {w.averaging_rounds} ({w.averaging_rounds_failed}) | "
                f"{_fmt(w.mean_group_size, '.1f')} |")
    lines += moe_markdown([c.run.moe for c in comparisons if c.run.moe is not None])
    lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


def markdown_to_html(markdown: str) -> str:
    """A small, dependency-free rendering of the report's Markdown (tables, lists, images, headings)."""
    out, in_table = [], False
    for line in markdown.splitlines():
        if line.startswith("|"):
            cells = [html.escape(c.strip()) for c in line.strip("|").split("|")]
            if set("".join(cells)) <= set("-"):
                continue
            if not in_table:
                out.append("<table>")
                in_table = True
                out.append("<tr>" + "".join(f"<th>{c}</th>" for c in cells) + "</tr>")
            else:
                out.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
            continue
        if in_table:
            out.append("</table>")
            in_table = False
        if line.startswith("!["):
            src = line[line.index("(") + 1:-1]
            out.append(f'<p><img src="{html.escape(src)}" alt="{html.escape(src)}"></p>')
        elif line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            out.append(f"<h{level}>{html.escape(line.lstrip('#').strip())}</h{level}>")
        elif line.strip():
            out.append(f"<p>{html.escape(line).replace('**', '')}</p>")
    if in_table:
        out.append("</table>")
    style = ("body{font-family:sans-serif;max-width:1200px;margin:2em auto}table{border-collapse:collapse;font-size:13px}"
             "td,th{border:1px solid #ccc;padding:3px 6px;text-align:right}img{max-width:100%}")
    return f"<!doctype html><html><head><meta charset='utf-8'><title>ddlscope report</title><style>{style}</style></head>" \
           f"<body>{''.join(out)}</body></html>\n"


def write_report(comparisons: list[Comparison], out_dir: Path, threshold: float | None = None) -> Path:
    """Write the report folder and return the path of ``report.html``.

    Args:
        comparisons: from :func:`ddlscope.analyze.compare.compare`, baseline first.
        out_dir: created if missing; existing report files in it are replaced.
        threshold: the accuracy used for time-to-accuracy (drawn on the accuracy plot).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    summaries = [c.run for c in comparisons]
    plots = ["step_breakdown.png", "accuracy.png", "loss.png", "network.png"]
    plot_step_breakdown(summaries, out_dir / plots[0])
    plot_curves(summaries, "eval_curve", "held-out accuracy", out_dir / plots[1], threshold)
    plot_curves(summaries, "loss_curve", "training loss", out_dir / plots[2])
    plot_network(summaries, out_dir / plots[3])
    plots += write_moe_plots([s.moe for s in summaries if s.moe is not None], out_dir)
    md = _markdown(comparisons, threshold, plots)
    (out_dir / "report.md").write_text(md)
    (out_dir / "report.html").write_text(markdown_to_html(md))
    payload = [dict(c.run.to_dict(), speedup=c.speedup, accuracy_decrease=c.accuracy_decrease,
                    time_to_accuracy_s=c.time_to_accuracy_s) for c in comparisons]
    for p in payload:
        p.pop("loss_curve", None)
    (out_dir / "summary.json").write_text(json.dumps({"threshold": threshold, "runs": payload}, indent=2, default=str))
    return out_dir / "report.html"
