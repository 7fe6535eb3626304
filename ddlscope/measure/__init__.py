"""Measurement: host metrics and the per-step timer."""
