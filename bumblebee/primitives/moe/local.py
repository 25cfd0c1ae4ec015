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


def unpermute(y_NH: torch.Tensor, order_N: torch.Tensor, weight_TK: torch.Tensor) -> torch.Tensor:
    """Inverse of ``permute``: back to (token, choice) order, weight and sum over choices."""
    T, K = weight_TK.shape
    y_unsorted = unsort_rows(y_NH, order_N, T * K)
    return (y_unsorted.view(T, K, -1) * weight_TK[..., None].to(y_NH.dtype)).sum(dim=1)


@register(
    "moe_comm", "local", reference=True, summary="all experts on this rank: permute, FFN, unpermute"
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
        y_NH = expert_fn(x_TH[order_N // K], counts_E)
        return unpermute(y_NH, order_N, weight_TK)
