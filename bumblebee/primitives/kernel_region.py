"""Kernel regions: code that stands in for a fused kernel counts as that kernel.

Under the emulated-CUDA mode (``emulation.py``) a CUDA kernel (FLA's chunk kernel and causal
conv, flash varlen attention, the ring's flash block ops, the compiled glue of ``fused.py``) is
replaced by a plain-PyTorch reference of its contract. A launch counter (``perf/syncs.py``)
would count the reference's own ops -- hundreds per call -- where CUDA launches a handful. The
stand-ins run inside ``kernel(name, launches, syncs)``: the counter counts each region once, as
``launches`` kernel launches and ``syncs`` host syncs (what the real kernel does), and none of
the ops and host reads inside it.

Regions nest: each counts once, the ops inside any of them count nowhere (FLA's explicit
backward re-runs the forward under autograd: a forward region inside the backward's). Autograd's
backward of a stand-in runs outside its forward region; ``standin`` wraps a stand-in in an
``autograd.Function`` whose backward (recompute, then autograd) enters a region of its own.

This module imports nothing from bumblebee: the counter (perf, which may import core only)
reads ``current()`` through a layering exception for this one module (tests/unit/test_layering.py).
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

import torch

_REGIONS: contextvars.ContextVar[tuple] = contextvars.ContextVar(
    "bumblebee_kernel_regions", default=()
)


@dataclass(eq=False)
class Region:
    name: str  # the kernel(s) stood for, e.g. "fla chunk_gated_delta_rule fwd"
    launches: int  # kernel launches of the real kernel per call
    syncs: int = 0  # host syncs the real kernel makes per call


def current() -> tuple[Region, ...]:
    """The regions entered, outermost first (empty outside every region)."""
    return _REGIONS.get()


@contextlib.contextmanager
def kernel(name: str, launches: int, syncs: int = 0):
    """Run the block as the kernel(s) ``name``: ``launches`` launches and ``syncs`` host syncs
    per call for a launch counter, whatever the block executes."""
    token = _REGIONS.set(_REGIONS.get() + (Region(name, launches, syncs),))
    try:
        yield
    finally:
        _REGIONS.reset(token)


_TENSOR = object()  # placeholder for a saved tensor argument


class _Standin(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, fwd, bwd, *args):
        ctx.fn, ctx.bwd = fn, bwd
        ctx.save_for_backward(*[a for a in args if isinstance(a, torch.Tensor)])
        ctx.args = [_TENSOR if isinstance(a, torch.Tensor) else a for a in args]
        with kernel(*fwd):
            return fn(*args)

    @staticmethod
    def backward(ctx, *grads):
        saved = iter(ctx.saved_tensors)
        need = ctx.needs_input_grad[3:]
        inputs = [
            next(saved).detach().requires_grad_(n) if a is _TENSOR else a
            for a, n in zip(ctx.args, need)
        ]
        wanted = [x for x, n in zip(inputs, need) if n]
        with kernel(*ctx.bwd), torch.enable_grad():
            out = ctx.fn(*inputs)
            outs = out if isinstance(out, tuple) else (out,)
            pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
            got = (
                torch.autograd.grad(
                    [o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True
                )
                if pairs and wanted
                else [None] * len(wanted)
            )
        got = iter(got)
        return (None, None, None, *(next(got) if n else None for n in need))


def standin(fn, fwd: tuple[str, int], bwd: tuple[str, int], *args):
    """``fn(*args)`` (``fn``: tensors and constants in, a tensor or a tuple of tensors out) run
    as a kernel pair: forward inside ``kernel(*fwd)``; backward (``fn`` recomputed under
    autograd) inside ``kernel(*bwd)``. Values and gradients are ``fn``'s own; only where its
    ops are counted changes."""
    return _Standin.apply(fn, fwd, bwd, *args)
