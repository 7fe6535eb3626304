"""Model factories for sweep tests, importable by worker processes as ``tests.sweep_factories:NAME``."""


def exploding(num_classes: int, in_channels: int):
    """A factory that always raises: a sweep cell using it must be stored as failed, with this message."""
    raise RuntimeError(f"factory exploded on purpose ({in_channels} channels, {num_classes} classes)")
