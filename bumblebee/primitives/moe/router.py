"""Token router (slot ``router``) and the load-balancing auxiliary loss.

``softmax_topk`` (reference, the Qwen3 router): logits = x W^T, softmax in fp32
over experts, keep the top-k; with ``norm_topk_prob`` the kept weights are
renormalized to sum to one. Weights are returned in the activation dtype.

Legend: T tokens, H hidden, E experts, K experts per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from bumblebee.registry import register


@dataclass
class Routing:
    probs_TE: torch.Tensor  # fp32 softmax over all experts (for the aux loss)
    idx_TK: torch.Tensor  # chosen experts
    weight_TK: torch.Tensor  # combine weights, activation dtype


@register("router", "softmax_topk", reference=True, summary="softmax over experts, top-k, optional renorm")
class SoftmaxTopKRouter(nn.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int, norm_topk_prob: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob

    def forward(self, x_TH: torch.Tensor) -> Routing:
        logits_TE = F.linear(x_TH, self.weight)
        probs_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float32)
        top_w, top_i = torch.topk(probs_TE, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        return Routing(probs_TE, top_i, top_w.to(logits_TE.dtype))


def load_balancing_loss(probs_TE: torch.Tensor, idx_TK: torch.Tensor, group=None) -> torch.Tensor:
    """Switch-Transformer balance loss (Fedus et al. 2021, eq. 4-6), HF's scaling:
    ``E * sum_e (assignments to e / T) * mean_t p[t, e]``; equals K at perfect balance.

    With ``group`` (the CP group: ranks holding pieces of the same sequences) the
    statistics are summed over the group first, so the value is that of the whole
    sequence on every rank, whatever the CP size. The probability sum goes through a
    differentiable all-reduce, so each rank's tokens get their exact gradient once the
    caller weights the (identical) per-rank losses by 1 / group size."""
    T, E = probs_TE.shape
    counts_E = torch.zeros(E, device=probs_TE.device, dtype=torch.float32)
    counts_E.scatter_add_(0, idx_TK.flatten(), torch.ones(idx_TK.numel(), device=probs_TE.device))
    prob_sum_E = probs_TE.sum(dim=0)
    if group is not None:
        import torch.distributed as dist

        from bumblebee.primitives.parallel import AllReduceSum

        stats = torch.cat([counts_E, counts_E.new_tensor([T])])
        dist.all_reduce(stats, group=group)
        counts_E, T = stats[:E], stats[E]
        prob_sum_E = AllReduceSum.apply(prob_sum_E, group)
    return E * torch.sum(counts_E / T * prob_sum_E / T)
