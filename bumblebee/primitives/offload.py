"""Layer inputs moved to host memory between a layer's forward and its recomputed backward.

Under full recompute the activations a step keeps are the decoder layers' inputs, one
``[T, H]`` tensor per layer and micro-batch in flight; ``recompute = "offload"``
(primitives/recompute.py) hands each one to ``LayerInputStore`` right after the layer's forward:
its bytes are copied to a host buffer and the device storage is released (the tensor object
stays, storage size 0, so autograd's references to it stay valid). When the backward re-runs a
layer, ``restore`` brings its input back first (if a prefetch has not already) and starts
bringing back the input of the layer before it in that forward, one layer ahead.

CUDA: host buffers are pinned, both copies run on a side stream ordered by events against the
compute stream, and a released storage is only freed once the compute stream has waited for its
copy (at the next offload), so the copy overlaps the next layer's compute. CPU (tests): the copy
is synchronous into a second buffer allocated under ``host_allocations()``, which the memory
tracker counts as host bytes; the logic, order and bytes are the same.
"""

from __future__ import annotations

import weakref
from collections import deque
from dataclasses import dataclass, field

import torch

from bumblebee.primitives.host_memory import host_allocations


def owns_storage(x: torch.Tensor) -> bool:
    """True when ``x`` is the whole of its storage: releasing that storage frees nothing else."""
    try:
        s = x.untyped_storage()
    except (RuntimeError, NotImplementedError):  # wrapper subclasses, fake or nested tensors
        return False
    return (
        type(x) is torch.Tensor
        and x.is_contiguous()
        and x.storage_offset() == 0
        and s.nbytes() == x.numel() * x.element_size()
        and s.nbytes() > 0
    )


@dataclass
class _Entry:
    x: torch.Tensor  # the layer input, storage released while offloaded
    host: torch.Tensor | None  # flat uint8 copy while offloaded
    # the entry offloaded just before this one (prefetched from here); weak, so that a finished
    # micro-batch's entries die with its graph even while a later one still points back at them
    prev: weakref.ref | None
    copied: object = None  # CUDA event: the device -> host copy finished
    restored: object = None  # CUDA event: the host -> device copy finished


@dataclass
class OffloadStats:
    offloaded: int = 0  # layer inputs released
    skipped: int = 0  # not owning their storage (kept on the device)
    restored: int = 0
    prefetched: int = 0  # restored one layer ahead of their own recompute
    bytes: int = 0  # device bytes offloaded in total
    # the latest events, ("offload" | "restore" | "prefetch", entry id), for tests and debugging
    order: deque = field(default_factory=lambda: deque(maxlen=1024))


class LayerInputStore:
    def __init__(self):
        self.stats = OffloadStats()
        self._last: _Entry | None = None
        self._pending_free: list[_Entry] = []  # CUDA: released once their copy is waited for
        self._stream = None

    def _side(self, device: torch.device):
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def offload(self, x: torch.Tensor) -> _Entry | None:
        """Copy ``x`` to host and release its device storage; None when ``x`` shares storage."""
        if not owns_storage(x):
            self.stats.skipped += 1
            return None
        self._free_pending()
        nbytes = x.untyped_storage().nbytes()
        flat = x.detach().reshape(-1).view(torch.uint8)
        entry = _Entry(x=x, host=None, prev=weakref.ref(self._last) if self._last else None)
        cuda = x.device.type == "cuda"
        with host_allocations():
            host = torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=cuda)
        if cuda:
            side, main = self._side(x.device), torch.cuda.current_stream(x.device)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                host.copy_(flat, non_blocking=True)
                entry.copied = torch.cuda.Event()
                entry.copied.record(side)
            self._pending_free.append(entry)
        else:
            host.copy_(flat)
            x.untyped_storage().resize_(0)
        entry.host = host
        self._last = entry
        self.stats.offloaded += 1
        self.stats.bytes += nbytes
        self.stats.order.append(("offload", id(entry)))
        return entry

    def _free_pending(self) -> None:
        for e in self._pending_free:
            torch.cuda.current_stream(e.x.device).wait_event(e.copied)
            e.x.untyped_storage().resize_(0)
        self._pending_free.clear()

    def _bring_back(self, e: _Entry) -> None:
        if e.host is None:  # already back (prefetched)
            return
        if e in self._pending_free:  # the copy out may still run: the storage was never released
            self._pending_free.remove(e)
            e.host = None
            return
        n = e.host.numel()
        e.x.untyped_storage().resize_(n)
        dst = torch.empty(0, dtype=torch.uint8, device=e.x.device).set_(e.x.untyped_storage())
        if e.x.device.type == "cuda":
            side = self._side(e.x.device)
            side.wait_stream(torch.cuda.current_stream(e.x.device))  # the block may be reused
            with torch.cuda.stream(side):
                dst.copy_(e.host, non_blocking=True)
                e.restored = torch.cuda.Event()
                e.restored.record(side)
        else:
            dst.copy_(e.host)
        e.host = None

    def restore(self, e: _Entry | None) -> None:
        """Before a layer's recompute: its input back on the device, and the previous layer's
        on its way."""
        if e is None:
            return
        if e.host is not None or e in self._pending_free:
            self.stats.order.append(("restore", id(e)))
            self._bring_back(e)
            self.stats.restored += 1
        if e.restored is not None:
            torch.cuda.current_stream(e.x.device).wait_event(e.restored)
        p = e.prev() if e.prev is not None else None
        e.prev = None
        if p is not None and p.host is not None:
            self.stats.order.append(("prefetch", id(p)))
            self._bring_back(p)
            self.stats.restored += 1
            self.stats.prefetched += 1
        if self._last is e:
            self._last = None
