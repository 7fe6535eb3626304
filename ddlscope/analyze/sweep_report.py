"""The sweep report: thesis 000's views over all cells of a sweep, each a PNG plus its table.

Views (each written as ``<view>.png``, ``<view>.md`` and ``<view>.json``; all of them together in
``sweep_report.md`` / ``sweep_report.json``):

- ``peers``: runtime (s) and throughput (samples/s) vs. number of peers, mean over runs;
- ``accuracy``: accuracy decrease vs. the baseline per target batch size, local updates and GAS;
  a run's baseline is the first completed run of the baseline model (``single``,
  :func:`ddlscope.distribution.baseline`) of the sweep with the same batch size and learning rate
  and GAS 1 (else any GAS; else the sweep's first one, :func:`find_baseline`; with none, no
  decrease), and the decrease is
  :func:`compare`'s (baseline accuracy - run accuracy, > 0 is worse); the target-batch-size and
  local-updates rows come from the runs whose model has that option in its config table;
- ``optimizer_time``: cumulative optimizer-step and averaging time per run (s, mean over peers);
- ``network``: TCP bytes per peer (mean over a run's peers, thesis 000's system-metric rule);
- ``step_time``: mean step time stacked by step part (:data:`ddlscope.measure.parts.STEP_PARTS`)
  per strategy and batch size (ms, warm-up excluded, mean over runs);
- ``matchmaking``: :mod:`ddlscope.analyze.matchmaking` over the sweep's runs with matchmaking
  (``collaborative``).

Runs are the sweep's cells: per cell key the completed run if any, else its latest run; failed
cells are listed with their reason and left out of the means.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ddlscope import distribution  # noqa: E402
from ddlscope.analyze.compare import RunSummary, compare, find_baseline, is_baseline_run, summarize_run  # noqa: E402
from ddlscope.analyze.matchmaking import (MatchmakingAnalysis, analyze_matchmaking,  # noqa: E402
                                          configured_matchmaking_s, matchmaking_applies)
from ddlscope.analyze.plots import DPI, MAX_BARS, MAX_LINES, bar_figure_width_in, top_with_others  # noqa: E402
from ddlscope.errors import UserError  # noqa: E402
from ddlscope.measure.parts import PART_LABELS, STEP_PARTS  # noqa: E402
from ddlscope.store.db import ResultsStore  # noqa: E402

Table = list[dict[str, Any]]


def sweep_run_ids(store: ResultsStore, name: str) -> list[str]:
    """The run of every cell of sweep ``name`` (completed if any, else latest), in cell order.

    Raises:
        UserError: no runs with that group name (the message lists the stored groups).
    """
    runs = store.runs(name)
    if not runs:
        groups = sorted({r["group_name"] for r in store.runs() if r["group_name"]})
        raise UserError(f"no sweep {name!r} in {store.path}; stored groups: {', '.join(groups) or 'none'}")
    chosen: dict[str, str] = {}
    status: dict[str, str] = {}
    for r in runs:  # oldest first
        key = r["cell_key"] or r["run_id"]
        if status.get(key) != "completed":
            chosen[key], status[key] = r["run_id"], r["status"]
    return list(chosen.values())


def _cfg(s: RunSummary, path: str, default: Any = None) -> Any:
    value: Any = s.config
    for part in path.split("."):
        value = value.get(part, default) if isinstance(value, dict) else default
    return value


def _option(s: RunSummary, option: str) -> Any:
    """A field of the run's model's own config table (its stored value, else the table's default);
    None when the model has no such option."""
    model = distribution.get(s.strategy)
    if not model.has_option(option):
        return None
    return s.config.get(model.config_table, {}).get(option, model.option_default(option))


def _mean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def matched_baseline(run: RunSummary, summaries: list[RunSummary]) -> RunSummary | None:
    """The baseline of ``run`` by the rule in the module docstring; None when the sweep has no baseline run."""
    singles = [s for s in summaries if is_baseline_run(s)
               and _cfg(s, "batch_size") == _cfg(run, "batch_size") and _cfg(s, "learning_rate") == _cfg(run, "learning_rate")]
    gas1 = [s for s in singles if _cfg(s, "gradient_accumulation_steps", 1) == 1]
    return (gas1 or singles or [find_baseline(summaries)])[0]


def peers_table(summaries: list[RunSummary]) -> Table:
    """Mean runtime (s) and throughput (samples/s) of completed runs per number of peers."""
    groups: dict[tuple, list[RunSummary]] = defaultdict(list)
    for s in summaries:
        if s.status == "completed":
            groups[(s.peers, _cfg(s, "vcpus_per_peer"))].append(s)
    return [{"peers": p, "vcpus_per_peer": v, "runs": len(g),
             "runtime_s": _mean([s.runtime_s for s in g]),
             "throughput_samples_per_s": _mean([s.throughput_samples_per_s for s in g])}
            for (p, v), g in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0))]


def accuracy_table(summaries: list[RunSummary]) -> Table:
    """Mean accuracy and accuracy decrease vs. each run's matched baseline, per TBS, LU and GAS value.

    TBS and LU rows come from the runs whose model has that option (``collaborative``); GAS rows
    from all completed runs.
    """
    per_run = []
    for s in summaries:
        if s.status != "completed":
            continue
        base = matched_baseline(s, summaries)
        per_run.append((s, compare(base, [s])[-1].accuracy_decrease))
    # (axis, its value for a run or None when the run has no such setting)
    views = [("target_batch_size", lambda s: _option(s, "target_batch_size")),
             ("use_local_updates", lambda s: _option(s, "use_local_updates")),
             ("gradient_accumulation_steps", lambda s: _cfg(s, "gradient_accumulation_steps", 1))]
    rows = []
    for axis, value_of in views:
        groups: dict[Any, list] = defaultdict(list)
        for s, dec in per_run:
            value = value_of(s)
            if value is not None:
                groups[value].append((s, dec))
        for value, g in sorted(groups.items(), key=lambda kv: str(kv[0])):
            rows.append({"axis": axis, "value": value, "runs": len(g), "accuracy": _mean([s.accuracy for s, _ in g]),
                         "accuracy_decrease": _mean([d for _, d in g])})
    return rows


def optimizer_time_table(summaries: list[RunSummary], steps_by_run: dict[str, list[dict]]) -> Table:
    """Per run: cumulative optimizer-step time and averaging time (s), mean over its peers."""
    rows = []
    for s in summaries:
        steps = steps_by_run[s.run_id]
        workers = sorted({r["worker_index"] for r in steps})
        opt = [sum(r["optimizer_s"] or 0.0 for r in steps if r["worker_index"] == w) for w in workers]
        avg = [sum(r["averaging_s"] or 0.0 for r in steps if r["worker_index"] == w) for w in workers]
        rows.append({"run": s.name, "run_id": s.run_id, "strategy": s.strategy, "status": s.status,
                     "optimizer_s": _mean(opt), "averaging_s": _mean(avg), "runtime_s": s.runtime_s})
    return rows


def network_table(summaries: list[RunSummary]) -> Table:
    """Per run: TCP bytes sent and received per peer (mean over peers) and their sum; all three None,
    and ``net_unknown_reason`` saying why, when any peer's bytes could not be counted."""
    return [{"run": s.name, "run_id": s.run_id, "peers": s.peers,
             "sent_bytes_per_peer": None if s.net_unknown_reason else _mean([w.net_sent_bytes for w in s.workers]),
             "recv_bytes_per_peer": None if s.net_unknown_reason else _mean([w.net_recv_bytes for w in s.workers]),
             "net_bytes_per_peer": s.mean_net_bytes_per_peer, "net_unknown_reason": s.net_unknown_reason}
            for s in summaries]


def step_time_table(summaries: list[RunSummary]) -> Table:
    """Mean step time per phase (s) per (strategy, batch size), over completed runs' workers."""
    groups: dict[tuple, list] = defaultdict(list)
    for s in summaries:
        if s.status == "completed":
            groups[(s.strategy, _cfg(s, "batch_size"))] += [w for w in s.workers if w.steps]
    rows = []
    for (strategy, bs), workers in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0)):
        row: dict[str, Any] = {"strategy": strategy, "batch_size": bs, "workers": len(workers)}
        row.update({p: _mean([w.mean_phase_s[p] for w in workers]) for p in STEP_PARTS})
        row["step_s"] = sum(row[p] or 0.0 for p in STEP_PARTS)
        rows.append(row)
    return rows


