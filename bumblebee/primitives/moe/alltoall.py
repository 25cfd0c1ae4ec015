"""Expert-parallel token exchange with all-to-all (slot ``moe_comm``, ``alltoall``).

With ep ranks, rank r owns experts [r*El, (r+1)*El) (El = E / ep). One MoE layer:

  1. permute: sort this rank's (token, choice) rows by global expert id, so rows
     bound for rank 0 come first, then rank 1, ... (``local.permute``);
  2. exchange per-expert counts (all-to-all of E integers): every rank learns how
     many rows it will receive from each source for each of its experts;
  3. dispatch: ``all_to_all_single`` with uneven splits moves the rows; rows arrive
     grouped by source rank, then by local expert;
  4. regroup the received rows by local expert, run the grouped expert FFN, undo
     the regrouping;
  5. combine: the reverse ``all_to_all_single`` brings results home;
  6. unpermute, weight by the router and sum over the k choices.

Both exchanges are differentiable (``AllToAll`` below: the backward of an
all-to-all is the all-to-all with send and receive splits swapped). Every rank
takes part in every exchange, also when it sends or receives zero rows.

Legend: T tokens, H hidden, K choices per token, N = T*K rows, E experts,
El local experts, R ep ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from bumblebee.primitives.moe.costs import MoeCommCosts
from bumblebee.primitives.moe.local import (
    ExpertFn,
    dispatch_rows,
    fuse_combine,
    gather_rows,
    inverse,
    permute,
    unpermute,
)
from bumblebee.primitives.moe.needs import EXCHANGES
from bumblebee.primitives.recompute_scope import host_read
from bumblebee.registry import register


class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits, differentiable both ways."""

    @staticmethod
    def forward(ctx, x, send_splits: list[int], recv_splits: list[int], group):
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        out = x.new_empty((sum(recv_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        send_splits, recv_splits = ctx.splits
        grad_in = grad_out.new_empty((sum(send_splits),) + tuple(grad_out.shape[1:]))
        dist.all_to_all_single(
            grad_in, grad_out.contiguous(), send_splits, recv_splits, group=ctx.group
        )
        return grad_in, None, None, None


def exchange_counts(counts_E: torch.Tensor, ep: int, group) -> torch.Tensor:
    """counts_E[e] = rows this rank sends to expert e. Returns recv_RL[s, j] = rows
    source rank s sends to this rank's local expert j."""
    recv = torch.empty_like(counts_E)
    dist.all_to_all_single(recv, counts_E, group=group)
    return recv.view(ep, -1)


def regroup_by_expert(recv_RL: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """Permutation taking rows in (source, local expert) order to (local expert, source) order.
    ``total``: the rows received, when the caller knows it on the host (else read from the device)."""
    R, L = recv_RL.shape
    starts = torch.cumsum(recv_RL.flatten(), 0) - recv_RL.flatten()  # start of each (s, j) block
    starts_LR = starts.view(R, L).t().flatten()
    counts_LR = recv_RL.t().flatten()
    block_of_row = torch.repeat_interleave(torch.arange(R * L, device=recv_RL.device), counts_LR)
    offset_in_block = torch.arange(
        int(counts_LR.sum()) if total is None else total, device=recv_RL.device
    ) - torch.repeat_interleave(torch.cumsum(counts_LR, 0) - counts_LR, counts_LR)
    return starts_LR[block_of_row] + offset_in_block


def plain_routed(last: int) -> dict:
    """The routed units of a dispatch with plain all-to-alls (plan/routed_bytes.py counts them)."""
    return {
        "fwd": (((1, 0), (3, 4)), ((4, 0), (3, 0))),
        "recompute": (((4 - last, 0), (4, 4)),),
        "bwd": (((2, 0), (2, 5)),),
    }


@register(
    "moe_comm",
    "alltoall",
    summary="uneven all_to_all_single dispatch/combine over the ep group",
    needs=(EXCHANGES,),
    costs=MoeCommCosts(
        routed=lambda c, last: plain_routed(last),
        explain="alltoall: plain all-to-all dispatch and combine, not overlapped",
    ),
)
class AllToAllDispatch:
    def __init__(self, num_experts: int, ep_group=None, ep_size: int | None = None, **_unused):
        self.num_experts = num_experts
        self.group = ep_group
        self.ep = ep_size or (1 if ep_group is None else dist.get_world_size(ep_group))
        if num_experts % self.ep:
            raise ValueError(
                f"num_experts ({num_experts}) must be divisible by the ep group size ({self.ep})"
            )

    def __call__(
        self,
        x_TH: torch.Tensor,
        idx_TK: torch.Tensor,
        weight_TK: torch.Tensor,
        expert_fn: ExpertFn,
        drops: bool = False,
    ) -> torch.Tensor:
        K = idx_TK.shape[1]
        order_N, counts_E = permute(idx_TK, self.num_experts, drops)  # drops: capacity cut rows
        x_NH = dispatch_rows(x_TH, order_N, K)
        if self.ep == 1:
            return unpermute(expert_fn(x_NH, counts_E), order_N, weight_TK)
        recv_RL = self.exchange_counts(counts_E)
        # one device-to-host read for both split lists; the recompute takes the forward's
        host = host_read(torch.cat([counts_E.view(self.ep, -1).sum(1), recv_RL.sum(1)]))
        send_splits, recv_splits = host[: self.ep].tolist(), host[self.ep :].tolist()
        x_recv = self.exchange_rows(x_NH, send_splits, recv_splits)
        by_expert = regroup_by_expert(recv_RL, sum(recv_splits))
        if fuse_combine(x_recv, by_expert, x_recv.shape[0]):  # CUDA: gathers both ways
            back = inverse(by_expert)
            y_sorted = expert_fn(
                gather_rows(x_recv, by_expert, back[:, None], True), recv_RL.sum(0)
            )
            y_recv = gather_rows(y_sorted, back, by_expert[:, None], True)
        else:
            y_sorted = expert_fn(x_recv[by_expert], recv_RL.sum(0))
            y_recv = torch.empty_like(y_sorted).index_copy_(0, by_expert, y_sorted)
        y_NH = self.exchange_rows(y_recv, recv_splits, send_splits)
        return unpermute(y_NH, order_N, weight_TK)

    # the two exchanges, overridden by schedules that only move the waits (overlap_mb)
    def exchange_counts(self, counts_E: torch.Tensor) -> torch.Tensor:
        return exchange_counts(counts_E, self.ep, self.group)

    def exchange_rows(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        return AllToAll.apply(x, send, recv, self.group)
