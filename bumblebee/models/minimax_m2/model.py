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

Legend: B batch, T tokens, H hidden, N query heads, K kv heads, D head dim.
"""

from __future__ import annotations

from torch import nn

from bumblebee.errors import ConfigError
from bumblebee.models.base import CausalLM, LayerParts
from bumblebee.models.deepseek_v3.model import ROUTER, DeepseekMoE
from bumblebee.models.minimax_m2.arch import MiniMaxM2Arch
from bumblebee.primitives.norms import RMSNorm
from bumblebee.primitives.packed import DocLayout
from bumblebee.primitives.rope import apply_rope

__all__ = ["ROUTER", "MiniMaxM2ForCausalLM"]


class Attention(nn.Module):
    """HF ``MiniMaxM2Attention``."""

    def __init__(self, arch: MiniMaxM2Arch, attend, recompute):
        super().__init__()
        h, d = arch.hidden_size, arch.head_dim
        self.n_heads, self.n_kv, self.head_dim = (
            arch.num_attention_heads,
            arch.num_key_value_heads,
            d,
        )
        self.q_proj = nn.Linear(h, self.n_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.n_kv * d, bias=False)
        self.v_proj = nn.Linear(h, self.n_kv * d, bias=False)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=False)
        self.q_norm = RMSNorm(self.n_heads * d, arch.rms_norm_eps)
        self.k_norm = RMSNorm(self.n_kv * d, arch.rms_norm_eps)
        self.attend, self.recompute = attend, recompute

    def forward(self, x_BTH, cos, sin, layout: DocLayout):
        B, T, _ = x_BTH.shape
        q_BTX, k_BTX = self.q_proj(x_BTH), self.k_proj(x_BTH)
        if (q_BTX.shape[-1], k_BTX.shape[-1]) != (
            self.n_heads * self.head_dim,
            self.n_kv * self.head_dim,
        ):
            # a norm over a rank's part of the heads is another model, not an approximation
            raise ConfigError(
                "minimax_m2: the q/k norm spans all heads of a token; heads split over ranks "
                "(tensor parallelism) would need a cross-rank sum of squares, not implemented"
            )
        q = self.q_norm(q_BTX).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_norm(k_BTX).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x_BTH).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o_BNTD = self.recompute.module(
            "attn_core", self.attend, q, k, v, layout, self.head_dim**-0.5
        )
        return self.o_proj(o_BNTD.transpose(1, 2).reshape(B, T, -1))


class DecoderLayer(nn.Module):
    is_moe = True

    def __init__(self, arch: MiniMaxM2Arch, idx: int, parts: LayerParts):
        super().__init__()
        self.recompute = parts.recompute
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch, parts.attend, parts.recompute)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = DeepseekMoE(arch, parts)

    def forward(self, x_BTH, cos, sin, layout: DocLayout):
        rc = self.recompute
        h = x_BTH + self.self_attn(rc.module("norm", self.input_layernorm, x_BTH), cos, sin, layout)
        y, aux = self.mlp(rc.module("norm", self.post_attention_layernorm, h))
        return h + y, aux


class MiniMaxM2ForCausalLM(CausalLM):
    """MiniMax-M2: the shared causal LM (models/base.py) over this family's decoder layer."""

    family = "minimax_m2"
    norm_cls = RMSNorm

    def make_layer(self, index: int, parts: LayerParts) -> nn.Module:
        return DecoderLayer(self.arch, index, parts)

    def rotary_dim(self) -> int:
        return self.arch.rotary_dim
