"""Materialized cross-entropy (slot ``loss``, implementation ``ce``, the reference).

``logits = hidden @ weight^T`` is built in full ([T, V], upcast to fp32), then
the usual log-softmax cross-entropy. Obviously correct and the baseline for the
fused ``linear_ce``; its [T, V] fp32 temporaries are exactly what long-context
runs cannot afford (local tokens x vocab x 4 bytes: 65 GB at 64K tokens and a 248K vocabulary).

Legend: T tokens, H hidden, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bumblebee.registry import register

REDUCTIONS = ("mean", "sum", "none")


def check_loss_args(hidden_TH, weight_VH, labels_T, reduction, temperature):
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if hidden_TH.dim() != 2 or weight_VH.dim() != 2 or hidden_TH.shape[1] != weight_VH.shape[1]:
        raise ValueError(f"expected hidden [T, H] and weight [V, H], got {tuple(hidden_TH.shape)} "
                         f"and {tuple(weight_VH.shape)}")
    if labels_T.shape != hidden_TH.shape[:1]:
        raise ValueError(f"labels must be [T] = [{hidden_TH.shape[0]}], got {tuple(labels_T.shape)}")


def reduce_loss(loss_T: torch.Tensor, valid_T: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "none":
        return loss_T
    total = loss_T.sum()
    if reduction == "sum":
        return total
    return total / valid_T.sum().clamp(min=1)


@register("loss", "ce", reference=True, summary="materialized fp32 logits + cross-entropy")
def cross_entropy(hidden_TH, weight_VH, labels_T, *, ignore_index: int = -100, reduction: str = "mean",
                  with_entropy: bool = False, temperature: float = 1.0, vocab_group=None):
    """Returns the reduced loss, or (loss, entropy_T) with ``with_entropy``. Per-token
    loss (``reduction="none"``) is -log p(label) at valid positions and 0 elsewhere."""
    check_loss_args(hidden_TH, weight_VH, labels_T, reduction, temperature)
    if vocab_group is not None:
        raise NotImplementedError("the ce reference does not shard the vocabulary; use loss = 'linear_ce'")
    logits_TV = F.linear(hidden_TH, weight_VH).float()
    if temperature != 1.0:
        logits_TV = logits_TV / temperature
    valid_T = labels_T != ignore_index
    logp_TV = torch.log_softmax(logits_TV, dim=-1)
    target_T = torch.where(valid_T, labels_T, 0)
    loss_T = -logp_TV.gather(1, target_T[:, None]).squeeze(1) * valid_T
    loss = reduce_loss(loss_T, valid_T, reduction)
    if not with_entropy:
        return loss
    entropy_T = -(logp_TV.exp() * logp_TV).sum(-1)
    return loss, entropy_T
