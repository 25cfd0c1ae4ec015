"""Whether this thread is re-running a checkpointed function (``primitives/recompute.py``).

A leaf of its own so that primitives the recompute policies wrap (chunked EP reads it to skip
what only the discarded output needs) can ask without importing the policies.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

from bumblebee.primitives.replay_check import ReplayCheck

# Dynamic scope, not configuration: True only on the thread re-running a checkpointed function.
_RECOMPUTING = contextvars.ContextVar("bumblebee_recomputing", default=False)


def in_recompute() -> bool:
    """True inside the recompute forward of a checkpoint taken by a policy."""
    return _RECOMPUTING.get()


class HostReads:
    """The device-to-host reads of one checkpointed forward, in order, for its recompute: the
    re-run routes alike (a checkpoint already requires it: its saved tensors' shapes follow the
    routing), so it takes the forward's values instead of draining the stream again. Each kept
    value is (host copy, the device tensor read); ``check``: the step's ``ReplayCheck``, current
    at the forward, that the recompute's comparisons go to (None: not compared)."""

    def __init__(self, check: ReplayCheck | None = None):
        self.values: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.next = 0
        self.check = check


# Dynamic scope, not configuration: ("record" | "replay", HostReads) inside a policy's checkpoint.
_HOST_READS = contextvars.ContextVar("bumblebee_host_reads", default=None)


@contextlib.contextmanager
def host_reads(mode: str, reads: HostReads):
    """Record (the checkpointed forward) or replay (its recompute) the host reads of ``host_read``."""
    reads.next = 0
    token = _HOST_READS.set((mode, reads))
    try:
        yield
    finally:
        _HOST_READS.reset(token)


def host_read(value: torch.Tensor) -> torch.Tensor:
    """``value.cpu()`` (a device-to-host read: MoE split sizes); inside a checkpointed forward the
    read is kept, and inside the recompute of that forward the kept host copy is returned instead,
    ``value`` (the recompute's) compared on the device with the forward's (``replay_check.py``)."""
    scope = _HOST_READS.get()
    if scope is None:
        return value.cpu()
    mode, reads = scope
    if mode == "record":
        host = value.cpu()
        reads.values.append((host, value))
        return host
    host, recorded = reads.values[reads.next]
    reads.next += 1
    if reads.check is not None:
        reads.check.compare(value, recorded)
    return host
