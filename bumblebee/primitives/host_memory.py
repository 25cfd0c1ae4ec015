"""Allocations made for host memory (``primitives/offload.py``'s buffers), labelled as such.

A leaf (nothing from bumblebee) so that the memory tracker (perf/memory.py) can tell them apart
on CPU, where host and "device" are the same allocator: inside ``host_allocations()`` a new
tensor is host memory, which the tracker counts beside the device total, not in it.
"""

from __future__ import annotations

import contextlib
import contextvars

_HOST = contextvars.ContextVar("bumblebee_host_allocation", default=False)


def allocating_host() -> bool:
    return _HOST.get()


@contextlib.contextmanager
def host_allocations():
    token = _HOST.set(True)
    try:
        yield
    finally:
        _HOST.reset(token)
