"""Errors of the data layer, and the one-line message for a missing optional package.

A ``DataError`` is a ``ConfigError``: the CLI prints it as one line and exits
with code 2. Record-level messages read ``file:line: reason`` (a row number for
columnar files) so a user can open the file at the bad sample.
"""

from __future__ import annotations

import importlib
import json
import os

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
        raise ConfigError(
            f"{what} needs the optional package '{module.split('.')[0]}': "
            "pip install 'bumblebee[data]'"
        ) from None


def check_json_object(p: str, what: str) -> dict | None:
    """A JSON file that must hold an object, if present: the parsed object, or a one-line
    ``DataError`` naming the file (not UTF-8, truncated / not JSON, not an object)."""
    if not os.path.isfile(p):
        return None
    try:
        with open(p, "rb") as f:
            obj = json.loads(f.read().decode("utf-8"))
    except OSError as e:
        raise DataError(f"{p}: cannot read ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise DataError(f"{p}: not UTF-8 text (a corrupt {what})") from None
    except json.JSONDecodeError as e:
        raise DataError(
            f"{p}: not valid JSON (line {e.lineno}: {e.msg}; a truncated or corrupt {what})"
        ) from None
    except RecursionError:
        raise DataError(f"{p}: JSON nested too deeply (a corrupt {what})") from None
    if not isinstance(obj, dict):
        raise DataError(
            f"{p}: must hold a JSON object, got {type(obj).__name__} (a corrupt {what})"
        )
    return obj
