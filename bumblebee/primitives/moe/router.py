"""Token router (slot ``router``) and the load-balancing auxiliary loss.

``softmax_topk`` (reference, the Qwen3 router): logits = x W^T, softmax in fp32
over experts, keep the top-k; with ``norm_topk_prob`` the kept weights are
renormalized to sum to one. Weights are returned in the activation dtype.
``sigmoid_bias`` (DeepSeek-V3's aux-loss-free router) lives in ``sigmoid_bias.py``.
``topk_softmax`` (gpt-oss): logits = x W^T + b, keep the top-k logits, softmax over those k
(the weights sum to one; ``norm_topk_prob`` is moot); the balance loss reads the softmax over
all experts, as Hugging Face's does.

Every router: ``router(x_TH, idx_TK=None) -> Routing``; given ``idx_TK`` (routing replay) it
skips the selection and weights the given experts with its current probabilities.
``build_router(name, arch)`` constructs the configured one from an architecture (the
group-limited options ``n_group``, ``topk_group``, ``routed_scaling_factor`` are read from
the arch when it has them, as DeepSeek-V3's HF config does).

Legend: T tokens, H hidden, E experts, K experts per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from bumblebee.errors import ConfigError
from bumblebee.registry import register


@dataclass
class Routing:
    probs_TE: torch.Tensor  # fp32 softmax over all experts (for the aux loss)
    idx_TK: torch.Tensor  # chosen experts
    weight_TK: torch.Tensor  # combine weights, activation dtype


@register(
    "router", "softmax_topk", reference=True, summary="softmax over experts, top-k, optional renorm"
)
class SoftmaxTopKRouter(nn.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int, norm_topk_prob: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob

    def forward(self, x_TH: torch.Tensor, idx_TK: torch.Tensor | None = None) -> Routing:
        """``idx_TK`` given (routing replay): those experts, weighted by the current probabilities."""
        logits_TE = F.linear(x_TH, self.weight)
        probs_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float32)
        if idx_TK is None:
            top_w, top_i = torch.topk(probs_TE, self.top_k, dim=-1)
        else:
            top_i = idx_TK
            top_w = probs_TE.gather(1, top_i)
        if self.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        return Routing(probs_TE, top_i, top_w.to(logits_TE.dtype))


@register("router", "topk_softmax", summary="biased logits, top-k, softmax over the k (gpt-oss)")
class TopKSoftmaxRouter(nn.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int, norm_topk_prob: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.bias = nn.Parameter(torch.empty(num_experts))
        self.top_k = top_k

    def forward(self, x_TH: torch.Tensor, idx_TK: torch.Tensor | None = None) -> Routing:
        logits_TE = F.linear(x_TH, self.weight, self.bias)
        if idx_TK is None:
            top_l, top_i = torch.topk(logits_TE, self.top_k, dim=-1)
        else:
            top_i = idx_TK
            top_l = logits_TE.gather(1, top_i)
        top_w = torch.softmax(top_l, dim=-1, dtype=torch.float32)
        probs_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float32)
        return Routing(probs_TE, top_i, top_w.to(logits_TE.dtype))


ROUTER_OPTIONS = {
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
}  # name -> "off" value


def build_router(name: str, arch) -> nn.Module:
    """The router ``name`` (slot ``router``) for ``arch``: hidden size, experts, top-k,
    ``norm_topk_prob``, and the group-limited options where the arch defines them."""
    from bumblebee import registry

    factory = registry.get("router", name).factory
    options = {k: getattr(arch, k) for k in ROUTER_OPTIONS if hasattr(arch, k)}
    if factory in (SoftmaxTopKRouter, TopKSoftmaxRouter):
        used = {k: v for k, v in options.items() if v != ROUTER_OPTIONS[k]}
        if used:
            raise ConfigError(
                f"router {name!r} has no group-limited routing or scaling "
                f"({', '.join(f'{k}={v}' for k, v in used.items())}); use router = 'sigmoid_bias'"
            )
        options = {}
    return factory(
        arch.hidden_size, arch.num_experts, arch.num_experts_per_tok, arch.norm_topk_prob, **options
    )


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
