"""Expert capacity with token dropping (``moe.capacity_factor``; off by default).

Each expert takes at most ``C = ceil(capacity_factor * T * K / E)`` of the (token, choice)
pairs routed to it from the T local tokens of one forward (per rank: with expert parallelism
every rank applies the limit to its own tokens before the dispatch, the usual local
capacity). Pairs are served in token order (the first C pairs of an expert, in the flattened
(token, choice) order, are kept). A dropped pair is marked with the id ``E``: the dispatchers
(``local``, ``alltoall``, ``chunked``; ``permute(..., drops=True)``) cut those rows before
the expert GEMMs and the exchanges, and put zeros back in their place, so the pair adds
nothing to the MoE output and the token keeps only its residual (plus its other, kept,
choices). Its combine weight gets a zero gradient; the router still sees the pair in its
balance statistics and its expert load (what the router asked for).

Legend: T tokens, K choices per token, E experts, N = T*K pairs.
"""

from __future__ import annotations

import math

import torch


def capacity(capacity_factor: float, tokens: int, top_k: int, num_experts: int) -> int:
    return math.ceil(capacity_factor * tokens * top_k / num_experts)


def drop_over_capacity(idx_TK: torch.Tensor, num_experts: int, capacity_factor: float):
    """(ids with the dropped pairs set to ``num_experts``, number of dropped pairs)."""
    T, K = idx_TK.shape
    cap = capacity(capacity_factor, T, K, num_experts)
    flat_N = idx_TK.flatten()
    order_N = torch.argsort(flat_N, stable=True)  # by expert, token order within an expert
    counts_E = torch.bincount(flat_N, minlength=num_experts)
    starts_E = torch.cumsum(counts_E, 0) - counts_E
    rank_N = torch.arange(flat_N.numel(), device=flat_N.device) - starts_E[flat_N[order_N]]
    keep_N = torch.empty_like(rank_N, dtype=torch.bool).scatter_(0, order_N, rank_N < cap)
    dropped = flat_N.numel() - keep_N.sum()
    return torch.where(keep_N, flat_N, num_experts).view(T, K), dropped
