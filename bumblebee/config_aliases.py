"""Old config spellings: a key or value that was renamed is still accepted, mapped to its new
spelling, and a one-line note names the new one (once per process, on rank 0).

Every way into a config goes through ``canonical``: TOML files and ``--set`` (``parse_config``),
the planner's ``--set`` and ``bumblebee pair --slot``. What is not listed here is checked as
before: an unknown key still fails.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any

# (section, old key) -> new key. primitives.cp named an algorithm beside parallel.cp, a degree.
KEYS: dict[tuple[str, str], str] = {("primitives", "cp"): "cp_attention"}

# (section, key) -> {old value: new value}. "global_batch" was also a train key, a module and two
# functions: the balance mode is named after what it spans, the optimizer step.
VALUES: dict[tuple[str, str], dict[str, str]] = {("train", "balance"): {"global_batch": "step"}}


@functools.cache  # once per process and spelling: pair parses its config twice
def note(text: str) -> None:
    """Print ``text`` as a deprecation note on stderr (rank 0 only: under torchrun every rank
    parses the config)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"bumblebee: note: {text} (the old spelling is deprecated)", file=sys.stderr)


def canonical_key(section: str, key: str) -> str:
    """``key`` of ``section`` under its current name (a note when it was an old one)."""
    new = KEYS.get((section, key))
    if new is None:
        return key
    note(f"{section}.{key} is now {section}.{new}")
    return new


def canonical(section: str, key: str, value: Any) -> tuple[str, Any]:
    """(key, value) of ``section`` under their current spellings, noting each old one."""
    key = canonical_key(section, key)
    renamed = VALUES.get((section, key), {})
    if isinstance(value, str) and value in renamed:
        note(f"{section}.{key} = {value!r} is now {section}.{key} = {renamed[value]!r}")
        value = renamed[value]
    return key, value