def matchmaking_table(store: ResultsStore, summaries: list[RunSummary]) -> Table:
    """Per run with matchmaking: its own matchmaking analysis (rounds, solo share, waits, recommendation)."""
    rows = []
    for s in summaries:
        if not matchmaking_applies(s.strategy):
            continue
        a = analyze_matchmaking(store, [s.run_id])
        rows.append({"run": s.name, "run_id": s.run_id, "matchmaking_time_s": configured_matchmaking_s(s.strategy, s.config),
                     "target_batch_size": _option(s, "target_batch_size"), "peer_rounds": a.peer_rounds,
                     "solo_share": a.solo_share, "mean_wait_s": a.mean_wait_s, "step_s": a.step_s, "epoch_s": a.epoch_s,
                     "spread_s": a.spread_s, "recommended_s": a.recommended_s})
    return rows


# ---------------------------------------------------------------------- plots
def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def _plot_peers(rows: Table, path: Path) -> None:
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.8))
    xs = [r["peers"] for r in rows]
    a.plot(xs, [r["runtime_s"] for r in rows], marker="o")
    a.set_xlabel("peers")
    a.set_ylabel("runtime (s, max over peers)")
    b.plot(xs, [r["throughput_samples_per_s"] for r in rows], marker="o", color="tab:green")
    b.set_xlabel("peers")
    b.set_ylabel("throughput (samples/s, sum over peers)")
    for ax in (a, b):
        ax.set_xticks(xs)
    fig.suptitle("Runtime and throughput vs. number of peers")
    _save(fig, path)


