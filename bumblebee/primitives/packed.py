"""Packed-document layout of a batch, derived once per forward from ``position_ids``.

Several documents share one row; a document starts wherever the position id
does not continue the previous one (``pos[t] != pos[t-1] + 1``, in particular
where it restarts at 0). Attention and linear attention use this layout so that
no token sees across a document boundary.

The layout is read from the values of ``position_ids``; on fake tensors (the planner's dry
run) there are none, so the caller states the documents with ``assume_documents``.

Legend: B batch, T tokens.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


def to_device(values, device, dtype=torch.long) -> torch.Tensor:
    """Host ints (or a CPU tensor) -> a tensor on ``device`` without a stream sync: on CUDA the
    values are staged in pinned memory and copied asynchronously (a copy from pageable memory
    waits for the stream to drain). The host tensor is marked so that ``perf/syncs.py`` counts
    the copy as asynchronous."""
    t = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cuda":
        t = t.pin_memory()
    t.bb_staged = True
    return t.to(device, non_blocking=True)


class DeviceCache:
    """What a layout derived once, by (key, device). Not a dict on purpose: FSDP2 rebuilds the
    dataclass arguments of every unit's forward (``dataclasses.replace``, dicts copied), and a
    copied dict would drop what later layers add; an object of its own passes through shared."""

    def __init__(self):
        self._items = {}

    def get(self, key, device, build):
        k = (key, str(device))
        if k not in self._items:
            self._items[k] = build()
        return self._items[k]


def cached(layout, key, device, build):
    """``build()`` once per (key, device) for ``layout`` (a layout with a ``_cache`` field)."""
    return layout._cache.get(key, device, build)


@dataclass(frozen=True)
class DocLayout:
    """Per-row document boundaries: ``bounds[b] = [0, s1, s2, ..., T]`` (host ints). One layout
    serves every layer and pass of a micro-batch: the device tensors derived from it are built
    once (``cached``), not per layer, recompute and backward."""

    bounds: tuple[tuple[int, ...], ...]
    seq_len: int
    _cache: DeviceCache = field(default_factory=DeviceCache, compare=False, repr=False)

    def cached(self, key, device, build):
        return cached(self, key, device, build)

    @property
    def single_doc(self) -> bool:
        return all(len(b) == 2 for b in self.bounds)

    def doc_ids(self, device) -> torch.Tensor:
        """[B, T] int: index of the document each token belongs to (within its row)."""
        return self.cached("doc_ids", device, lambda: self._doc_ids(device))

    def _doc_ids(self, device) -> torch.Tensor:
        lengths = to_device([e - s for b in self.bounds for s, e in zip(b[:-1], b[1:])], device)
        docs = to_device([i for b in self.bounds for i in range(len(b) - 1)], device)
        # output_size: the shape is known on the host (no sync; fake tensors can run it)
        ids = torch.repeat_interleave(docs, lengths, output_size=len(self.bounds) * self.seq_len)
        return ids.view(len(self.bounds), self.seq_len)


# position ids -> DocLayout, set by ``assume_documents``; None: read from the values
_ASSUMED_DOCS = contextvars.ContextVar("bumblebee_assumed_documents", default=None)


@contextlib.contextmanager
def assume_documents(layout: Callable[[torch.Tensor], DocLayout]):
    """Inside, ``doc_layout(pos)`` is ``layout(pos)``: documents are data, which fake tensors do
    not hold (the model's and the CP layout's documents alike)."""
    token = _ASSUMED_DOCS.set(layout)
    try:
        yield
    finally:
        _ASSUMED_DOCS.reset(token)


def doc_layout(position_ids_BT: torch.Tensor) -> DocLayout:
    if (assumed := _ASSUMED_DOCS.get()) is not None:
        return assumed(position_ids_BT)
    B, T = position_ids_BT.shape
    starts = torch.ones(B, T, dtype=torch.bool, device=position_ids_BT.device)
    if T > 1:
        starts[:, 1:] = position_ids_BT[:, 1:] != position_ids_BT[:, :-1] + 1
    bounds = []
    for row in starts.cpu():
        idx = torch.nonzero(row).flatten().tolist()
        bounds.append(tuple(idx) + (T,))
    return DocLayout(bounds=tuple(bounds), seq_len=T)


def default_position_ids(input_ids_BT: torch.Tensor) -> torch.Tensor:
    B, T = input_ids_BT.shape
    return torch.arange(T, device=input_ids_BT.device).expand(B, T)
