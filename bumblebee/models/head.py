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

from torch import nn


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


def summed_losses(hidden_list, weight_VH, labels_list, loss_fn):
    """One summed token loss per (hidden [T, H], labels [T]) pair, all with one head weight."""
    return [loss_fn(h_TH, weight_VH, labels_T, reduction="sum") for h_TH, labels_T in zip(hidden_list, labels_list)]
