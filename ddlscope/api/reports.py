"""``ddlscope.report(...)``: the report ``ddlscope report`` writes, from Python."""

from __future__ import annotations

from pathlib import Path


def report(run_ids: list[str] | str, db: str | Path | None = None, out: str | Path | None = None,
           threshold: float | None = None, print_table: bool = True) -> Path:
    """Compare runs of the results store and write the HTML/Markdown report (plots, the bottleneck verdict).

    Args:
        run_ids: one run id or several (a recorder's is ``rec.run_id``, a :func:`ddlscope.run` record's
            ``record["run_id"]``).
        db: the results store (default ``./ddlscope-results/ddlscope.db``).
        out: report folder (default ``<db folder>/reports/<run ids joined by '-'>``).
        threshold: accuracy for time-to-accuracy (default 90 % of the baseline's).
        print_table: also print the summary table and verdicts on stdout.

    Returns:
        The path of ``report.html`` (``report.md`` and ``summary.json`` are next to it).

    Raises:
        UserError: no such store, an unknown run id, or every run still running.
    """
    import io

    from rich.console import Console

    from ddlscope.analyze.report import report_runs
    from ddlscope.errors import UserError
    from ddlscope.store.db import ResultsStore, default_db_path

    ids = [run_ids] if isinstance(run_ids, str) else list(run_ids)
    db_path = Path(db) if db is not None else default_db_path()
    if not db_path.is_file():
        raise UserError(f"no results store at {db_path}; allowed: the db a run was recorded in")
    with ResultsStore(db_path) as store:
        store.mark_stale_runs()
        known = {r["run_id"] for r in store.runs()}
    missing = [r for r in ids if r not in known]
    if not ids or missing:
        raise UserError(f"unknown run id(s) {missing or ids} in {db_path}; see 'ddlscope runs --db {db_path}'")
    folder = Path(out) if out is not None else db_path.parent / "reports" / "-".join(ids)
    console = None if print_table else Console(file=io.StringIO())
    return report_runs(db_path, ids, folder, threshold, console)
