"""The LM head as a module whose forward *uses* its weight.

Linear cross-entropy (primitives/loss/linear_ce.py) reads the head weight itself instead of
calling a linear layer, and so do the RL engine's per-token log-probs. Read outside a module
forward, the weight can only belong to FSDP2's root unit, which keeps it gathered from the first
forward to the end of backward and holds its full-size gradient until the root reduces at the
very end of the step: two [V, H] tables (0.58 GiB each at Qwen3's vocabulary and hidden 1024 in
fp32) for the whole step. ``LMHead.forward(fn, hidden, ...)`` runs every such read inside the
head's own forward, so the head can be an FSDP2 unit of its own (``CausalLM.fsdp_units``).

Legend: T tokens, H hidden, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake


class LMHead(nn.Linear):
    """``lm_head.weight`` [V, H] (HF name kept) with a forward that applies any function of the
    hidden states and this weight: ``head(fn, hidden, *args, **kwargs) = fn(hidden, weight, *args,
    **kwargs)`` (the loss primitive, per-token log-probs, ``F.linear`` for logits). Linear
    cross-entropy reads the weight itself instead of calling a linear layer; doing that read
    inside this module's forward is what lets FSDP2 (its own unit, ``fsdp_units``) all-gather
    the weight just before the call, free it after, gather it again for the call's backward and
    reduce-scatter the full-size gradient as soon as that backward is done, instead of holding
    weight and gradient for the whole step as the root unit's parameters are."""

    def __init__(self, hidden_size: int, vocab_size: int):
        super().__init__(hidden_size, vocab_size, bias=False)

    def forward(self, fn, hidden, *args, **kwargs):
        return fn(hidden, self.weight, *args, **kwargs)


def summed_losses(hidden_list, weight_VH, labels_list, head_loss):
    """One summed token loss per (hidden [T, H], labels [T]) pair, all with one head weight."""
    return [
        head_loss(h_TH, weight_VH, labels_T, reduction="sum")
        for h_TH, labels_T in zip(hidden_list, labels_list)
    ]


def check_token_ids(ids, vocab_size: int, name: str = "input_ids") -> None:
    """The public entry points' one-line ``ValueError`` for ids the embedding cannot look up
    (an integer tensor with every id in [0, vocab_size)), instead of an IndexError deep inside.
    One min/max over the ids (a device sync on CUDA, once per call)."""
    if (
        not isinstance(ids, torch.Tensor)
        or ids.dtype.is_floating_point
        or ids.dtype.is_complex
        or ids.dtype == torch.bool
    ):
        raise ValueError(
            f"{name} must be an integer tensor of token ids, got "
            f"{ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__}"
        )
    if (
        ids.numel() and not is_fake(ids) and ids.device.type != "meta"
    ):  # (the planner's dry run: no values)
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(
                f"{name}: token id {lo if lo < 0 else hi} is outside the vocabulary "
                f"[0, {vocab_size}) (arch.vocab_size)"
            )


def check_forward_inputs(model, input_ids, position_ids=None, labels=None) -> None:
    """The public forward's arguments, checked before anything runs: ids [B, T] in the model's
    vocabulary, ``position_ids`` / ``labels`` integer tensors of the same shape (positions >= 0),
    and a model whose parameters have memory (not still on the meta device)."""
    check_token_ids(input_ids, model.arch.vocab_size)
    if input_ids.dim() != 2:
        raise ValueError(
            f"input_ids must be [batch, seq_len], got shape {tuple(input_ids.shape)}"
            + (" (add the batch dim: input_ids[None])" if input_ids.dim() == 1 else "")
        )
    for name, t in (("position_ids", position_ids), ("labels", labels)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or t.dtype.is_floating_point or t.dtype == torch.bool:
            what = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be an integer tensor, got {what}")
        if t.shape != input_ids.shape:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)}, expected {tuple(input_ids.shape)} "
                "(the shape of input_ids)"
            )
    if (
        position_ids is not None
        and position_ids.numel()
        and not is_fake(position_ids)
        and position_ids.device.type != "meta"
        and int(position_ids.min()) < 0
    ):
        raise ValueError("position_ids must be >= 0 (they restart at 0 per packed document)")
    p = next(model.parameters(), None)
    if p is not None and p.is_meta and input_ids.device.type != "meta" and not is_fake(input_ids):
        raise ValueError(
            "the model's parameters are on the meta device (built with device='meta'): give them "
            "memory first (bumblebee.models.materialize), or build it on a real device"
        )


@dataclass
class LossTerms:
    """What a training step needs from one micro-batch's forward."""

    loss_sum: torch.Tensor  # summed token losses over the valid labels of this micro-batch
    num_tokens: torch.Tensor  # number of valid labels (int64 scalar)
    aux_loss: torch.Tensor  # load-balancing loss of the asked definition (0 if none, or "step")
    router_stats: torch.Tensor | None = (
        None  # [L, 2E + 2] per MoE layer (primitives/moe/balance.py)
    )
    # multi-token prediction (models/mtp.py), already weighted into loss_sum: per-depth summed
    # token losses (detached, for logs) and valid-label counts; empty without MTP
    mtp_sums: list = field(default_factory=list)
    mtp_tokens: list = field(default_factory=list)


# FSDP2 gathers the root unit (final norm, tied embedding) again for each forward's backward
# through a hook on that forward's output tensors. Some torch versions (2.11) find them with
# pytree, which sees an unregistered dataclass as one opaque leaf: no hook, so the second of two
# forwards-then-backwards (the step-wide balance loss) reads the root's freed weights.
torch.export.register_dataclass(LossTerms, serialized_type_name="bumblebee.LossTerms")
