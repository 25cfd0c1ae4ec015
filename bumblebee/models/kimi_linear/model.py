"""Kimi Linear composed from primitives (HF ``KimiLinearForCausalLM``).

Decoder layer i: x + Mixer(RMSNorm(x)), then h + MLP(RMSNorm(h)), where

- the mixer (``arch.layer_types[i]``) is Kimi Delta Attention
  (``primitives/linear_attention/kda.py``: the gated delta rule with a per-channel decay, its core
  the ``linear_attention`` slot, context parallelism by Gated DeltaNet's carried-state scan) or
  DeepSeek's Multi-head Latent Attention without RoPE (``use_rope=False``: the decoupled key
  dims are kept, unrotated; softmax scale (Dn + R)^-0.5);
- the MLP (``arch.mlp_layer_types[i]``) is a dense SwiGLU or DeepSeek-V3's routed experts with
  the sigmoid-bias router and ungated shared experts (``deepseek_v3/model.py``'s block).

Both mixers sit at ``self_attn`` and both MLPs at ``mlp``, as in HF's modules; checkpoints store
the MLPs under ``block_sparse_moe`` with experts' ``w1`` / ``w3`` / ``w2`` (``names.py``).
No multi-token prediction.
"""

from __future__ import annotations

import torch
from torch import nn

from bumblebee import registry
from bumblebee.models.base import CausalLM, LayerParts
from bumblebee.models.blocks import MLP
from bumblebee.models.deepseek_v3.model import DeepseekMoE, mla_scale
from bumblebee.models.kimi_linear.arch import LINEAR, KimiLinearArch
from bumblebee.primitives.attention.mla import MultiHeadLatentAttention
from bumblebee.primitives.linear_attention.kda import KimiDeltaAttention
from bumblebee.primitives.norms import RMSNorm
from bumblebee.primitives.packed import DocLayout

# HF's KimiLinearAttention builds its latent RMSNorms with the norm's default eps, not
# rms_norm_eps (1e-5): a 1e-4 relative gradient difference if taken from the config
LATENT_NORM_EPS = 1e-6


class DecoderLayer(nn.Module):
    def __init__(self, arch: KimiLinearArch, idx: int, parts: LayerParts, linear_core):
        super().__init__()
        self.recompute = rc = parts.recompute
        self.linear = arch.layer_types[idx] == LINEAR
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        if self.linear:
            self.self_attn = KimiDeltaAttention(
                arch.hidden_size,
                arch.linear_num_heads,
                arch.linear_head_dim,
                arch.linear_conv_kernel_dim,
                arch.rms_norm_eps,
                linear_core,
                rc,
                cp_carry=parts.prims.linear_attention_cp,
            )
        else:
            self.self_attn = MultiHeadLatentAttention(
                arch.hidden_size,
                arch.num_attention_heads,
                q_lora_rank=arch.q_lora_rank,
                kv_lora_rank=arch.kv_lora_rank,
                qk_nope_head_dim=arch.qk_nope_head_dim,
                qk_rope_head_dim=arch.qk_rope_head_dim,
                v_head_dim=arch.v_head_dim,
                eps=LATENT_NORM_EPS,
                scale=mla_scale(arch),
                rope_interleave=False,
                attend=parts.attend,
                recompute=rc,
                cp_latents=parts.prims.cp_attention
                if parts.groups.cp_size > 1 and parts.prims.cp_attention in ("allgather", "ring")
                else "",
                use_rope=False,
            )
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.is_moe = arch.is_moe_layer(idx)
        self.mlp = (
            DeepseekMoE(arch, parts)
            if self.is_moe
            else MLP(arch.hidden_size, arch.intermediate_size)
        )

    def forward(self, x_BTD, cos, sin, layout: DocLayout):
        rc = self.recompute
        h_in = rc.module("norm", self.input_layernorm, x_BTD)
        if self.linear:
            mixed, _state = self.self_attn(h_in, layout)
        else:
            mixed = self.self_attn(h_in, cos, sin, layout)
        h = x_BTD + mixed
        y_in = rc.module("norm", self.post_attention_layernorm, h)
        if self.is_moe:
            y, aux = self.mlp(y_in)
        else:
            y, aux = rc.module("mlp", self.mlp, y_in), h.new_zeros((), dtype=torch.float32)
        return h + y, aux


class KimiLinearForCausalLM(CausalLM):
    """Kimi Linear: the shared causal LM (models/base.py) over KDA / MLA + MoE decoder layers."""

    family = "kimi_linear"
    norm_cls = RMSNorm

    def make_layer(self, index: int, parts: LayerParts) -> nn.Module:
        linear_core = registry.get("linear_attention", parts.prims.linear_attention).factory
        return DecoderLayer(self.arch, index, parts, linear_core)

    def rotary_dim(self) -> int:
        return self.arch.qk_rope_head_dim  # tables built by the shared code, read by no layer

    def init_vectors(self, std: float) -> dict:
        """Ones for the RMSNorm weights, then each KDA layer's own rules (A_log, dt_bias, norm)."""
        rules = super().init_vectors(std)
        for mn, m in self.named_modules():
            if isinstance(m, KimiDeltaAttention):
                rules.update({f"{mn}.{pn}": fill for pn, fill in m.init_rules(std).items()})
        return rules
