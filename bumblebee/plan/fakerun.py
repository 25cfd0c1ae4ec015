"""Fake-tensor execution with values where the code needs them, and live bytes by term.

``FakeRun`` is a ``TorchDispatchMode`` placed above ``FakeTensorMode``. It does two things:

1. Byte accounting. Every storage an op produces is tracked until it is freed (a weakref
   finalizer), labelled with the term the code was in when it was allocated (``label``,
   set by the dry run: "forward:<layer>:<micro-batch>", "backward", "moe", "loss",
   "optimizer", ...). ``peak_by_phase`` keeps, per phase, the largest total and the bytes
   of each label at that instant: the measured counterpart of the analytic timeline.

2. Shadow values. Fake tensors have shapes, not values, but the code reads a few small
   integer tensors on the host: per-expert routing counts, all-to-all split sizes, segment
   starts. A fake integer/bool tensor may carry ``_bb_shadow``, a real CPU tensor with its
   value; an op whose tensor inputs all carry shadows runs on the shadows too (so views,
   in-place updates, ``nonzero``, ``repeat_interleave`` and ``.tolist()`` see real numbers).
   Shadows start at integer factories (``arange``, ``zeros``, ``torch.tensor(list)``), at
   ``bincount`` (the routing assumption: ``routing(n_rows, n_bins)`` gives the counts) and at
   collectives on shadowed inputs: every rank is assumed to hold the same value as this
   rank, which is the rank with coordinate 0 in every group it belongs to (all-to-all:
   chunk s of the output is chunk 0 of the input; all-gather: copies; all-reduce sum:
   ``size`` x). A host read of a value with no shadow raises ``DataDependent``, except a
   boolean check (``if bad.any(): raise``), which is taken as passing (inputs are valid).
"""

from __future__ import annotations

import weakref

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    unset_fake_temporarily,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

aten = torch.ops.aten
SHADOW_MAX = 1 << 24  # integer tensors up to this many elements carry values
_INT = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)


class DataDependent(RuntimeError):
    pass


def shadow(t):
    return getattr(t, "_bb_shadow", None) if isinstance(t, torch.Tensor) else None


def _shadowable(t: torch.Tensor) -> bool:
    return t.dtype in _INT and t.numel() <= SHADOW_MAX


