"""Packed-document attention with per-head sinks (and a window) on PyTorch's flash kernels.

No flash kernel PyTorch ships takes sink logits, but a sink only rescales each row of plain
attention (``options.py``): with the kernel's (o, lse), ``lse' = logaddexp(lse, sink)`` and
``o' = o exp(lse - lse')``. Flash backward recomputes P = exp(S - lse) and Delta = rowsum(dO O)
from the (output, LSE) it is handed, so handing it (o', lse') gives exactly the sink attention's
dQ, dK, dV (the sink column has no value); the sinks' own gradient is
``-sum_rows exp(sink - lse') Delta``. ``varlen_attn``'s public wrapper drops the LSE gradient,
so this calls the ops behind it (``torch.ops.torch_attn._varlen_attn`` / ``_varlen_attn_backward``,
through ``varlen_api.py``) from its own autograd function, as the flash ring does.

The kernel pair is a parameter: ``cuda_kernel()`` (the ops; their references under the
emulated-CUDA mode) or ``reference_kernel()``, the same contract in fp32 PyTorch, which is how
the glue is tested on CPU.

Legend: B batch, N query heads, K kv heads, T tokens, D head dim, S packed tokens (B x T).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from bumblebee.primitives import emulation
from bumblebee.primitives.attention import varlen_api
from bumblebee.primitives.attention.flash import (
    FLASH_BWD,
    FLASH_FWD,
    cu_seqlens,
    reference_varlen_attn,
)
from bumblebee.primitives.attention.options import merge_sinks, sink_grad
from bumblebee.primitives.kernel_region import kernel as kernel_region
from bumblebee.primitives.packed import DocLayout


@dataclass(frozen=True)
class WindowKernel:
    # forward(q [S,N,D], k [S,K,D], v, cu, longest, window_size, scale) -> (o [S,N,D], lse fp32 [N,S])
    forward: Callable
    # backward(do, q, k, v, o, lse, cu, longest, window_size, scale) -> (dq, dk, dv)
    backward: Callable


def cuda_kernel() -> WindowKernel:
    if emulation.active():
        ref = reference_kernel()

        def fwd_counted(*a):
            with kernel_region(*FLASH_FWD):
                return ref.forward(*a)

        def bwd_counted(*a):
            with kernel_region(*FLASH_BWD):
                return ref.backward(*a)

        return WindowKernel(fwd_counted, bwd_counted)
    from bumblebee.primitives.kernel_choice import use_flash_impl

    use_flash_impl()

    def fwd(q, k, v, cu, longest, window_size, scale):
        causal = tuple(window_size) == (-1, 0)
        return varlen_api.forward(q, k, v, cu, cu, longest, longest, causal, scale, window_size)

    def bwd(do, q, k, v, o, lse, cu, longest, window_size, scale):
        causal = tuple(window_size) == (-1, 0)
        return varlen_api.backward(
            do, q, k, v, o, lse, cu, cu, longest, longest, causal, scale, window_size
        )

    return WindowKernel(fwd, bwd)


def _allowed(n: int, window_size, device) -> torch.Tensor:
    i = torch.arange(n, device=device)
    ok = i[None, :] <= i[:, None]
    return ok & (i[None, :] >= i[:, None] - window_size[0]) if window_size[0] >= 0 else ok


def reference_kernel() -> WindowKernel:
    """The ops' contract in fp32 PyTorch (one sequence per document, same q and k boundaries)."""
    from torch.nn.attention.varlen import AuxRequest

    def fwd(q, k, v, cu, longest, window_size, scale):
        return reference_varlen_attn(
            q, k, v, cu, cu, longest, longest, return_aux=AuxRequest(lse=True), scale=scale,
            window_size=tuple(window_size), enable_gqa=k.shape[1] != q.shape[1],
        )  # fmt: skip

    def bwd(do, q, k, v, o, lse, cu, longest, window_size, scale):
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        G, bounds = q.shape[1] // k.shape[1], cu.tolist()
        for s0, s1 in zip(bounds[:-1], bounds[1:]):
            qs, dos, os_ = (x[s0:s1].float().transpose(0, 1) for x in (q, do, o))  # [N, L, D]
            ks, vs = (x[s0:s1].float().transpose(0, 1).repeat_interleave(G, 0) for x in (k, v))
            s = (qs @ ks.transpose(-1, -2) * scale).masked_fill(
                ~_allowed(s1 - s0, window_size, q.device), float("-inf")
            )
            p = torch.exp(s - lse[:, s0:s1, None])
            ds = p * (dos @ vs.transpose(-1, -2) - (dos * os_).sum(-1, keepdim=True))
            dq[s0:s1] = (ds @ ks * scale).transpose(0, 1).to(dq.dtype)
            dk_i = (ds.transpose(-1, -2) @ qs * scale).unflatten(0, (-1, G)).sum(1)
            dv_i = (p.transpose(-1, -2) @ dos).unflatten(0, (-1, G)).sum(1)
            dk[s0:s1] = dk_i.transpose(0, 1).to(dk.dtype)
            dv[s0:s1] = dv_i.transpose(0, 1).to(dv.dtype)
        return dq, dk, dv

    return WindowKernel(fwd, bwd)


class FlashSinks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_SND, k_SKD, v_SKD, sinks_N, cu, longest, window_size, scale, kern):
        o, lse = kern.forward(q_SND, k_SKD, v_SKD, cu, longest, window_size, scale)
        o, lse = merge_sinks(o.float().transpose(0, 1), lse, sinks_N.float()[:, None])  # [N, S, D]
        o = o.transpose(0, 1).to(q_SND.dtype)
        ctx.save_for_backward(q_SND, k_SKD, v_SKD, sinks_N, o, lse, cu)
        ctx.args = (longest, window_size, scale, kern)
        return o

    @staticmethod
    def backward(ctx, do_SND):
        q, k, v, sinks, o, lse, cu = ctx.saved_tensors
        longest, window_size, scale, kern = ctx.args
        do_SND = do_SND.contiguous()
        dq, dk, dv = kern.backward(do_SND, q, k, v, o, lse, cu, longest, window_size, scale)
        delta = (do_SND.float() * o.float()).sum(-1).transpose(0, 1)  # [N, S]
        ds = sink_grad(sinks.float()[:, None], lse, delta).reshape(-1).to(sinks.dtype)
        return dq, dk, dv, ds, None, None, None, None, None


def flash_varlen_sinks(
    q_BNTD, k_BKTD, v_BKTD, layout: DocLayout, scale: float, sinks_N, *, window=0, kern=None
):
    """Causal attention per packed document with sinks (and ``window``) -> o [B, N, T, D]."""
    kern = kern or cuda_kernel()
    B, N, T, D = q_BNTD.shape
    cu, longest = cu_seqlens(layout, q_BNTD.device)
    q, k, v = (x.transpose(1, 2).reshape(B * T, x.shape[1], D) for x in (q_BNTD, k_BKTD, v_BKTD))
    window_size = (window - 1 if window else -1, 0)
    o = FlashSinks.apply(q, k, v, sinks_N, cu, longest, window_size, scale, kern)
    return o.view(B, T, N, D).transpose(1, 2)
