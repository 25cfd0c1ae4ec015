"""Single-rank token dispatch and combine (slot ``moe_comm``, implementation ``local``).

The reference every expert-parallel communication scheme is paired against:
sort the (token, choice) pairs by expert, run the expert FFN on the contiguous
groups, scatter the results back to (token, choice) order, weight them by the
router and sum over the k choices. The sum over choices is a reshape + sum
rather than an ``index_add`` so the result is deterministic on every device.

Legend: T tokens, H hidden, K experts per token, E experts, N = T*K routed rows.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed

from bumblebee.registry import register

ExpertFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x_NH sorted, counts_E) -> y_NH


def permute(idx_TK: torch.Tensor, num_experts: int):
    """Order of the N = T*K routed rows sorted by expert (stable), and per-expert counts."""
    flat_N = idx_TK.flatten()
    order_N = torch.argsort(flat_N, stable=True)
    counts_E = torch.bincount(flat_N, minlength=num_experts)
    return order_N, counts_E


def unpermute(y_NH: torch.Tensor, order_N: torch.Tensor, weight_TK: torch.Tensor) -> torch.Tensor:
    """Inverse of ``permute``: back to (token, choice) order, weight and sum over choices."""
    T, K = weight_TK.shape
    y_unsorted = torch.empty_like(y_NH).index_copy_(0, order_N, y_NH)
    return (y_unsorted.view(T, K, -1) * weight_TK[..., None].to(y_NH.dtype)).sum(dim=1)


@register("moe_comm", "local", reference=True, summary="all experts on this rank: permute, FFN, unpermute")
class LocalDispatch:
    def __init__(self, num_experts: int, ep_group=None, **_unused):
        if ep_group is not None and torch.distributed.get_world_size(ep_group) > 1:
            raise ValueError("moe_comm = 'local' keeps every expert on one rank; with ep > 1 use 'alltoall'")
        self.num_experts = num_experts

    def __call__(self, x_TH: torch.Tensor, idx_TK: torch.Tensor, weight_TK: torch.Tensor,
                 expert_fn: ExpertFn) -> torch.Tensor:
        K = idx_TK.shape[1]
        order_N, counts_E = permute(idx_TK, self.num_experts)
        y_NH = expert_fn(x_TH[order_N // K], counts_E)
        return unpermute(y_NH, order_N, weight_TK)
