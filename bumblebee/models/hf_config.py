"""A Hugging Face ``config.json`` read as a dict, with one-line errors (a leaf: the family table,
the checkpoint reader and writer all read it)."""

from __future__ import annotations

import json

from bumblebee.errors import ConfigError


def read_hf_config(path: str) -> dict:
    """A ``config.json`` as a dict; unreadable, not UTF-8, not JSON or not an object is a one-line error."""
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: not a JSON text ({e})") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(d).__name__}")
    return d
