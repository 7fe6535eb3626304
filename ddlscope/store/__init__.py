"""Results store (SQLite)."""
from ddlscope.store.db import ResultsStore, default_db_path

__all__ = ["ResultsStore", "default_db_path"]
