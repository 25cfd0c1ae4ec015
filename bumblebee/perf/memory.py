"""Peak-memory accounting for a training step, on CPU and CUDA.

The loss and recompute primitives exist to cut peak memory, so a step must be
able to report it -- also on CPU, where there is no allocator counter (process
RSS is dominated by the allocator's caching and the Python heap).

``MemoryTracker`` is a context manager with one small API on both devices:

    with MemoryTracker(device, model=model, optimizer=opt) as mem:
        mem.reset_peak()                    # e.g. at the start of each step
        loss = model(ids, labels=labels); loss.backward(); opt.step()
        mem.peak_bytes, mem.current_bytes   # ints
        mem.breakdown("peak")               # {"parameters", "gradients", "optimizer_state",
                                            #  "activations", "total"} in bytes

- CPU (and any non-CUDA device): a ``TorchDispatchMode`` sees every op's outputs
  (forward and the autograd backward alike) and tracks their *storages* (so views
  and in-place results count once) with a weakref callback on each storage, which
  fires when the storage is freed. Counted: the model's parameters / gradients /
  optimizer state (found from ``model`` and ``optimizer``) plus every tensor
  allocated inside the context (views and in-place results of older tensors are
  not allocations and are not counted). A storage is labelled "activations" (saved
  activations and temporaries) when allocated, "gradients" when autograd
  accumulates it into a parameter's ``.grad`` (post-accumulate-grad hook), and
  "optimizer_state" when allocated inside ``optimizer.step``. ``breakdown("peak")``
  is the labelling at the moment of the peak. Overhead: a few microseconds per op.
  Storages resized in place (``untyped_storage().resize_``, which bypasses the
  dispatcher) are seen too: inside the context ``UntypedStorage.resize_`` is wrapped
  so that a tracked storage's size follows it, and a storage grown from outside the
  context starts being counted (as the current phase: FSDP2 grows and frees its
  gathered parameters this way in every forward and backward, transient buffers like
  activations).
- CUDA: ``torch.cuda.memory_allocated`` / ``max_memory_allocated`` (all tensors on
  the device, including ones allocated before the context). Parameters,
  gradients and optimizer state are counted by walking the model and optimizer;
  "activations" is the rest, at the peak taken as peak minus the current static
  state.

Limits: op-internal workspaces (memory a kernel takes without returning a tensor) are
not seen by the CPU tracker.
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from bumblebee.primitives.host_memory import allocating_host

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations")


def _storages(t: torch.Tensor):
    """The storages behind ``t`` (the inner tensors' for wrapper subclasses such as DTensor)."""
    if is_traceable_wrapper_subclass(t):
        for attr in t.__tensor_flatten__()[0]:
            inner = getattr(t, attr)
            if isinstance(inner, torch.Tensor):  # skip non-tensor metadata (e.g. a DeviceMesh)
                yield from _storages(inner)
        return
    try:
        yield t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse / nested / storage-less tensors
        return


def _state_tensors(model, optimizer):
    """(category, tensor) for the static training state reachable from model and optimizer."""
    if model is not None:
        for p in model.parameters():
            yield "parameters", p
            if p.grad is not None:
                yield "gradients", p.grad
    if optimizer is not None:
        for state in optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    yield "optimizer_state", v


class _AllocationMode(TorchDispatchMode):
    """Reports every op's freshly allocated outputs to the tracker.

    Outputs the op schema marks as aliasing an input (views, in-place and out=
    results) are skipped: their storage is either tracked already or predates the
    context (a view of a weight made inside the step is not a new allocation). So are
    the returns of c10d collectives: the tensors they were given."""

    def __init__(self, tracker: MemoryTracker):
        super().__init__()
        self.tracker = tracker
        self.fresh = {}  # op -> per return: True if it is a new tensor (no alias annotation)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.tracker._raise_pending_interrupt()
        out = func(*args, **(kwargs or {}))
        fresh = self.fresh.get(func)
        if fresh is None:
            # c10d collectives (``_reduce_scatter_base_``, ``allreduce_``, ...) write into and return
            # their tensor arguments, though their schemas carry no alias annotation
            collective = func.namespace == "c10d"
            fresh = self.fresh[func] = tuple(
                r.alias_info is None and not collective for r in func._schema.returns
            )
        track = self.tracker._track_host if allocating_host() else self.tracker._track
        if isinstance(out, torch.Tensor):
            if fresh[0]:
                track(out, None)
        elif any(fresh):
            # several returns pair up with the schema's; a single Tensor[] return covers them all
            groups = zip(fresh, out) if len(fresh) > 1 else [(fresh[0], out)]
            for is_fresh, value in groups:
                if is_fresh:
                    for t in tree_leaves(value):
                        if isinstance(t, torch.Tensor):
                            track(t, None)
        return out


class MemoryTracker:
    """Peak / current live-tensor bytes inside a ``with`` block (see module docstring)."""

    def __init__(self, device="cpu", model=None, optimizer=None):
        self.device = torch.device(device)
        self.model, self.optimizer = model, optimizer
        self.cuda = self.device.type == "cuda"
        if self.cuda and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._cuda_live = False  # inside the context on CUDA: read the allocator's counters
        self._lock = threading.RLock()
        self._live: dict[int, list] = {}  # storage id -> [weakref, nbytes, category]
        self._bytes = dict.fromkeys(CATEGORIES, 0)
        self._total = self._peak = 0
        self._peak_bytes = dict(self._bytes)
        self._phase = "activations"  # label for new storages ("optimizer_state" inside opt.step)
        self._mode = None
        self._hooks = []
        self._resize = None  # (original UntypedStorage.resize_, our wrapper) inside the context
        self._interrupted = False  # a KeyboardInterrupt caught in a weakref callback, to re-raise
        self._host_live: dict[int, tuple] = {}  # host buffers (primitives/host_memory.py)
        self._host = self._host_peak = 0

    # ------------------------------------------------------------------ public API
    @property
    def peak_bytes(self) -> int:
        """Largest number of live bytes since entry or the last ``reset_peak`` (frozen at exit)."""
        return torch.cuda.max_memory_allocated(self.device) if self._cuda_live else self._peak

    @property
    def current_bytes(self) -> int:
        """Live bytes now (frozen at exit)."""
        return torch.cuda.memory_allocated(self.device) if self._cuda_live else self._total

    def reset_peak(self) -> None:
        """Start a new peak window at the current usage (e.g. at the start of each step)."""
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        with self._lock:
            self._peak, self._peak_bytes = self._total, dict(self._bytes)
            self._host_peak = self._host

    def breakdown(self, at: str = "current") -> dict[str, int]:
        """Bytes per category (CATEGORIES) plus "total", now (``"current"``) or at the peak."""
        if at not in ("current", "peak"):
            raise ValueError(f"breakdown(at=...) must be 'current' or 'peak', got {at!r}")
        if self.cuda:
            static = dict.fromkeys(CATEGORIES, 0)
            seen = set()
            for cat, t in _state_tensors(self.model, self.optimizer):
                for s in _storages(t):
                    if s.device == self.device and s._cdata not in seen:
                        seen.add(s._cdata)
                        static[cat] += s.nbytes()
            total = self.peak_bytes if at == "peak" else self.current_bytes
            static["activations"] = max(0, total - sum(static.values()))
            return {**static, "total": total}
        if self._mode is not None:
            self._label_state()
        with self._lock:
            snap = dict(self._peak_bytes if at == "peak" else self._bytes)
        return {**snap, "total": sum(snap.values())}

    # ------------------------------------------------------------------ context
    def __enter__(self) -> MemoryTracker:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            self._cuda_live = True
            return self
        self._label_state()
        if self.model is not None:
            for p in self.model.parameters():
                if p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
        if self.optimizer is not None:
            self._hooks.append(
                self.optimizer.register_step_pre_hook(lambda *_: self._set_phase("optimizer_state"))
            )
            self._hooks.append(self.optimizer.register_step_post_hook(self._after_step))
        self.reset_peak()
        self._watch_resizes()
        self._mode = _AllocationMode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._cuda_live:
            self._peak, self._total = self.peak_bytes, self.current_bytes
            self._cuda_live = False
        if self._mode is None:
            return
        self._mode.__exit__(*exc)
        self._mode = None
        original, wrapper = self._resize
        if (
            torch.UntypedStorage.__dict__.get("resize_") is wrapper
        ):  # nested trackers exit in reverse order
            if original is None:
                del torch.UntypedStorage.resize_  # the inherited method again
            else:
                torch.UntypedStorage.resize_ = original
        self._resize = None
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        with self._lock:
            self._live.clear()  # drop the weakrefs: no more callbacks; figures stay frozen
            self._host_live.clear()
        if exc[0] is None:
            self._raise_pending_interrupt()

    @property
    def host_bytes(self) -> int:
        """Live bytes of host buffers made inside ``host_allocations()`` (CPU tracker; not part of
        ``current_bytes``, as pinned host memory is not part of the CUDA allocator's count)."""
        return self._host

    @property
    def host_peak_bytes(self) -> int:
        return self._host_peak

    # ------------------------------------------------------------------ bookkeeping
    def _track_host(self, t: torch.Tensor, category) -> None:
        for s in _storages(t):
            key = s._cdata
            with self._lock:
                if key in self._host_live:
                    continue
                self._host_live[key] = (
                    weakref.ref(s, lambda _, k=key: self._on_host_free(k)),
                    s.nbytes(),
                )
                self._host += s.nbytes()
                self._host_peak = max(self._host_peak, self._host)

    def _on_host_free(self, key: int) -> None:
        with self._lock:
            entry = self._host_live.pop(key, None)
            if entry is not None:
                self._host -= entry[1]

    def _track(self, t: torch.Tensor, category) -> None:
        """Count ``t``'s storages if new; with a ``category``, (re)label them."""
        for s in _storages(t):
            if s.device.type == self.device.type:
                self._track_storage(s, category)

    def _track_storage(self, s, category) -> None:
        key = s._cdata
        with self._lock:
            entry = self._live.get(key)
            if entry is None:
                nbytes, cat = s.nbytes(), category or self._phase
                ref = weakref.ref(s, lambda _, key=key: self._on_free(key))
                self._live[key] = [ref, nbytes, cat]
                self._bytes[cat] += nbytes
                self._total += nbytes
                if self._total > self._peak:
                    self._peak, self._peak_bytes = self._total, dict(self._bytes)
            elif category is not None and entry[2] != category:
                self._bytes[entry[2]] -= entry[1]
                self._bytes[category] += entry[1]
                entry[2] = category

    def _watch_resizes(self) -> None:
        """Wrap ``UntypedStorage.resize_`` until exit (it does not go through the dispatcher)."""
        original = torch.UntypedStorage.__dict__.get("resize_")  # None: inherited from the C base
        call = original or torch.UntypedStorage.resize_

        def resize_(storage, size):
            out = call(storage, size)
            self._on_resize(storage)
            return out

        self._resize = (original, resize_)
        torch.UntypedStorage.resize_ = resize_

    def _on_resize(self, s) -> None:
        if s.device.type != self.device.type:
            return
        with self._lock:
            entry = self._live.get(s._cdata)
            if entry is None:  # allocated before the context, grown inside it
                if s.nbytes() > 0:
                    self._track_storage(s, None)
                return
            delta = s.nbytes() - entry[1]
            entry[1] += delta
            self._bytes[entry[2]] += delta
            self._total += delta
            if self._total > self._peak:
                self._peak, self._peak_bytes = self._total, dict(self._bytes)

    def _on_free(self, key: int) -> None:
        # A weakref callback's exceptions are printed and dropped by Python: a Ctrl-C that
        # lands here is kept and raised at the next tensor op (or at exit) instead.
        try:
            with self._lock:
                entry = self._live.pop(key, None)
                if entry is not None:
                    self._bytes[entry[2]] -= entry[1]
                    self._total -= entry[1]
        except KeyboardInterrupt:
            self._interrupted = True

    def _raise_pending_interrupt(self) -> None:
        if self._interrupted:
            self._interrupted = False
            raise KeyboardInterrupt

    def _label_state(self) -> None:
        for cat, t in _state_tensors(self.model, self.optimizer):
            self._track(t, cat)

    def _on_grad(self, p: torch.Tensor) -> None:
        self._track(p.grad, "gradients")

    def _set_phase(self, phase: str) -> None:
        self._phase = phase

    def _after_step(self, *_):
        self._phase = "activations"
        self._label_state()
