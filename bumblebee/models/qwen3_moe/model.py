"""Qwen3-MoE composed from primitives.

Decoder layer: x + Attn(RMSNorm(x)), then h + MoE(RMSNorm(h)) (or a dense SwiGLU
MLP on the layers the HF config marks dense). Attention is GQA with per-head
q/k RMSNorm and RoPE on per-document positions; its core, the router, the
expert FFN, the token dispatch, the loss and the recompute policy are the
configured primitives. Module and parameter names follow Hugging Face so that
checkpoints map one to one (experts are stacked, see ``models/hf.py``).
"""

from __future__ import annotations

from torch import nn

from bumblebee.models.base import CausalLM, LayerParts
from bumblebee.models.blocks import Attention, DecoderLayer, feed_forward
from bumblebee.primitives.norms import RMSNorm


class Qwen3MoeForCausalLM(CausalLM):
    """Qwen3-MoE: the shared causal LM (models/base.py) over the shared pre-norm layer."""

    family = "qwen3_moe"
    norm_cls = RMSNorm

    def make_layer(self, index: int, parts: LayerParts) -> nn.Module:
        a = self.arch
        attention = Attention(a, parts.attend, parts.recompute)
        return DecoderLayer(a, parts, attention, feed_forward(a, index, parts))
