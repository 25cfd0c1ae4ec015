"""Elementwise glue as one kernel on CUDA: ``torch.compile`` (inductor) per function, regional.

RMSNorm, the gated RMSNorm, SwiGLU's product and RoPE are chains of small eager ops (an fp32
RMSNorm is cast, square, mean, add, rsqrt, multiply, cast, multiply: 8 launches forward and more
backward), each a full read and write of the activation. On CUDA (``kernel_choice.select("glue",
"fused", ...)``) each function here is compiled on its own, as torchtitan compiles per block: a
fused forward kernel and a fused backward, nothing else of the model traced. Elsewhere the same
function runs eagerly -- it is the reference, and the CPU path. Under the emulated-CUDA mode it
runs eagerly inside a kernel region (``kernel_region.standin``): counted as the compiled kernels,
its backward recomputed from the inputs as a fused backward would.

A function is a module-level one (compiled once, cached on it) taking tensors and constants as
positional arguments (weights included, so their gradients flow through the stand-in).
"""

from __future__ import annotations

import functools
import warnings

import torch

from bumblebee.primitives import emulation
from bumblebee.primitives.kernel_choice import select
from bumblebee.primitives.kernel_region import kernel, standin

# launches of one compiled function (inductor): one fused forward kernel; backward one kernel for
# the input gradients and one reduction for a weight's, when there is a weight
FWD, BWD, BWD_WEIGHT = 1, 1, 2


@functools.cache
def _compiled(fn, backend: str = "inductor"):
    """``fn`` compiled whole (``fullgraph``). Each new variant of its inputs (row counts, dtypes,
    grad mode: eval, MTP and RL each bring their own) is a recompile; past torch's per-function
    limit (``torch._dynamo.config.recompile_limit``) a fullgraph compile raises instead of running.
    From then on the function's new variants run eagerly, its compiled ones as before, after one
    warning naming it."""
    from torch._dynamo.exc import FailOnRecompileLimitHit

    compiled = torch.compile(fn, fullgraph=True, dynamic=None, backend=backend)
    full = False

    def call(*args):
        nonlocal full
        if not full:
            try:
                return compiled(*args)
            except FailOnRecompileLimitHit:
                full = True
                warnings.warn(
                    f"fused.py: {fn.__qualname__} reached torch's recompile limit "
                    f"({torch._dynamo.config.recompile_limit}); its new input variants run eagerly",
                    stacklevel=2,
                )
        with torch.compiler.set_stance("eager_on_recompile"):
            return compiled(*args)

    return call


def fused(name: str, fn, *args, weight: bool = False, bwd: int | None = None):
    """``fn(*args)``: compiled on CUDA, eager elsewhere (counted as compiled when emulated; ``bwd``:
    the backward's launches when not the default's)."""
    x = args[0]
    if select("glue", "fused", emulation.kind(x), x.dtype).name != "compiled":
        return fn(*args)
    if x.is_cuda:
        return _compiled(fn)(*args)
    bwd = bwd or (BWD_WEIGHT if weight else BWD)
    return standin(fn, (f"{name} fwd (compiled)", FWD), (f"{name} bwd (compiled)", bwd), *args)


def compiled_call(name: str, launches: int, fn, *args):
    """``fn(*args)`` as one compiled function inside code that does its own backward (an
    ``autograd.Function``'s forward or backward): compiled on CUDA tensors, else eager (under the
    emulated-CUDA mode inside a kernel region counted as ``launches`` kernels). Callers decide
    with ``select("glue", "fused", ...)`` whether to fuse at all."""
    if args[0].is_cuda:
        return _compiled(fn)(*args)
    with kernel(f"{name} (compiled)", launches):
        return fn(*args)


def _swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(gate) * up


def _swiglu_halves(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (one fused kernel on CUDA)."""
    return fused("swiglu", _swiglu, gate, up)


def swiglu_halves(h: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``h = [gate | up]`` on the last dim (one fused kernel on CUDA)."""
    return fused("swiglu", _swiglu_halves, h)


def _clamped_swiglu_halves(h: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(alpha * gate)


def clamped_swiglu_halves(h: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's GLU of ``h = [gate | up]``: gate clamped above and up on both sides at ``limit``,
    then ``(up + 1) * gate * sigmoid(alpha * gate)`` (one fused kernel on CUDA)."""
    return fused("clamped_swiglu", _clamped_swiglu_halves, h, alpha, limit)
