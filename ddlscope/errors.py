"""Errors that ddlscope reports to the user as one clear message (no traceback)."""


class UserError(Exception):
    """Bad input from the user: a config value, a file, a CLI argument.

    The message names what is wrong and what is allowed. The CLI prints it as one line and
    exits with status 2; nothing half-written is left behind by the code that raises it.
    """


class DatasetError(UserError):
    """A dataset file or folder is missing, truncated or in the wrong format; the message has the path."""
