"""GLM-4.5 / 4.6 / 4.7 (HF ``glm4_moe``) composed from primitives.

Decoder layer i: x + Attn(RMSNorm(x)), then h + FFN(RMSNorm(h)) with

- Attn: GQA with q/k/v biases (``attention_bias``), per-head q/k RMSNorm when
  ``use_qk_norm`` (GLM-4.5 on, GLM-4.5-Air off) and partial RoPE (the first
  ``head_dim x partial_rotary_factor`` dims, HF's half-split layout); its core is the
  ``attention`` slot (the ``cp`` slot when the sequence is split: every head is whole on
  every rank, so CP needs nothing of this family);
- FFN: a dense SwiGLU on the first ``first_k_dense_replace`` layers, then DeepSeek-V3's MoE
  block (``deepseek_v3/model.py``: routed experts over the ``sigmoid_bias`` router with its
  correction bias and group-limited top-k, plus ungated shared experts).

Multi-token prediction: ``num_nextn_predict_layers`` modules (``models/mtp.py``), each a MoE
decoder layer of this family plus ``enorm``, ``hnorm``, ``eh_proj`` and ``shared_head.norm``,
stored as ``model.layers.{L + k}`` like DeepSeek-V3's (``transformers`` drops these tensors on
load; bumblebee trains and exports them).

Legend: B batch, T tokens, H hidden, N query heads, K kv heads, D head dim.
"""

from __future__ import annotations

import torch
from torch import nn

from bumblebee.models.base import CausalLM, LayerParts
from bumblebee.models.blocks import MLP
from bumblebee.models.deepseek_v3.model import ROUTER, DeepseekMoE, LayerMTP, mtp_layer_class
from bumblebee.models.glm4_moe.arch import Glm4MoeArch
from bumblebee.primitives.norms import RMSNorm
from bumblebee.primitives.packed import DocLayout
from bumblebee.primitives.rope import apply_rope

__all__ = ["ROUTER", "Glm4MoeForCausalLM"]


class Attention(nn.Module):
    """HF ``Glm4MoeAttention``."""

    def __init__(self, arch: Glm4MoeArch, attend, recompute):
        super().__init__()
        h, d, bias = arch.hidden_size, arch.head_dim, arch.attention_bias
        self.n_heads, self.n_kv, self.head_dim = (
            arch.num_attention_heads,
            arch.num_key_value_heads,
            d,
        )
        self.q_proj = nn.Linear(h, self.n_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.n_kv * d, bias=bias)
        self.v_proj = nn.Linear(h, self.n_kv * d, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=False)
        if arch.use_qk_norm:
            self.q_norm = RMSNorm(d, arch.rms_norm_eps)
            self.k_norm = RMSNorm(d, arch.rms_norm_eps)
        self.qk_norm = arch.use_qk_norm
        self.attend, self.recompute = attend, recompute

    def forward(self, x_BTH, cos, sin, layout: DocLayout):
        B, T, _ = x_BTH.shape
        q = self.q_proj(x_BTH).view(B, T, self.n_heads, self.head_dim)
        k = self.k_proj(x_BTH).view(B, T, self.n_kv, self.head_dim)
        v = self.v_proj(x_BTH).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin)
        o_BNTD = self.recompute.module(
            "attn_core", self.attend, q, k, v, layout, self.head_dim**-0.5
        )
        return self.o_proj(o_BNTD.transpose(1, 2).reshape(B, T, -1))


class DecoderLayer(nn.Module):
    def __init__(self, arch: Glm4MoeArch, idx: int, parts: LayerParts, moe: bool | None = None):
        super().__init__()
        self.recompute = parts.recompute
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch, parts.attend, parts.recompute)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.is_moe = arch.is_moe_layer(idx) if moe is None else moe
        self.mlp = (
            DeepseekMoE(arch, parts)
            if self.is_moe
            else MLP(arch.hidden_size, arch.intermediate_size)
        )

    def forward(self, x_BTH, cos, sin, layout: DocLayout):
        rc = self.recompute
        h = x_BTH + self.self_attn(rc.module("norm", self.input_layernorm, x_BTH), cos, sin, layout)
        y_in = rc.module("norm", self.post_attention_layernorm, h)
        if self.is_moe:
            y, aux = self.mlp(y_in)
        else:
            y, aux = rc.module("mlp", self.mlp, y_in), h.new_zeros((), dtype=torch.float32)
        return h + y, aux


class Glm4MoeForCausalLM(LayerMTP, CausalLM):
    """GLM-4.5: the shared causal LM (models/base.py) over GQA + DeepSeek-style MoE layers."""

    family = "glm4_moe"
    norm_cls = RMSNorm
    mtp_layer = mtp_layer_class(DecoderLayer)

    def make_layer(self, index: int, parts: LayerParts, moe: bool | None = None) -> nn.Module:
        return DecoderLayer(self.arch, index, parts, moe)

    def rotary_dim(self) -> int:
        return self.arch.rotary_dim

    def init_vectors(self, std: float) -> dict:
        """Ones for the norm weights, zeros for the q/k/v biases (HF's init)."""
        from bumblebee.primitives import init

        return {
            name: init.const(0.0 if name.endswith(".bias") else 1.0)
            for name, p in self.named_parameters()
            if p.dim() == 1
        }
