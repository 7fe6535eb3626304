"""Analysis: run comparison, bottleneck verdict, reports."""
