"""CSV and Parquet: every table of the store, the chosen runs' rows, one file per table.

``OUT/<table>.csv`` or ``OUT/<table>.parquet`` for each table with a ``run_id`` column
(:func:`ddlscope.export.rows.run_tables`: ``runs``, ``workers``, ``steps``, ``evals``,
``host_samples``, ``events``, ``services``, ``predictions`` linked to a run, the ``moe_*`` tables and
any added later), columns as in the store, rows in the order they were stored. A table with no
rows for the runs gets a file with its columns only. The files hold exactly the runs of this export:
exporting into the same folder again rewrites them.

CSV: a header row, NULL as an empty field, floats as Python writes them (``repr``, exact). Parquet
(pyarrow): columns typed from the store's declared types, INTEGER -> int64, REAL -> float64,
anything else -> string, NULL as null.
"""

from __future__ import annotations

import csv
import sqlite3
from pathlib import Path

from ddlscope.export.rows import run_tables, table_columns, table_rows


def write_csv(conn: sqlite3.Connection, run_ids: list[str], out_dir: Path) -> list[Path]:
    """Write ``OUT/<table>.csv`` for every table; returns the files written."""
    written = []
    for table in run_tables(conn):
        path = out_dir / f"{table}.csv"
        with path.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow([name for name, _ in table_columns(conn, table)])
            writer.writerows(["" if v is None else v for v in row] for row in table_rows(conn, table, run_ids))
        written.append(path)
    return written


def write_parquet(conn: sqlite3.Connection, run_ids: list[str], out_dir: Path) -> list[Path]:
    """Write ``OUT/<table>.parquet`` for every table; returns the files written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    kinds = {"INTEGER": pa.int64(), "REAL": pa.float64()}
    written = []
    for table in run_tables(conn):
        columns = table_columns(conn, table)
        schema = pa.schema([(name, kinds.get(kind, pa.string())) for name, kind in columns])
        rows = table_rows(conn, table, run_ids)
        data = {name: [row[i] for row in rows] for i, (name, _) in enumerate(columns)}
        path = out_dir / f"{table}.parquet"
        pq.write_table(pa.Table.from_pydict(data, schema=schema), path)
        written.append(path)
    return written
