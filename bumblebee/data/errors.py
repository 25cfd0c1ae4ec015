"""Errors of the data layer, and the one-line message for a missing optional package.

A ``DataError`` is a ``ConfigError``: the CLI prints it as one line and exits
with code 2. Record-level messages read ``file:line: reason`` (a row number for
columnar files) so a user can open the file at the bad sample.
"""

from __future__ import annotations

import importlib

from bumblebee.config import ConfigError


class DataError(ConfigError):
    """Malformed user data (one line, ``file:line: reason``)."""


class BadRecord(Exception):
    """One record cannot be used; the reader adds ``file:line`` and applies ``data.on_error``."""


def require(module: str, what: str):
    """Import an optional package, or fail with one line naming the extra that provides it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(f"{what} needs the optional package '{module.split('.')[0]}': "
                          "pip install 'bumblebee[data]'") from None