def _plot_accuracy(rows: Table, path: Path) -> None:
    axes_names = ["target_batch_size", "use_local_updates", "gradient_accumulation_steps"]
    fig, axs = plt.subplots(1, 3, figsize=(12, 3.8))
    for ax, name in zip(axs, axes_names):
        sub = [r for r in rows if r["axis"] == name and r["accuracy_decrease"] is not None]
        ax.bar([str(r["value"]) for r in sub], [r["accuracy_decrease"] for r in sub])
        ax.axhline(0, color="grey", linewidth=0.8)
        ax.set_xlabel(name)
        ax.set_ylabel("accuracy decrease vs. baseline")
    fig.suptitle("Accuracy decrease vs. the single-node baseline (> 0 is worse)")
    _save(fig, path)


def _plot_optimizer_time(summaries: list[RunSummary], steps_by_run: dict[str, list[dict]], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 4))
    curves = []
    for s in summaries:
        total, ys = 0.0, []
        for r in steps_by_run[s.run_id]:
            if r["worker_index"] == 0:
                total += r["optimizer_s"] or 0.0
                ys.append(total)
        if ys:
            curves.append((s, ys))
    # many runs: the MAX_LINES with the most optimizer time are labelled, the others thin and grey
    shown, others = top_with_others(curves, lambda c: c[1][-1], MAX_LINES)
    for i, (s, ys) in enumerate(others):
        ax.plot(range(len(ys)), ys, color="0.75", linewidth=0.6, label=f"{len(others)} other runs" if i == 0 else None)
    for s, ys in shown:
        ax.plot(range(len(ys)), ys, label=s.label, linewidth=1)
    ax.set_xlabel("step (worker 0)")
    ax.set_ylabel("cumulative optimizer-step time incl. averaging (s)")
    ax.set_title(TITLES["optimizer_time"] + " (worker 0 of each run)", fontsize=10)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="upper left")
    _save(fig, path)


def _plot_network(rows: Table, path: Path) -> None:
    """Bytes per peer per run; with more runs than MAX_BARS, those sending most and one bar for the others' mean.
    Runs whose bytes are unknown have no bar (not a 0 bar); the title counts them and the table says why."""
    unknown = [r for r in rows if r["net_bytes_per_peer"] is None]
    rows = [r for r in rows if r["net_bytes_per_peer"] is not None]
    shown, others = top_with_others(rows, lambda r: r["net_bytes_per_peer"], MAX_BARS - 1)
    bars = [(f"{r['run']}\n{r['run_id']}", r["net_bytes_per_peer"] / 1e6) for r in shown]
    if others:
        bars.append((f"others ({len(others)} runs)", sum(r["net_bytes_per_peer"] for r in others) / len(others) / 1e6))
    fig, ax = plt.subplots(figsize=(bar_figure_width_in(len(bars)), 4))
    ax.bar(range(len(bars)), [b[1] for b in bars])
    ax.set_xticks(range(len(bars)), [b[0] for b in bars], fontsize=7, rotation=30, ha="right")
    ax.set_ylabel("TCP bytes per peer (MB, sent + received)")
    ax.set_title(TITLES["network"] + (f"\n(the {len(shown)} runs sending most; 'others' = their mean)" if others else "")
                 + (f"\n({len(unknown)} run(s) not shown: bytes unknown, see the table)" if unknown else ""), fontsize=10)
    _save(fig, path)


def _plot_step_time(rows: Table, path: Path) -> None:
    rows, others = top_with_others(rows, lambda r: r["step_s"], MAX_BARS)  # the slowest, when there are too many
    fig, ax = plt.subplots(figsize=(bar_figure_width_in(len(rows)), 4))
    ax.set_title(TITLES["step_time"] + (f"\n(the {len(rows)} slowest of {len(rows) + len(others)} (strategy, batch size) "
                                        f"pairs)" if others else ""), fontsize=10)
    labels = [f"{r['strategy']}\nbs {r['batch_size']}" for r in rows]
    bottom = [0.0] * len(rows)
    for p in STEP_PARTS:
        heights = [(r[p] or 0.0) * 1000 for r in rows]
        ax.bar(labels, heights, bottom=bottom, label=PART_LABELS[p])
        bottom = [a + b for a, b in zip(bottom, heights)]
    ax.set_ylabel("mean step time (ms), warm-up excluded")
    ax.legend(fontsize=8)
    _save(fig, path)