class FakeRun(TorchDispatchMode):
    def __init__(self, routing):
        super().__init__()
        self.routing = routing  # (rows, bins) -> int64 counts [bins] summing to rows
        self.label = "static"
        self.phase = "static"
        self.mb = 0  # micro-batch being run (labels only)
        self.layer = ""  # label of the decoder layer whose forward runs
        self.stack: list[str] = []  # labels interrupted by a scope (restored when it ends)
        self.current = 0
        self.by_label: dict[str, int] = {}
        # moment -> (total, bytes by label, the label being run) at its peak; the moment is the
        # phase, or "loss" while the loss code runs (forward or backward)
        self.peaks: dict[str, tuple[int, dict[str, int], str]] = {}
        self._live: dict[int, tuple[int, str]] = {}
        self.collectives: dict[str, int] = {}  # c10d op -> calls (what the rank exchanged)

    # ------------------------------------------------------------------ bytes
    def track(self, t: torch.Tensor, label: str | None = None) -> None:
        st = t.untyped_storage()
        key = id(st)
        if key in self._live:
            return
        label = label or self.label
        self._live[key] = (st.nbytes(), label)
        self.current += st.nbytes()
        self.by_label[label] = self.by_label.get(label, 0) + st.nbytes()
        weakref.finalize(st, self._free, key)
        moment = "loss" if label == "loss" else self.phase
        # the moment, the moment per layer, and the backward's MoE / mixer parts on their own
        keys = (moment, f"{moment}@{self.layer}") + (
            (f"{moment}:{label}",) if label in ("moe", "mixer") else ()
        )
        for key in keys:
            best = self.peaks.get(key)
            if best is None or self.current > best[0]:
                self.peaks[key] = (self.current, dict(self.by_label), self.layer)

    def _free(self, key: int) -> None:
        n, label = self._live.pop(key, (0, ""))
        self.current -= n
        if label:
            self.by_label[label] -= n

    def relabel(self, tensors, label: str) -> None:
        for t in tensors:
            key = id(t.untyped_storage())
            if key in self._live:
                n, old = self._live[key]
                self.by_label[old] -= n
                self.by_label[label] = self.by_label.get(label, 0) + n
                self._live[key] = (n, label)

    def set_phase(self, phase: str) -> None:
        self.phase = phase
        self.peaks[phase] = (self.current, dict(self.by_label), self.layer)

    # ------------------------------------------------------------------ values
    def _collective(self, func, args, out):
        name = func.__name__
        if "alltoall_base" in name:  # (output, input, group, out_splits, in_splits, timeout)
            o, i, pg = args[0], args[1], args[2]
            si = shadow(i)
            if si is not None:
                size = torch._C._distributed_c10d.ProcessGroup.unbox(pg).size()
                first = args[4][0] if len(args) > 4 and args[4] else i.shape[0] // size
                o._bb_shadow = si[:first].repeat((size,) + (1,) * (si.dim() - 1))
        elif "allgather" in name or "all_gather" in name:
            outs, i = args[0], args[1]
            flat_o = [t for t in tree_flatten(outs)[0] if isinstance(t, torch.Tensor)]
            flat_i = [t for t in tree_flatten(i)[0] if isinstance(t, torch.Tensor)]
            if flat_i and shadow(flat_i[0]) is not None:
                si = shadow(flat_i[0]).reshape(-1)
                for o in flat_o:
                    o._bb_shadow = si.repeat(o.numel() // max(1, si.numel())).reshape(o.shape)
        return out

    def _on_shadows(self, func, args, kwargs):
        def real(x):
            return shadow(x) if isinstance(x, torch.Tensor) else x

        with unset_fake_temporarily():
            out = func(*tree_map(real, args), **tree_map(real, kwargs))
            if "empty" in func.__name__:  # uninitialized memory: zeros, deterministic
                out.zero_()
            return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        if func.namespace == "c10d":
            self.collectives[func.__name__] = self.collectives.get(func.__name__, 0) + 1
            out = func(*args, **kwargs)
            with unset_fake_temporarily():
                return self._collective(func, args, out)
        if func is aten._local_scalar_dense.default:
            s = shadow(args[0])
            if s is not None:
                with unset_fake_temporarily():
                    return s.item()
            if args[0].dtype == torch.bool:
                return False
            raise DataDependent(f"{func} on a tensor without a value")
        if func is aten.lift_fresh.default or func is aten.lift_fresh_copy.default:
            out = func(*args, **kwargs)
            if _shadowable(out):
                with unset_fake_temporarily():
                    out._bb_shadow = (
                        args[0].clone()
                        if not hasattr(args[0], "fake_mode")
                        else torch.zeros(args[0].shape, dtype=args[0].dtype)
                    )
            self.track(out)
            return out
        if func is aten.bincount.default and shadow(args[0]) is None:
            minlength = kwargs.get("minlength", args[2] if len(args) > 2 else 0)
            counts = self.routing(args[0].numel(), max(minlength, 1))
            out = torch.empty(counts.shape, dtype=torch.int64, device=args[0].device)
            out._bb_shadow = counts
            self.track(out)
            return out
        values = bool(flat) and all(shadow(t) is not None for t in flat)
        try:
            out = func(*args, **kwargs)
            factory = not flat and all(
                _shadowable(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)
            )
            real_out = self._on_shadows(func, args, kwargs) if values or factory else None
        except (DynamicOutputShapeException, DataDependentOutputException):
            if not values:
                raise DataDependent(
                    f"{func}: output shape depends on values that do not exist"
                ) from None
            real_out = self._on_shadows(func, args, kwargs)
            out = tree_map(
                lambda r: (
                    torch.empty_strided(r.shape, r.stride(), dtype=r.dtype, device=flat[0].device)
                    if isinstance(r, torch.Tensor)
                    else r
                ),
                real_out,
            )
        if real_out is not None:
            outs, _ = tree_flatten(out)
            reals, _ = tree_flatten(real_out)
            for o, r in zip(outs, reals):
                if isinstance(o, torch.Tensor) and isinstance(r, torch.Tensor) and _shadowable(o):
                    o._bb_shadow = r
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.track(t)
        return out


def make_routing(skew: float, num_local: int, ep: int):
    """Counts per expert for ``rows`` routed rows over ``bins`` experts: balanced (``skew`` 1),
    or the ``num_local`` experts of ep-rank 0 (this rank) receiving ``skew`` x their share, the
    rest spread evenly over the other experts (the sum is unchanged)."""

    def routing(rows: int, bins: int) -> torch.Tensor:
        with unset_fake_temporarily():
            if skew == 1.0 or ep == 1 or bins < ep:
                base = torch.full((bins,), rows // bins, dtype=torch.int64)
                base[: rows - int(base.sum())] += 1
                return base
            hot = min(rows, int(round(rows * skew / ep)))
            counts = torch.zeros(bins, dtype=torch.int64)
            counts[:num_local] = hot // num_local
            counts[0] += hot - int(counts[:num_local].sum())
            rest = rows - hot
            others = bins - num_local
            counts[num_local:] = rest // others
            counts[num_local : num_local + rest - (rest // others) * others] += 1
            return counts

    return routing
