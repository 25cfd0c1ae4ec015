"""gpt-oss (HF ``gpt_oss``) composed from primitives.

Decoder layer i: x + Attn(RMSNorm(x)), then h + MoE(RMSNorm(h)) with

- Attn: GQA with q/k/v/o biases, YaRN RoPE over the whole head, and the attention core given
  the generic options (primitives/attention/options.py): this layer's sliding window
  (``layer_types[i] == "sliding_attention"``: ``sliding_window`` keys) and the layer's per-head
  sink logits ``sinks`` [N]. Every head is whole on every rank, so CP needs nothing of this family
  (the ring masks the window and merges the sinks itself);
- MoE: the ``topk_softmax`` router (biased logits, top-k, softmax over the k), experts with
  biases and the clamped ``(up + 1)`` SwiGLU (``experts.ClampedSwiGLU``), no shared expert.

Checkpoint names (models/hf_stored.py, the family's ``hf_stored``): the router is
``mlp.router`` (bumblebee's MoE block calls it ``mlp.gate``); the experts are stored fused,
transposed (``x @ W``) with gate and up columns interleaved: ``gate_up_proj`` [E, H, 2F],
``gate_up_proj_bias`` [E, 2F], ``down_proj`` [E, F, H], ``down_proj_bias`` [E, H].

Legend: B batch, T tokens, H hidden, N query heads, K kv heads, D head dim.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from bumblebee.models.base import CausalLM, LayerParts
from bumblebee.models.blocks import MoE
from bumblebee.models.gpt_oss.arch import GptOssArch
from bumblebee.primitives import init
from bumblebee.primitives.moe.experts import ClampedSwiGLU, Experts
from bumblebee.primitives.norms import RMSNorm
from bumblebee.primitives.packed import DocLayout
from bumblebee.primitives.rope import apply_rope, rope_cos_sin, yarn_inv_freq

ROUTER = "topk_softmax"  # the architecture's router


class Attention(nn.Module):
    """HF ``GptOssAttention``."""

    def __init__(self, arch: GptOssArch, idx: int, attend, recompute):
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
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=bias)
        self.sinks = nn.Parameter(torch.empty(self.n_heads))
        self.window = arch.window(idx)
        self.attend, self.recompute = attend, recompute

    def _core(self, q, k, v, layout, sinks):
        return self.attend(q, k, v, layout, self.head_dim**-0.5, window=self.window, sinks=sinks)

    def forward(self, x_BTH, cos, sin, layout: DocLayout):
        B, T, _ = x_BTH.shape
        q = self.q_proj(x_BTH).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x_BTH).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x_BTH).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o_BNTD = self.recompute.module("attn_core", self._core, q, k, v, layout, self.sinks)
        return self.o_proj(o_BNTD.transpose(1, 2).reshape(B, T, -1))


class GptOssMoE(MoE):
    """HF ``GptOssMLP``: the architecture's router (``topk_softmax`` replaces the default) over
    biased experts with the clamped SwiGLU."""

    def __init__(self, arch: GptOssArch, parts: LayerParts):
        prims = parts.prims
        if prims.router == "softmax_topk":
            prims = dataclasses.replace(prims, router=ROUTER)
        super().__init__(arch, prims, parts.dispatch, parts.groups)
        act = ClampedSwiGLU(arch.swiglu_alpha, arch.swiglu_limit)
        E = arch.num_experts // parts.groups.ep_size
        self.experts = Experts(E, arch.hidden_size, arch.intermediate_size, bias=True, act=act)
        self.recompute = parts.recompute

    def forward(self, x_BTH):
        return self.recompute.module("moe", super().forward, x_BTH)


class DecoderLayer(nn.Module):
    is_moe = True

    def __init__(self, arch: GptOssArch, idx: int, parts: LayerParts):
        super().__init__()
        self.recompute = parts.recompute
        self.layer_type = arch.layer_types[idx]
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch, idx, parts.attend, parts.recompute)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = GptOssMoE(arch, parts)

    def forward(self, x_BTH, cos, sin, layout: DocLayout):
        rc = self.recompute
        h = x_BTH + self.self_attn(rc.module("norm", self.input_layernorm, x_BTH), cos, sin, layout)
        y, aux = self.mlp(rc.module("norm", self.post_attention_layernorm, h))
        return h + y, aux


class GptOssForCausalLM(CausalLM):
    """gpt-oss: the shared causal LM (models/base.py) over sink / sliding-window GQA + MoE layers."""

    family = "gpt_oss"
    norm_cls = RMSNorm

    def make_layer(self, index: int, parts: LayerParts) -> nn.Module:
        return DecoderLayer(self.arch, index, parts)

    def rope_tables(self, position_ids_BT, dtype):
        a = self.arch
        if a.rope_parameters.get("rope_type", "default") == "default":
            return super().rope_tables(position_ids_BT, dtype)
        if "_yarn" not in self.__dict__:  # host fp32 frequencies, kept out of .to(dtype)
            self.__dict__["_yarn"] = yarn_inv_freq(
                a.head_dim, a.rope_theta, a.rope_parameters, a.max_position_embeddings
            )
        inv_freq, scale = self.__dict__["_yarn"]
        return rope_cos_sin(
            position_ids_BT, a.head_dim, a.rope_theta, dtype, inv_freq=inv_freq, scale=scale
        )

    def init_vectors(self, std: float) -> dict:
        """HF's init: ones for the norm weights, zeros for the projection and expert biases,
        normal(std) for the sinks and the router bias."""
        rules = {}
        for name, p in self.named_parameters():
            if name.endswith(("sinks", "gate.bias")):
                rules[name] = init.normal(std)
            elif name.endswith(("experts.b_gate_up", "experts.b_down")) or name.endswith(".bias"):
                rules[name] = init.const(0.0)
            elif p.dim() == 1:
                rules[name] = init.const(1.0)
        return rules
