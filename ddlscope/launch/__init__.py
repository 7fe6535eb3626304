"""Launch workers and peers as local processes (or by hand on other hosts)."""
