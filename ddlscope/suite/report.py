"""The suite report: speedup per network x dataset x distribution model, step breakdown, failures.

Written into one folder: ``suite.md``, ``suite.html``, ``suite.json`` and

- ``speedup_<N>w.png``: thesis 002 Figure 3.1's layout — one panel per distribution model,
  datasets along the x axis, one bar per network, speedup over the one-device baseline on the
  y axis (the dashed line is linear speedup, N); failed cells are marked with a red x;
- ``breakdown.png``: the mean step of every cell split into data loading, forward, backward,
  communication waited for, pipeline bubble, optimizer, averaging and the rest
  (:data:`ddlscope.measure.parts.STEP_PARTS`), grouped by distribution model.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ddlscope import distribution  # noqa: E402
from ddlscope.analyze.report import markdown_to_html  # noqa: E402
from ddlscope.analyze.sweep_report import markdown_table  # noqa: E402
from ddlscope.experiments.results import BREAKDOWN  # noqa: E402
from ddlscope.measure.parts import PART_LABELS  # noqa: E402
from ddlscope.suite.runner import CellResult  # noqa: E402

BREAKDOWN_LABELS = {**PART_LABELS, "other_s": "other"}


def _is_baseline(r: CellResult) -> bool:
    return distribution.get(r.strategy).baseline


def _ms(v: float | None) -> float | None:
    return None if v is None else v * 1000


def cells_table(results: list[CellResult]) -> list[dict]:
    """One row per cell: the numbers behind the plots."""
    return [{
        "dataset": r.dataset, "network": r.network, "model": r.strategy, "workers": r.workers, "batch": r.batch_size,
        "micro-batches": r.microbatches, "status": r.status, "s/epoch": r.epoch_s, "speedup": r.speedup,
        "efficiency": r.scaling_efficiency, "step ms": _ms(r.step_s), "comm ms": _ms(r.comm_s),
        "comm MB/step": None if r.comm_bytes_per_step is None else r.comm_bytes_per_step / 1e6,
        "peak MiB": None if r.peak_memory_bytes is None else r.peak_memory_bytes / 2**20,
    } for r in results]


def breakdown_table(results: list[CellResult]) -> list[dict]:
    """Mean step breakdown per completed cell, in milliseconds."""
    return [{"cell": r.label, **{BREAKDOWN_LABELS[p]: _ms(r.breakdown_s.get(p)) for p in BREAKDOWN}}
            for r in results if r.breakdown_s]


def plot_speedup(results: list[CellResult], workers: int, path: Path) -> None:
    """Figure 3.1 layout for one worker count (see the module docstring)."""
    cells = [r for r in results if r.workers == workers and not _is_baseline(r)]
    strategies = list(dict.fromkeys(r.strategy for r in cells))
    datasets = list(dict.fromkeys(r.dataset for r in results))
    networks = list(dict.fromkeys(r.network for r in results))
    fig, axes = plt.subplots(1, len(strategies), figsize=(4.2 * len(strategies), 3.6), sharey=True, squeeze=False)
    width = 0.8 / max(1, len(networks))
    for ax, strategy in zip(axes[0], strategies):
        for j, net in enumerate(networks):
            for i, ds in enumerate(datasets):
                r = next((c for c in cells if c.strategy == strategy and c.network == net and c.dataset == ds), None)
                x = i + (j - (len(networks) - 1) / 2) * width
                if r is not None and r.speedup is not None:
                    ax.bar(x, r.speedup, width, color=f"C{j}", label=net if i == 0 else None)
                elif r is not None:
                    ax.plot(x, 0.05, "x", color="red", markersize=8)
        ax.axhline(workers, color="grey", linestyle="--", linewidth=0.8)
        ax.axhline(1, color="black", linewidth=0.6)
        ax.set_xticks(range(len(datasets)), datasets)
        ax.set_title(f"{strategy}, {workers} workers")
    axes[0][0].set_ylabel("speedup vs. 1 device")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Speedup over the one-device baseline (x: failed cell, dashed: linear)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_breakdown(results: list[CellResult], path: Path) -> None:
    """Horizontal stacked bars: the mean step of each completed cell, grouped by distribution model."""
    done = sorted((r for r in results if r.breakdown_s), key=lambda r: (r.strategy, r.dataset, r.network, r.workers))
    if not done:
        return
    fig, ax = plt.subplots(figsize=(9, 0.28 * len(done) + 1.5))
    labels = [r.label for r in done]
    left = [0.0] * len(done)
    for k, p in enumerate(BREAKDOWN):
        widths = [r.breakdown_s.get(p, 0.0) * 1000 for r in done]
        ax.barh(labels, widths, left=left, color=f"C{k}", label=BREAKDOWN_LABELS[p])
        left = [a + b for a, b in zip(left, widths)]
    ax.invert_yaxis()
    ax.set_xlabel("mean step time per worker (ms)")
    ax.legend(fontsize=7, ncol=4, loc="lower right")
    ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_suite_report(results: list[CellResult], out_dir: Path, suite_name: str) -> Path:
    """Write the report folder (see the module docstring); return the path of ``suite.html``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    worker_counts = sorted({r.workers for r in results if not _is_baseline(r)})
    for w in worker_counts:
        plot_speedup(results, w, out_dir / f"speedup_{w}w.png")
    plot_breakdown(results, out_dir / "breakdown.png")
    failed = [r for r in results if r.status != "completed"]
    md = [f"# Benchmark suite `{suite_name}`", "",
          f"{len(results)} cells, {len(results) - len(failed)} completed, {len(failed)} failed or unfinished. "
          "Seconds per epoch are extrapolated to the real dataset's size from the measured batches "
          f"(thesis 002 ch. 3.4); speedup is against the one-device baseline ({distribution.baseline().name}) "
          "of the same network and dataset.", ""]
    for w in worker_counts:
        md += [f"## Speedup with {w} workers", "", f"![speedup]({f'speedup_{w}w.png'})", ""]
    md += ["## All cells", "", markdown_table(cells_table(results)), "## Step-time breakdown", "",
           "![breakdown](breakdown.png)", "", markdown_table(breakdown_table(results)), "## Failed cells", ""]
    md += [markdown_table([{"cell": r.label, "status": r.status, "reason": (r.reason or "").replace("|", "/")}
                           for r in failed]) if failed else "None.", ""]
    text = "\n".join(md)
    (out_dir / "suite.md").write_text(text)
    (out_dir / "suite.html").write_text(markdown_to_html(text))
    (out_dir / "suite.json").write_text(json.dumps([r.to_dict() for r in results], indent=1))
    return out_dir / "suite.html"


def print_suite(results: list[CellResult], console=None) -> None:
    """A rich table of the cells in the terminal.

    Args:
        console: a :class:`rich.console.Console`; default one on stdout at the terminal's width
            (columns wrap or fold when it is narrow).
    """
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="benchmark suite")
    for col in ("cell", "status", "s/epoch", "speedup", "efficiency", "step ms", "comm ms", "bubble ms"):
        table.add_column(col, justify="left" if col in ("cell", "status") else "right", overflow="fold")
    for r in results:
        fmt = (lambda v, spec=".2f": "-" if v is None else format(v, spec))
        table.add_row(escape(r.label), r.status, fmt(r.epoch_s, ".1f"), fmt(r.speedup), fmt(r.scaling_efficiency),
                      fmt(_ms(r.step_s), ".0f"), fmt(_ms(r.comm_s), ".0f"), fmt(_ms(r.breakdown_s.get("bubble_s")), ".0f"))
    (console or Console()).print(table)
