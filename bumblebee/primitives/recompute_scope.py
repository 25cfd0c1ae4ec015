"""Whether this thread is re-running a checkpointed function (``primitives/recompute.py``).

A leaf of its own so that primitives the recompute policies wrap (chunked EP reads it to skip
what only the discarded output needs) can ask without importing the policies.
"""

from __future__ import annotations

import contextvars

# Dynamic scope, not configuration: True only on the thread re-running a checkpointed function.
_RECOMPUTING = contextvars.ContextVar("bumblebee_recomputing", default=False)


def in_recompute() -> bool:
    """True inside the recompute forward of a checkpoint taken by a policy."""
    return _RECOMPUTING.get()
