"""Materialized cross-entropy (slot ``loss``, implementation ``ce``, the reference).

``logits = hidden @ weight^T`` is built in full ([T, V], upcast to fp32), then
the usual log-softmax cross-entropy. The baseline for the fused ``linear_ce``; its
[T, V] temporaries are exactly what long-context runs cannot afford (local tokens x
vocab x 4 bytes: 65 GB at 64K tokens and a 248K vocabulary).

Memory, as Megatron's vocab-parallel cross-entropy keeps it: the [T, V] logits in the
compute dtype and ONE fp32 working copy, which becomes the softmax in place in forward
(saved) and the logits gradient ``p - onehot(label)`` in place in backward
(``_SoftmaxCE``): 6 B per logit at the peak in bf16, not the 10-16 B of autograd's
log-softmax (its output, the gather's zero gradient, log-softmax's backward). With
``with_entropy`` (RL, short sequences) it runs the plain autograd formula.

Legend: T tokens, H hidden, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bumblebee.primitives.loss.costs import LossCosts
from bumblebee.registry import register

REDUCTIONS = ("mean", "sum", "none")


def check_loss_args(hidden_TH, weight_VH, labels_T, reduction, temperature):
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if hidden_TH.dim() != 2 or weight_VH.dim() != 2 or hidden_TH.shape[1] != weight_VH.shape[1]:
        raise ValueError(
            f"expected hidden [T, H] and weight [V, H], got {tuple(hidden_TH.shape)} "
            f"and {tuple(weight_VH.shape)}"
        )
    if labels_T.shape != hidden_TH.shape[:1]:
        raise ValueError(
            f"labels must be [T] = [{hidden_TH.shape[0]}], got {tuple(labels_T.shape)}"
        )


def reduce_loss(loss_T: torch.Tensor, valid_T: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "none":
        return loss_T
    total = loss_T.sum()
    if reduction == "sum":
        return total
    return total / valid_T.sum().clamp(min=1)


# kept for backward: the fp32 log-probabilities; while it runs: bf16 logits + one fp32 working
# copy that softmax and its gradient reuse in place
COSTS = LossCosts(
    kept_per_token=0,
    kept_per_logit=4,
    work_per_logit=2 + 4,
    work_per_hidden=0,
    head_grad_per_weight=0,
    workspace=0,
    tiled_head=False,
    explain="{t} x {v:.0f} x (2+4) B (bf16 logits + fp32 working copy) + {t} x {norm:.0f} B "
    "(final norm)",
    explain_eval="[t, V] bf16 logits + fp32 copy",
)


@register(
    "loss", "ce", reference=True, summary="materialized fp32 logits + cross-entropy", costs=COSTS
)
def cross_entropy(
    hidden_TH,
    weight_VH,
    labels_T,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    with_entropy: bool = False,
    temperature: float = 1.0,
    vocab_group=None,
):
    """Returns the reduced loss, or (loss, entropy_T) with ``with_entropy``. Per-token
    loss (``reduction="none"``) is -log p(label) at valid positions and 0 elsewhere."""
    check_loss_args(hidden_TH, weight_VH, labels_T, reduction, temperature)
    if vocab_group is not None:
        raise NotImplementedError(
            "the ce reference does not shard the vocabulary; use loss = 'linear_ce'"
        )
    valid_T = labels_T != ignore_index
    target_T = torch.where(valid_T, labels_T, 0)
    if not with_entropy:
        loss_T = _SoftmaxCE.apply(F.linear(hidden_TH, weight_VH), target_T, valid_T, temperature)
        return reduce_loss(loss_T, valid_T, reduction)
    logits_TV = F.linear(hidden_TH, weight_VH).float()
    if temperature != 1.0:
        logits_TV = logits_TV / temperature
    logp_TV = torch.log_softmax(logits_TV, dim=-1)
    loss_T = -logp_TV.gather(1, target_T[:, None]).squeeze(1) * valid_T
    loss = reduce_loss(loss_T, valid_T, reduction)
    entropy_T = -(logp_TV.exp() * logp_TV).sum(-1)
    return loss, entropy_T


class _SoftmaxCE(torch.autograd.Function):
    """Per-token -log softmax(z / temperature)[label] (0 where not valid) from logits z [T, V];
    one fp32 [T, V] buffer: softmax in place (saved), its gradient in place in backward."""

    @staticmethod
    def forward(ctx, logits_TV, target_T, valid_T, temperature: float):
        p_TV = logits_TV.to(torch.promote_types(logits_TV.dtype, torch.float32), copy=True)
        if temperature != 1.0:
            p_TV.div_(temperature)
        max_T1 = p_TV.amax(dim=-1, keepdim=True)
        p_TV.sub_(max_T1)
        target_logit_T = p_TV.gather(1, target_T[:, None]).squeeze(1)  # z_label - max
        p_TV.exp_()
        sum_T1 = p_TV.sum(dim=-1, keepdim=True)
        p_TV.div_(sum_T1)  # softmax
        loss_T = (sum_T1.squeeze(1).log() - target_logit_T) * valid_T
        ctx.save_for_backward(p_TV, target_T, valid_T)
        ctx.temperature, ctx.dtype, ctx.used = temperature, logits_TV.dtype, False
        return loss_T

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_T):
        if ctx.used:  # the saved softmax became the gradient in place
            raise RuntimeError(
                "ce: backward ran twice through the same graph (retain_graph); the loss keeps "
                "one fp32 [T, V] buffer and reuses it for the gradient"
            )
        ctx.used = True
        p_TV, target_T, valid_T = ctx.saved_tensors
        p_TV.scatter_add_(
            1, target_T[:, None], torch.full_like(target_T[:, None], -1.0, dtype=p_TV.dtype)
        )
        p_TV.mul_((grad_T.to(p_TV.dtype) * valid_T / ctx.temperature)[:, None])  # d loss / d logits
        return p_TV.to(ctx.dtype), None, None, None