# ---------------------------------------------------------------------- documents
def markdown_table(rows: Table) -> str:
    """A Markdown table of ``rows`` (floats with 4 significant digits, None as '-', ``|`` in a cell escaped)."""
    if not rows:
        return "(no rows)\n"
    cols = list(rows[0])

    def cell(v: Any) -> str:
        text = "-" if v is None else format(v, ".4g") if isinstance(v, float) else str(v)
        return text.replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


TITLES = {"peers": "Runtime and throughput vs. number of peers",
          "accuracy": "Accuracy decrease vs. baseline per target batch size, local updates and GAS",
          "optimizer_time": "Cumulative optimizer-step and averaging time",
          "network": "Network bytes per peer",
          "step_time": "Step time by phase per batch size"}


def build_sweep_views(store: ResultsStore, name: str) -> tuple[list[RunSummary], dict[str, Table], MatchmakingAnalysis,
                                                               dict[str, list[dict]]]:
    """Summaries of the sweep's runs, the tables of every view, the matchmaking analysis and the steps.

    Raises:
        UserError: no sweep ``name`` in the store.
    """
    run_ids = sweep_run_ids(store, name)
    summaries = [summarize_run(store, r) for r in run_ids]
    steps_by_run = {r: store.rows("steps", r) for r in run_ids}
    tables = {"peers": peers_table(summaries), "accuracy": accuracy_table(summaries),
              "optimizer_time": optimizer_time_table(summaries, steps_by_run), "network": network_table(summaries),
              "step_time": step_time_table(summaries)}
    return summaries, tables, analyze_matchmaking(store, run_ids), steps_by_run


def write_sweep_report(store: ResultsStore, name: str, out_dir: Path) -> Path:
    """Write every view of sweep ``name`` into ``out_dir`` and return ``sweep_report.md``'s path.

    Raises:
        UserError: no sweep ``name`` in the store.
    """
    summaries, tables, mm, steps_by_run = build_sweep_views(store, name)
    out_dir.mkdir(parents=True, exist_ok=True)
    _plot_peers(tables["peers"], out_dir / "peers.png")
    _plot_accuracy(tables["accuracy"], out_dir / "accuracy.png")
    _plot_optimizer_time(summaries, steps_by_run, out_dir / "optimizer_time.png")
    _plot_network(tables["network"], out_dir / "network.png")
    _plot_step_time(tables["step_time"], out_dir / "step_time.png")
    failed = [s for s in summaries if s.status != "completed"]
    doc = [f"# Sweep {name}", "",
           f"{len(summaries)} cells, {len(summaries) - len(failed)} completed. Runtime = max over peers, "
           "accuracy = max over peers, system metrics averaged over peers (thesis 000).", ""]
    for s in failed:
        why = s.reason or ("still marked running: in progress, or stuck where its processes cannot be checked"
                           if s.status == "running" else "no reason recorded")
        doc.append(f"- {s.status}: **{s.name}** (`{s.run_id}`): {why}")
    for view, rows in tables.items():
        section = f"## {TITLES[view]}\n\n![{view}]({view}.png)\n\n{markdown_table(rows)}"
        (out_dir / f"{view}.md").write_text(section)
        (out_dir / f"{view}.json").write_text(json.dumps(rows, indent=2, default=str))
        doc += ["", section]
    per_run = matchmaking_table(store, summaries)
    mm_md = ("## Matchmaking time\n\nAll runs with matchmaking of the sweep pooled:\n\n" + mm.markdown() +
             "\nEach run with matchmaking on its own:\n\n" + markdown_table(per_run))
    (out_dir / "matchmaking.md").write_text(mm_md)
    (out_dir / "matchmaking.json").write_text(json.dumps(dict(mm.to_dict(), per_run=per_run), indent=2, default=str))
    doc += ["", mm_md]
    (out_dir / "sweep_report.md").write_text("\n".join(doc) + "\n")
    payload = dict(tables, matchmaking=mm.to_dict(), failed=[{"run_id": s.run_id, "name": s.name, "status": s.status,
                                                              "reason": s.reason} for s in failed])
    (out_dir / "sweep_report.json").write_text(json.dumps(payload, indent=2, default=str))
    return out_dir / "sweep_report.md"
