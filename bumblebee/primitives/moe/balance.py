"""Router statistics of one forward and the load-balancing losses built from them.

Every MoE layer returns one stats vector per forward (``router_stats``), fp32 [2E + 2]:
``[counts_E | prob_sum_E | T | dropped]`` with counts_E the top-k assignments per expert (no
gradient), prob_sum_E the router probabilities summed over the T local tokens (carries
the gradient to the router and everything below it), and the (token, choice) pairs a capacity
limit dropped (primitives/moe/capacity.py; 0 without). The model stacks them per MoE layer
(``stats_LS``, S = 2E + 2). A balance loss is then a function of these sums, which is what
makes the three definitions below cheap to switch and the global one exact:

``micro_batch`` (Switch Transformer, Fedus et al. 2021, eq. 4-6, per layer, mean over layers):
    (1/L) sum_l E sum_e (c_le / T) (p_le / T), over one micro-batch (the whole sequence with CP:
    the sums are reduced over the cp group, the probability sum differentiably).
``hf`` (``transformers``' ``load_balancing_loss_func``, which ``Qwen3MoeForCausalLM`` returns as
    ``aux_loss``): the sums are pooled over layers first, E sum_e (C_e / LT) (P_e / LT) with
    C = sum_l c_l, P = sum_l p_l, per micro-batch (cp-reduced as above).
``step`` (global-batch balancing, Qiu et al. 2025, "Demons in the Detail: On Implementing
    Load Balancing Loss for Training Specialized Mixture-of-Expert Models"): the expert
    frequencies c_le / T of each layer are taken over the *whole optimizer step* (the global
    batch: all micro-batches, all dp and cp ranks) before they multiply the probabilities; the loss is
    (1/L) sum_l E sum_e (C^G_le / T^G) (P^G_le / T^G). Given the global counts, it is linear in
    each micro-batch's probability sums, so every micro-batch contributes its exact share
    ``step_loss_share`` and the total is independent of layout and micro-batching
    (runtime/step.py gathers the counts once per step, before the first backward).

Legend: T tokens, E experts, K choices per token, L MoE layers, S = 2E + 2.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

MODES = ("step", "micro_batch", "hf")


def router_stats(probs_TE: torch.Tensor, idx_TK: torch.Tensor, dropped=0) -> torch.Tensor:
    """[counts_E | prob_sum_E | T | dropped] of one layer's forward (fp32; only prob_sum has a
    gradient). ``idx_TK``: the router's choices (before any capacity drop)."""
    T, E = probs_TE.shape
    counts_E = torch.zeros(E, device=probs_TE.device, dtype=torch.float32)
    counts_E.scatter_add_(0, idx_TK.flatten(), torch.ones(idx_TK.numel(), device=probs_TE.device))
    tail = torch.stack(
        [
            counts_E.new_tensor(float(T)),
            torch.as_tensor(dropped, dtype=torch.float32, device=counts_E.device),
        ]
    )
    return torch.cat([counts_E, probs_TE.float().sum(dim=0), tail])


def split_stats(stats_LS: torch.Tensor):
    """(counts_LE, prob_sum_LE, tokens_L) views of stacked stats."""
    E = (stats_LS.shape[-1] - 2) // 2
    return stats_LS[..., :E], stats_LS[..., E : 2 * E], stats_LS[..., 2 * E]


def dropped_pairs(stats_LS: torch.Tensor) -> torch.Tensor:
    """(token, choice) pairs dropped by capacity, summed over the layers of stacked stats."""
    return stats_LS[..., -1].sum()


def _cp_reduce(stats_LS: torch.Tensor, cp_group):
    """Counts and tokens summed over the cp group, probability sums through a differentiable
    all-reduce (each rank's tokens get their exact gradient once the identical per-rank losses
    are weighted by 1 / cp)."""
    counts, probs, tokens = split_stats(stats_LS)
    if cp_group is None:
        return counts, probs, tokens
    from bumblebee.primitives.parallel import AllReduceSum

    fixed = torch.cat([counts, tokens[:, None]], dim=1).detach().clone()
    dist.all_reduce(fixed, group=cp_group)
    return fixed[:, :-1], AllReduceSum.apply(probs, cp_group), fixed[:, -1]


def micro_batch_loss(stats_LS: torch.Tensor, num_layers: int, cp_group=None) -> torch.Tensor:
    """Per-layer Switch loss of this micro-batch, summed over the given layers / ``num_layers``
    (the model's MoE layer count: a pipeline stage holds some of them)."""
    counts, probs, tokens = _cp_reduce(stats_LS, cp_group)
    E = counts.shape[-1]
    aux = stats_LS.new_zeros(())
    for c, p, t in zip(counts, probs, tokens):
        aux = aux + E * torch.sum(c / t * p / t)
    return aux / num_layers


def hf_loss(stats_LS: torch.Tensor, cp_group=None) -> torch.Tensor:
    """``transformers``' definition: counts and probabilities pooled over layers, then the product."""
    counts, probs, tokens = _cp_reduce(stats_LS, cp_group)
    E, rows = counts.shape[-1], tokens.sum()
    return E * torch.sum(counts.sum(0) / rows * (probs.sum(0) / rows))


def step_loss_share(stats_LS: torch.Tensor, global_LS: torch.Tensor) -> torch.Tensor:
    """This micro-batch's share of the step balance loss: (1/L) sum_l E <C^G_l / T^G, p_l> / T^G
    with ``global_LS`` the stats summed over the global batch (detached). Summed over every
    micro-batch of every dp / cp rank it is ``step_loss(global_LS)``."""
    _, probs, _ = split_stats(stats_LS)
    g_counts, _, g_tokens = split_stats(global_LS.detach())
    E, L = probs.shape[-1], probs.shape[0]
    freq_LE = g_counts / g_tokens[:, None]
    return E * torch.sum(freq_LE * probs / g_tokens[:, None]) / L


def step_loss(global_LS: torch.Tensor) -> torch.Tensor:
    """The step balance loss itself (for logging), from the globally summed stats."""
    counts, probs, tokens = split_stats(global_LS.detach())
    E = counts.shape[-1]
    return E * torch.sum(counts / tokens[:, None] * probs / tokens[:, None]) / counts.shape[0]


def load_summary(counts_LE: torch.Tensor) -> dict[str, float]:
    """Expert-load figures of a step (counts over the global batch): the worst layer's
    max / mean load and coefficient of variation (std / mean), and which layer that is."""
    counts_LE = counts_LE.detach().float()
    mean_L = counts_LE.mean(dim=1).clamp(min=1e-9)
    max_over_mean_L = counts_LE.max(dim=1).values / mean_L
    cv_L = counts_LE.std(dim=1, unbiased=False) / mean_L
    worst = int(max_over_mean_L.argmax())
    return {
        "expert_load_max_over_mean": float(max_over_mean_L[worst]),
        "expert_load_cv": float(cv_L.max()),
        "expert_load_worst_layer": worst,
    }
