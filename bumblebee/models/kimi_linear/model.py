"""Kimi Linear composed from primitives (HF ``KimiLinearForCausalLM``).

Decoder layer i: x + Mixer(RMSNorm(x)), then h + MLP(RMSNorm(h)), where

- the mixer (``arch.layer_types[i]``) is Kimi Delta Attention
  (``primitives/linear_attention/kda.py``: the gated delta rule with a per-channel decay, its core
  the ``linear_attention`` slot, context parallelism by Gated DeltaNet's carried-state scan) or
  DeepSeek's Multi-head Latent Attention without RoPE (``use_rope=False``: the decoupled key
  dims are kept, unrotated; softmax scale (Dn + R)^-0.5);
- the MLP (``arch.mlp_layer_types[i]``) is a dense SwiGLU or DeepSeek-V3's routed experts with
  the sigmoid-bias router and ungated shared experts (the shared MoE block with DeepSeek-V3's ``MOE_TRAITS``).

Both mixers sit at ``self_attn`` and both MLPs at ``mlp``, as in HF's modules; checkpoints store
the MLPs under ``block_sparse_moe`` with experts' ``w1`` / ``w3`` / ``w2`` (``names.py``).
No multi-token prediction.
"""

from __future__ import annotations

from torch import nn

from bumblebee import registry
from bumblebee.models.base import CausalLM, LayerParts
from bumblebee.models.blocks import DecoderLayer, feed_forward
from bumblebee.models.deepseek_v3.model import MOE_TRAITS, mla_args
from bumblebee.models.kimi_linear.arch import LINEAR
from bumblebee.primitives.attention.mla import MultiHeadLatentAttention
from bumblebee.primitives.linear_attention.kda import KimiDeltaAttention
from bumblebee.primitives.norms import RMSNorm

# HF's KimiLinearAttention builds its latent RMSNorms with the norm's default eps, not
# rms_norm_eps (1e-5): a 1e-4 relative gradient difference if taken from the config
LATENT_NORM_EPS = 1e-6


class KimiLinearForCausalLM(CausalLM):
    """Kimi Linear: the shared causal LM (models/base.py) over the shared pre-norm layer with a
    KDA or MLA mixer and DeepSeek-V3's MLPs."""

    family = "kimi_linear"
    norm_cls = RMSNorm

    def make_layer(self, index: int, parts: LayerParts) -> nn.Module:
        a, kind = self.arch, self.arch.layer_types[index]
        if kind == LINEAR:
            mixer = KimiDeltaAttention(
                a.hidden_size,
                a.linear_num_heads,
                a.linear_head_dim,
                a.linear_conv_kernel_dim,
                a.rms_norm_eps,
                registry.get("linear_attention", parts.prims.linear_attention).factory,
                parts.recompute,
                cp_carry=parts.prims.linear_attention_cp,
            )
        else:
            args = dict(mla_args(a, parts, eps=LATENT_NORM_EPS), rope_interleave=False)
            mixer = MultiHeadLatentAttention(
                a.hidden_size, a.num_attention_heads, use_rope=False, **args
            )
        mlp = feed_forward(a, index, parts, **MOE_TRAITS)
        # the mixer's input and output stay alive through the MLP, as this layer always kept them
        return DecoderLayer(a, parts, mixer, mlp, layer_type=kind, keep_mixer_io=True)

    def rotary_dim(self) -> int:
        return self.arch.qk_rope_head_dim  # tables built by the shared code, read by no layer

    def init_vectors(self, std: float) -> dict:
        """Ones for the RMSNorm weights, then each KDA layer's own rules (A_log, dt_bias, norm)."""
        rules = super().init_vectors(std)
        for mn, m in self.named_modules():
            if isinstance(m, KimiDeltaAttention):
                rules.update({f"{mn}.{pn}": fill for pn, fill in m.init_rules(std).items()})
        return rules
