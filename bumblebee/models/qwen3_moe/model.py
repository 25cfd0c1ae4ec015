"""Qwen3-MoE composed from primitives.

Decoder layer: x + Attn(RMSNorm(x)), then h + MoE(RMSNorm(h)) (or a dense SwiGLU
MLP on the layers the HF config marks dense). Attention is GQA with per-head
q/k RMSNorm and RoPE on per-document positions; its core, the router, the
expert FFN, the token dispatch, the loss and the recompute policy are the
configured primitives. Module and parameter names follow Hugging Face so that
checkpoints map one to one (experts are stacked, see ``models/hf.py``).

Legend: B batch, T tokens, H hidden, N query heads, K kv heads, D head dim,
V vocabulary, E experts.
"""

from __future__ import annotations

import torch
from torch import nn

from bumblebee.models.base import CausalLM, LayerParts
from bumblebee.models.blocks import MLP, Attention, MoE
from bumblebee.models.qwen3_moe.arch import Qwen3MoeArch
from bumblebee.primitives.norms import RMSNorm
from bumblebee.primitives.packed import DocLayout


class DecoderLayer(nn.Module):
    def __init__(self, arch: Qwen3MoeArch, idx: int, parts: LayerParts):
        super().__init__()
        self.recompute = parts.recompute
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch, parts.attend, parts.recompute)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.is_moe = arch.is_moe_layer(idx)
        self.mlp = (
            MoE(arch, parts.prims, parts.dispatch, parts.groups)
            if self.is_moe
            else MLP(arch.hidden_size, arch.intermediate_size)
        )

    def forward(self, x_BTH, cos, sin, layout: DocLayout):
        rc = self.recompute
        h = x_BTH + self.self_attn(rc.module("norm", self.input_layernorm, x_BTH), cos, sin, layout)
        y_in = rc.module("norm", self.post_attention_layernorm, h)
        if self.is_moe:
            y, aux = rc.module("moe", self.mlp, y_in)
        else:
            y, aux = rc.module("mlp", self.mlp, y_in), h.new_zeros((), dtype=torch.float32)
        return h + y, aux


class Qwen3MoeForCausalLM(CausalLM):
    """Qwen3-MoE: the shared causal LM (models/base.py) over this family's decoder layer."""

    family = "qwen3_moe"
    norm_cls = RMSNorm

    def make_layer(self, index: int, parts: LayerParts) -> nn.Module:
        return DecoderLayer(self.arch, index, parts)
