"""Single-rank token dispatch and combine (slot ``moe_comm``, implementation ``local``).

The reference every expert-parallel communication scheme is paired against:
sort the (token, choice) pairs by expert, run the expert FFN on the contiguous
groups, scatter the results back to (token, choice) order, weight them by the
router and sum over the k choices. The sum over choices is a reshape + sum
rather than an ``index_add`` so the result is deterministic on every device.

Legend: T tokens, H hidden, K experts per token, E experts, N = T*K routed rows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed

from bumblebee.primitives import emulation
from bumblebee.primitives.fused import compiled_call
from bumblebee.primitives.kernel_choice import select
from bumblebee.primitives.moe.costs import MoeCommCosts
from bumblebee.primitives.moe.needs import ONE_RANK
from bumblebee.registry import register

ExpertFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x_NH sorted, counts_E) -> y_NH


def permute(idx_TK: torch.Tensor, num_experts: int, drops: bool = False):
    """Order of the routed rows sorted by expert (stable), and per-expert counts. With ``drops``
    (capacity, primitives/moe/capacity.py) ids equal to ``num_experts`` mark dropped (token,
    choice) pairs: they sort last and are cut, so N = kept rows <= T*K (one host sync)."""
    flat_N = idx_TK.flatten()
    order_N = torch.argsort(flat_N, stable=True)
    if not drops:
        return order_N, torch.bincount(flat_N, minlength=num_experts)
    counts_E = torch.bincount(flat_N, minlength=num_experts + 1)[
        :num_experts
    ].clone()  # own storage: sent as is
    return order_N[: int(counts_E.sum())], counts_E


def unsort_rows(y_NH: torch.Tensor, order_N: torch.Tensor, rows: int) -> torch.Tensor:
    """Rows back to (token, choice) order [rows, ...]; dropped pairs (absent from ``order_N``) are 0."""
    if order_N.numel() == rows:
        return torch.empty_like(y_NH).index_copy_(0, order_N, y_NH)
    return y_NH.new_zeros((rows,) + tuple(y_NH.shape[1:])).index_copy_(0, order_N, y_NH)


def fuse_combine(y_NH: torch.Tensor, order_N: torch.Tensor, rows: int) -> bool:
    """Whether the combine (unsort, weight, sum over choices) runs as one fused kernel: on CUDA
    (the dispatch's compiled glue) and when no pair was dropped."""
    fused = select("glue", "fused", emulation.kind(y_NH), y_NH.dtype).name == "compiled"
    return fused and order_N.numel() == rows


def inverse(order_N: torch.Tensor) -> torch.Tensor:
    """The inverse permutation: where each (token, choice) row sits in sorted order."""
    inv_N = torch.empty_like(order_N)
    inv_N[order_N] = torch.arange(order_N.numel(), device=order_N.device)
    return inv_N


def gather_combine(y_NH: torch.Tensor, inv_TK: torch.Tensor, weight_TK: torch.Tensor):
    """``unpermute``'s maths as one gather: rows in (token, choice) order read straight from the
    sorted rows (no unsorted copy), weighted, summed (one fused kernel on CUDA)."""
    return (y_NH[inv_TK] * weight_TK[..., None].to(y_NH.dtype)).sum(dim=1)


def _combine_grads(g_TH, y_NH, order_N, inv_TK, weight_TK):
    """The combine's gradients as gathers, no scatter into zeros: rows ``g[token] w``, weights
    ``<g[t], y[inv[t, k]]>`` (the products autograd's eager backward forms, in the same order)."""
    K = inv_TK.shape[1]
    w_N = weight_TK.flatten()[order_N].to(y_NH.dtype)
    dy_NH = g_TH[order_N // K] * w_N[:, None]
    dw_TK = (g_TH[:, None, :] * y_NH[inv_TK]).sum(-1)
    return dy_NH, dw_TK


class _Combine(torch.autograd.Function):
    """``gather_combine`` with its backward as two gathers (one compiled kernel each way on CUDA)."""

    @staticmethod
    def forward(ctx, y_NH, order_N, inv_TK, weight_TK):
        ctx.save_for_backward(y_NH, order_N, inv_TK, weight_TK)
        return compiled_call("moe_combine fwd", 1, gather_combine, y_NH, inv_TK, weight_TK)

    @staticmethod
    def backward(ctx, g_TH):
        y_NH, order_N, inv_TK, weight_TK = ctx.saved_tensors
        args = (g_TH.contiguous(), y_NH, order_N, inv_TK, weight_TK)
        dy_NH, dw_TK = compiled_call("moe_combine bwd", 2, _combine_grads, *args)
        return dy_NH, None, None, dw_TK.to(weight_TK.dtype)


class _Gather(torch.autograd.Function):
    """``x[rows]`` whose backward sums each source row's gradients through the inverse map
    (``inv_TK`` [T, K]: the gathered positions of source row t) -- one gather-sum kernel, not a
    scatter-add into zeros (nor its atomics: deterministic on CUDA). A permutation has K = 1."""

    @staticmethod
    def forward(ctx, x_TH, rows_N, inv_TK):
        ctx.save_for_backward(inv_TK)
        return x_TH[rows_N]

    @staticmethod
    def backward(ctx, g_NH):
        (inv_TK,) = ctx.saved_tensors
        return (
            compiled_call("moe_gather bwd", 1, _gather_sum, g_NH.contiguous(), inv_TK),
            None,
            None,
        )


def _gather_sum(g_NH, inv_TK):
    return g_NH[inv_TK].sum(dim=1)


def gather_rows(x_TH, rows_N, inv_TK, fuse: bool):
    """``x_TH[rows_N]``; with ``fuse`` (CUDA) its backward is ``_Gather``'s gather-sum."""
    return _Gather.apply(x_TH, rows_N, inv_TK) if fuse else x_TH[rows_N]


def _combine_into(out_TH, y_NH, inv_TK, weight_TK):
    torch.sum(y_NH[inv_TK] * weight_TK[..., None].to(y_NH.dtype), dim=1, out=out_TH)


def _sum_into(out_TH, y_NH, inv_TK):
    torch.sum(y_NH[inv_TK], dim=1, out=out_TH)


def combine_into(out_TH, y_NH, order_N, K: int, weight_TK=None):
    """``unpermute`` (``weight_TK`` None: the plain sum over choices) written into ``out_TH``, for
    code with its own backward (chunked EP). On CUDA one compiled gather-weight-sum kernel; returns
    the inverse permutation [T*K] it used then (None: the eager unsort)."""
    T = out_TH.shape[0]
    if fuse_combine(y_NH, order_N, T * K):
        inv_TK = inverse(order_N).view(T, K)
        if weight_TK is None:
            compiled_call("moe_uncombine", 1, _sum_into, out_TH, y_NH, inv_TK)
        else:
            compiled_call("moe_combine", 1, _combine_into, out_TH, y_NH, inv_TK, weight_TK)
        return inv_TK.flatten()
    rows_TKH = unsort_rows(y_NH, order_N, T * K).view(T, K, y_NH.shape[-1])
    if weight_TK is None:
        torch.sum(rows_TKH, dim=1, out=out_TH)
    else:
        torch.sum(rows_TKH * weight_TK[..., None].to(rows_TKH.dtype), dim=1, out=out_TH)
    return None


def dispatch_rows(x_TH: torch.Tensor, order_N: torch.Tensor, K: int) -> torch.Tensor:
    """The routed rows in expert order, ``x_TH[order_N // K]``; on CUDA its backward (the sum over
    choices) is one gather-sum kernel."""
    fuse = fuse_combine(x_TH, order_N, x_TH.shape[0] * K)
    inv_TK = inverse(order_N).view(-1, K) if fuse else None
    return gather_rows(x_TH, order_N // K, inv_TK, fuse)


def unpermute(y_NH: torch.Tensor, order_N: torch.Tensor, weight_TK: torch.Tensor) -> torch.Tensor:
    """Inverse of ``permute``: back to (token, choice) order, weight and sum over choices. On CUDA
    one fused kernel (``gather_combine``: the same values, without the two [N, H] temporaries)."""
    T, K = weight_TK.shape
    if fuse_combine(y_NH, order_N, T * K):
        inv_TK = inverse(order_N).view(T, K)
        return _Combine.apply(y_NH, order_N, inv_TK, weight_TK)
    y_unsorted = unsort_rows(y_NH, order_N, T * K)
    return (y_unsorted.view(T, K, y_NH.shape[-1]) * weight_TK[..., None].to(y_NH.dtype)).sum(dim=1)


@register(
    "moe_comm",
    "local",
    reference=True,
    summary="all experts on this rank: permute, FFN, unpermute",
    needs=(ONE_RANK,),
    costs=MoeCommCosts(
        routed=lambda c, last: {
            "fwd": (((0, 0), (2, 4)), ((0, 0), (3, 0))),
            "recompute": (((0, 0), (4 - last, 4)),),
            "bwd": (((0, 0), (4, 5)),),
        },
        exchanges=False,
        explain="local: ep = 1, no token exchange",
    ),
)
class LocalDispatch:
    def __init__(self, num_experts: int, ep_group=None, ep_size: int | None = None, **_unused):
        ep = ep_size or (1 if ep_group is None else torch.distributed.get_world_size(ep_group))
        if ep > 1:
            raise ValueError(
                "moe_comm = 'local' keeps every expert on one rank; with ep > 1 use 'alltoall'"
            )
        self.num_experts = num_experts

    def __call__(
        self,
        x_TH: torch.Tensor,
        idx_TK: torch.Tensor,
        weight_TK: torch.Tensor,
        expert_fn: ExpertFn,
        drops: bool = False,
    ) -> torch.Tensor:
        K = idx_TK.shape[1]
        order_N, counts_E = permute(idx_TK, self.num_experts, drops)
        y_NH = expert_fn(dispatch_rows(x_TH, order_N, K), counts_E)
        return unpermute(y_NH, order_N, weight_TK)
