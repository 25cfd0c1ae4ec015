"""Host syncs of a step, counted by call site (on CPU, in the emulated-CUDA mode).

On a GPU every device-to-host read (``.item()``, ``.tolist()``, ``.cpu()``, ``bool(t)``,
``int(t)``) and every host-to-device copy from pageable memory makes the host wait until the
stream has drained; with syncs every few kernels the host never runs ahead, so FSDP2's
prefetch and the chunked-EP overlap are exposed. A CPU run cannot see them as waits, so
``SyncCounter`` counts them where the CUDA code would perform them:

- device-to-host: ``aten._local_scalar_dense`` (``item``, ``bool``, ``int``, ``float`` of a
  tensor), and ``Tensor.tolist`` / ``cpu`` / ``numpy``, of a tensor that is not on the host
  (host tensors: built from Python data, returned by ``cpu()``, or computed from host tensors
  only);
- host-to-device: ``Tensor.to`` of a tensor built on the host from Python data
  (``torch.tensor``, ``as_tensor``, ``from_numpy``), i.e. what on CUDA is a pageable copy;
  copies staged through ``primitives.packed.to_device`` (pinned, asynchronous on CUDA) are
  counted apart, as "host-to-device (pinned, async)", and are not syncs (``syncs``).

Kernel launches are counted beside them: every aten op on a tensor that is not on the host,
except views and what only allocates or relabels (``NO_KERNEL``): what an eager CUDA run
launches, one kernel per op (a composite op that CUDA runs as several counts once: a floor).

Each event is attributed to the innermost stack frame inside ``bumblebee/`` ("file:line").
Counting starts at ``__enter__`` and stops at ``__exit__``; nothing changes outside.
"""

from __future__ import annotations

import collections
import os
import sys
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _site() -> str:
    """The innermost caller inside the bumblebee package, as "path/in/package.py:line"."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        helper = path.endswith(os.sep + "syncs.py") or frame.f_code.co_name == "to_device"
        if path.startswith(_PACKAGE) and not helper:
            return f"{path[len(_PACKAGE) :]}:{frame.f_lineno}"
        frame = frame.f_back
    return "outside bumblebee"


_aten = torch.ops.aten
# ops that launch no kernel: allocation without a fill, metadata, aliasing
NO_KERNEL = {
    _aten.empty.memory_format,
    _aten.empty_strided.default,
    _aten.empty_like.default,
    _aten.new_empty.default,
    _aten.new_empty_strided.default,
    _aten.detach.default,
    _aten.alias.default,
    _aten._unsafe_view.default,
    _aten.lift_fresh.default,
    _aten.set_.source_Storage_storage_offset,
    _aten._local_scalar_dense.default,  # a sync, counted as such
}


class _ScalarReads(TorchDispatchMode):
    def __init__(self, counter: SyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        c = self.counter
        inputs = [
            x
            for x in torch.utils._pytree.tree_leaves((args, kwargs))
            if isinstance(x, torch.Tensor)
        ]
        host = bool(inputs) and all(c._is_host(x) for x in inputs)
        if func is torch.ops.aten._local_scalar_dense.default:
            if not host:
                c._add("device-to-host")
            return func(*args, **(kwargs or {}))
        if not host and not func.is_view and func not in NO_KERNEL:
            c.launches += 1
            if c.launch_sites:
                c.by_launch_site[_site()] += 1
        out = func(*args, **(kwargs or {}))
        if host:  # computed from host tensors only: stays on the host
            for x in torch.utils._pytree.tree_leaves(out):
                if isinstance(x, torch.Tensor):
                    c._mark(x)
        return out


class SyncCounter:
    """``with SyncCounter() as c: ...``; then ``c.total``, ``c.by_site`` {site: count},
    ``c.by_kind`` {"device-to-host" | "host-to-device": count}, ``c.launches`` (and, with
    ``launch_sites=True``, ``c.by_launch_site``)."""

    MAKERS = ("tensor", "as_tensor", "from_numpy")

    def __init__(self, launch_sites: bool = False):
        self.launches = 0  # kernels an eager CUDA run launches (see the module docstring)
        self.launch_sites = launch_sites  # attribute launches to call sites (slower)
        self.by_launch_site: collections.Counter = collections.Counter()
        self.by_site: collections.Counter = collections.Counter()
        self.by_kind: collections.Counter = collections.Counter()
        self.async_by_site: collections.Counter = collections.Counter()  # staged copies (not syncs)
        self._host: dict[int, weakref.ref] = {}  # tensors built on the host from Python data, by id

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())

    @property
    def syncs(self) -> int:
        """Events that make the host wait for the stream: everything but the staged copies."""
        return sum(n for k, n in self.by_kind.items() if "async" not in k)

    def _mark(self, t: torch.Tensor) -> None:
        self._host[id(t)] = weakref.ref(t)

    def _is_host(self, t: torch.Tensor) -> bool:
        ref = self._host.get(id(t))
        return ref is not None and ref() is t

    def _add(self, kind: str) -> None:
        self.by_kind[kind] += 1
        (self.async_by_site if "async" in kind else self.by_site)[_site()] += 1

    def __enter__(self):
        self._saved = {("torch", n): getattr(torch, n) for n in self.MAKERS}
        self._saved.update(
            {("Tensor", n): getattr(torch.Tensor, n) for n in ("tolist", "cpu", "numpy", "to")}
        )
        counter, saved = self, self._saved

        def maker(name):
            def make(*a, **k):
                t = saved[("torch", name)](*a, **k)
                if isinstance(t, torch.Tensor):
                    counter._mark(t)
                return t

            return make

        for n in self.MAKERS:
            setattr(torch, n, maker(n))

        def reader(name):
            def read(t, *a, **k):
                if not counter._is_host(t):
                    counter._add("device-to-host")
                out = saved[("Tensor", name)](t, *a, **k)
                if isinstance(out, torch.Tensor):  # cpu(): what it returns lives on the host
                    counter._mark(out)
                return out

            return read

        for n in ("tolist", "cpu", "numpy"):
            setattr(torch.Tensor, n, reader(n))

        def to(t, *a, **k):
            out = saved[("Tensor", "to")](t, *a, **k)
            target = k.get("device", a[0] if a and isinstance(a[0], (torch.device, str)) else None)
            if counter._is_host(t) and target is not None:
                # packed.to_device stages in pinned memory on CUDA: an asynchronous copy, no sync
                counter._add(
                    "host-to-device (pinned, async)"
                    if getattr(t, "bb_staged", False)
                    else "host-to-device"
                )
            return out

        torch.Tensor.to = to
        self._mode = _ScalarReads(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        for (owner, n), fn in self._saved.items():
            setattr(torch if owner == "torch" else torch.Tensor, n, fn)
        return False

    def top(self, n: int = 10) -> list[tuple[str, int]]:
        return self.by_site.most_common(n)
