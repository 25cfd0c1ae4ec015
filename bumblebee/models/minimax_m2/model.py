"""MiniMax-M2 / M2.1 (HF ``minimax_m2``) composed from primitives.

Decoder layer: x + Attn(RMSNorm(x)), then h + MoE(RMSNorm(h)) in every layer, with

- Attn: GQA whose q and k RMSNorms each span *all heads of a token*: the norm of q runs over
  the q projection's whole [N x D] output (and of k over [K x D]), not per head, then partial
  RoPE (the first ``head_dim x partial_rotary_factor`` dims of each head, HF's half-split
  layout); its core is the ``attention`` slot (the ``cp`` slot when the sequence is split).
  The norm is per token, so CP and EP leave it alone: every rank holds every head of its
  tokens. Split heads (tensor parallelism) would need the sum of squares over the ranks
  holding a token's heads: ``Attention`` refuses a q/k projection narrower than all heads
  instead of normalizing a part of them;
- MoE: routed experts over the ``sigmoid_bias`` router (sigmoid scores, selection-only
  ``e_score_correction_bias``, top-k, the kept scores renormalized), DeepSeek-V3's block
  without shared experts.

Checkpoint names (``names.py``): Mixtral's ``block_sparse_moe.experts.{e}.{w1, w3, w2}`` for
gate / up / down, the router as ``block_sparse_moe.gate`` and its bias on the block.
"""

from __future__ import annotations

from torch import nn

from bumblebee.models.base import CausalLM, LayerParts
from bumblebee.models.blocks import Attention, DecoderLayer, feed_forward
from bumblebee.models.deepseek_v3.model import MOE_TRAITS, ROUTER
from bumblebee.primitives.norms import RMSNorm

__all__ = ["ROUTER", "MiniMaxM2ForCausalLM"]


class MiniMaxM2ForCausalLM(CausalLM):
    """MiniMax-M2: the shared causal LM (models/base.py) over the shared pre-norm layer with
    all-heads q/k norms (HF ``MiniMaxM2Attention``) and DeepSeek-V3's MoE without shared experts."""

    family = "minimax_m2"
    norm_cls = RMSNorm

    def make_layer(self, index: int, parts: LayerParts) -> nn.Module:
        a = self.arch
        attention = Attention(a, parts.attend, parts.recompute, qk_norm="all")
        return DecoderLayer(a, parts, attention, feed_forward(a, index, parts, **MOE_TRAITS))

    def rotary_dim(self) -> int:
        return self.arch.rotary_dim
