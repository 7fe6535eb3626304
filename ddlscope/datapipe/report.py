"""Output of ``ddlscope datapipe``: a rich table, JSON, and a report folder.

The folder holds ``datapipe.md`` (the table, the recommendation, the notes), ``throughput.png``
(loader samples/s per strategy and worker count, training's samples/s as a horizontal line) and
``datapipe.json`` (:meth:`DatapipeResult.to_dict`). Every file is written to a temporary name
and renamed into place, so an interrupted write leaves the previous version or nothing.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ddlscope.datapipe.analysis import DatapipeResult  # noqa: E402

COLUMNS = ("strategy", "workers", "loader samples/s", "storage MB", "build s", "augment", "verdict",
           "est. training samples/s")


def _rate(samples_per_s: float) -> str:
    """A rate for display: whole samples/s from 100 up, one decimal below."""
    return f"{samples_per_s:,.0f}" if samples_per_s >= 100 else f"{samples_per_s:.1f}"


def rows(result: DatapipeResult) -> list[dict[str, str]]:
    """One row of display strings per option (table, Markdown); the recommended one is marked ``*``."""
    rec = result.recommendation
    out = []
    for o in result.options:
        mark = " *" if (o.strategy, o.workers) == (rec.strategy, rec.workers) else ""
        out.append(dict(zip(COLUMNS, (
            o.strategy + mark, str(o.workers), _rate(o.samples_per_s),
            f"{o.storage_bytes / 1e6:,.2f} ({o.storage_location})", f"{o.build_s:.2f}",
            "yes" if o.online_augmentation else "no",
            "input-bound" if o.input_bound else "keeps up", _rate(o.expected_training_samples_per_s)))))
    return out


def headline(result: DatapipeResult) -> str:
    """One line: the dataset, the samples used and training's consumption with its source."""
    c = result.compute
    return (f"{result.dataset}: {result.samples} of {result.dataset_samples} training samples, batch "
            f"{result.batch_size}, {result.timed_samples} samples timed per option, {result.cores} core(s). "
            f"Training consumes {result.training_samples_per_s:,.1f} samples/s "
            f"({c.compute_step_s * 1000:.1f} ms compute per step, {c.source}).")


def print_result(result: DatapipeResult, console=None) -> None:
    """Print the headline, the table, the recommendation and the notes with rich.

    Args:
        console: a :class:`rich.console.Console`; default one on stdout at the terminal's width
            (columns wrap or fold when it is narrow).
    """
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = console or Console()
    table = Table(title=f"ddlscope datapipe: {result.dataset}")
    for col in COLUMNS:
        table.add_column(col, justify="left" if col in ("strategy", "augment", "verdict") else "right", overflow="fold")
    for row in rows(result):
        table.add_row(*map(escape, row.values()))
    console.print(headline(result), markup=False)
    console.print(table)
    rec = result.recommendation
    advice = f"{rec.strategy}, {rec.workers} loader worker(s). {rec.explanation}"
    console.print(f"[bold]recommended:[/bold] {escape(advice)}")
    for note in result.notes:
        console.print(f"note: {note}", markup=False)


def plot_throughput(result: DatapipeResult) -> bytes:
    """PNG bytes: grouped bars of loader samples/s on a log axis (x: strategy, one bar per worker
    count), training's samples/s as a dashed horizontal line."""
    strategies = list(dict.fromkeys(o.strategy for o in result.options))
    workers = sorted({o.workers for o in result.options})
    rate = {(o.strategy, o.workers): o.samples_per_s for o in result.options}
    width = 0.8 / len(workers)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for k, w in enumerate(workers):
        xs = [i + (k - (len(workers) - 1) / 2) * width for i in range(len(strategies))]
        ax.bar(xs, [rate.get((s, w), 0.0) for s in strategies], width=width, label=f"{w} loader worker(s)")
    ax.axhline(result.training_samples_per_s, color="black", linestyle="--", linewidth=1,
               label=f"training consumes {result.training_samples_per_s:,.0f} samples/s")
    ax.set_xticks(range(len(strategies)), strategies, fontsize=8)
    ax.set_yscale("log")  # rates span orders of magnitude; a linear axis hides the training line
    ax.set_ylabel("loader throughput (samples/s, log scale)")
    ax.set_title(f"Data pipeline options for {result.dataset} (batch {result.batch_size})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    return buffer.getvalue()


def markdown(result: DatapipeResult, plot_name: str) -> str:
    """The report as Markdown: headline, table, recommendation, notes and the plot."""
    table = rows(result)
    lines = ["# ddlscope datapipe report", "", headline(result), "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(r.values()) + " |" for r in table]
    rec = result.recommendation
    lines += ["", f"**Recommended:** {rec.strategy}, {rec.workers} loader worker(s). {rec.explanation}", "",
              "An option is *input-bound* when its loader delivers fewer samples/s than training consumes "
              "(batch size / compute seconds per step). Storage counts image bytes only: encoded files for "
              "decode-every-step, N x C x H x W uint8 for the decoded caches, 4 x that for preprocessed float32.",
              "", "## Notes", ""]
    lines += [f"- {note}" for note in result.notes]
    lines += ["", f"![loader throughput per strategy and worker count]({plot_name})"]
    return "\n".join(lines) + "\n"


def _write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary file next to ``path``, then rename it to ``path``."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_report(result: DatapipeResult, out_dir: Path) -> Path:
    """Write ``datapipe.md``, ``throughput.png`` and ``datapipe.json`` into ``out_dir`` (created if
    missing; earlier versions replaced) and return the Markdown file's path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_atomic(out_dir / "throughput.png", plot_throughput(result))
    _write_atomic(out_dir / "datapipe.json", json.dumps(result.to_dict(), indent=2).encode())
    _write_atomic(out_dir / "datapipe.md", markdown(result, "throughput.png").encode())
    return out_dir / "datapipe.md"
