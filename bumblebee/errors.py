"""The errors a user can cause, shared by every layer (a leaf: imports nothing of bumblebee).

The CLI prints their message as one line (``bumblebee: error: ...``) and exits with code 2;
anything else reaching the CLI is a bug and keeps its traceback.
"""


class ConfigError(ValueError):
    """Invalid user input. The message is one line, printed as-is by the CLI."""


class CheckpointError(ConfigError):
    """A checkpoint that cannot be loaded as asked (missing file, wrong shape, ...)."""
