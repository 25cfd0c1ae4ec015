"""Qwen3.5-MoE (the hybrid Gated DeltaNet / gated attention MoE) composed from primitives.

Decoder layer i (``arch.layer_types[i]``): x + Mixer(RMSNorm(x)), then
h + MoE(RMSNorm(h)) with

- ``linear_attention``: Gated DeltaNet (Yang et al., ICLR 2025), see
  ``primitives/linear_attention/gdn.py``; its core is the ``linear_attention`` slot;
- ``full_attention``: GQA with per-head q/k RMSNorm, partial RoPE on per-document
  positions, and a sigmoid output gate: ``q_proj`` emits [query | gate] per head
  and ``o_proj(attn * sigmoid(gate))`` (HF ``Qwen3_5MoeAttention``); its core is
  the ``attention`` slot;
- MoE: the routed experts (router, expert FFN and dispatch slots, as Qwen3-MoE)
  plus one shared SwiGLU expert scaled by ``sigmoid(shared_expert_gate(x))``.

Context parallelism (``parallel.cp > 1``): the residual stream is zigzag-sharded
(``primitives/cp/layout.py``) and the layout is a ``CPLayout``. Full attention runs
the ``cp`` slot (allgather / ring) on it; Gated DeltaNet runs on the same zigzag
shards with its state carried across ranks by an affine prefix scan
(``primitives/linear_attention/cp.py``), so no layer converts the residual stream.
The balance loss is reduced over the CP group (as Qwen3-MoE).

Every RMSNorm except the GDN output norm is zero-centered, ``(1 + w)`` in fp32
(HF ``Qwen3_5MoeRMSNorm``). Module and parameter names follow HF's
``Qwen3_5MoeForCausalLM`` so checkpoints map one to one (experts stacked, see
``models/hf.py``). The released checkpoints' multi-token-prediction head ``mtp.*`` is
``MultiTokenPredictor`` (``models/mtp.py``), same names.

Legend: B batch, T tokens, D hidden, N query heads, K kv heads, E head dim, V vocabulary.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from bumblebee import registry
from bumblebee.models.base import CausalLM, LayerParts
from bumblebee.models.blocks import MLP, MoE
from bumblebee.models.mtp import combine
from bumblebee.models.qwen3_5_moe.arch import Qwen3_5MoeArch
from bumblebee.primitives import init
from bumblebee.primitives.linear_attention.gdn import GatedDeltaNet
from bumblebee.primitives.norms import ZeroCenteredRMSNorm
from bumblebee.primitives.packed import DocLayout
from bumblebee.primitives.parallel import ParallelState
from bumblebee.primitives.rope import apply_rope


class GatedAttention(nn.Module):
    """HF ``self_attn``: gated full attention."""

    def __init__(self, arch: Qwen3_5MoeArch, attend, recompute):
        super().__init__()
        h, e = arch.hidden_size, arch.head_dim
        self.n_heads, self.n_kv, self.head_dim = (
            arch.num_attention_heads,
            arch.num_key_value_heads,
            e,
        )
        self.q_proj = nn.Linear(
            h, self.n_heads * e * 2, bias=False
        )  # per head: [query (E) | gate (E)]
        self.k_proj = nn.Linear(h, self.n_kv * e, bias=False)
        self.v_proj = nn.Linear(h, self.n_kv * e, bias=False)
        self.o_proj = nn.Linear(self.n_heads * e, h, bias=False)
        self.q_norm = ZeroCenteredRMSNorm(e, arch.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(e, arch.rms_norm_eps)
        self.attend, self.recompute = attend, recompute

    def forward(self, x_BTD, cos, sin, layout: DocLayout):
        B, T, _ = x_BTD.shape
        q_BTNE, gate_BTNE = (
            self.q_proj(x_BTD).view(B, T, self.n_heads, 2 * self.head_dim).chunk(2, dim=-1)
        )
        q = self.q_norm(q_BTNE).transpose(1, 2)
        k = self.k_norm(self.k_proj(x_BTD).view(B, T, self.n_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x_BTD).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o_BNTE = self.recompute.module(
            "attn_core", self.attend, q, k, v, layout, self.head_dim**-0.5
        )
        o_BTX = o_BNTE.transpose(1, 2).reshape(B, T, -1) * torch.sigmoid(
            gate_BTNE.reshape(B, T, -1)
        )
        return self.o_proj(o_BTX)


class SharedExpertMoE(MoE):
    """HF ``Qwen3_5MoeSparseMoeBlock``: routed experts (Qwen3-MoE's block) + gated shared expert."""

    def __init__(self, arch: Qwen3_5MoeArch, prims, dispatch, recompute, groups: ParallelState):
        super().__init__(arch, prims, dispatch, groups)
        self.shared_expert = MLP(arch.hidden_size, arch.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(arch.hidden_size, 1, bias=False)
        self.recompute = recompute

    def _shared(self, x_BTD):
        return torch.sigmoid(self.shared_expert_gate(x_BTD)) * self.shared_expert(x_BTD)

    def forward(self, x_BTD):
        y_BTD, aux = self.recompute.module("moe", super().forward, x_BTD)
        return y_BTD + self.recompute.module("shared_expert", self._shared, x_BTD), aux


class DecoderLayer(nn.Module):
    def __init__(self, arch: Qwen3_5MoeArch, idx: int, parts: LayerParts, linear_core):
        super().__init__()
        prims, attend, dispatch, recompute, groups = (
            parts.prims,
            parts.attend,
            parts.dispatch,
            parts.recompute,
            parts.groups,
        )
        self.recompute = recompute
        self.layer_type = arch.layer_types[idx]
        self.input_layernorm = ZeroCenteredRMSNorm(arch.hidden_size, arch.rms_norm_eps)
        if self.layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(
                arch.hidden_size,
                arch.linear_num_key_heads,
                arch.linear_num_value_heads,
                arch.linear_key_head_dim,
                arch.linear_value_head_dim,
                arch.linear_conv_kernel_dim,
                arch.rms_norm_eps,
                linear_core,
                recompute,
                cp_carry=prims.linear_attention_cp,
            )
        else:
            self.self_attn = GatedAttention(arch, attend, recompute)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = SharedExpertMoE(arch, prims, dispatch, recompute, groups)
        self.is_moe = True

    def forward(self, x_BTD, cos, sin, layout: DocLayout):
        rc = self.recompute
        h_in = rc.module("norm", self.input_layernorm, x_BTD)
        if self.layer_type == "linear_attention":
            mixed, _state = self.linear_attn(h_in, layout)
        else:
            mixed = self.self_attn(h_in, cos, sin, layout)
        h = x_BTD + mixed
        y, aux = self.mlp(rc.module("norm", self.post_attention_layernorm, h))
        return h + y, aux


class MultiTokenPredictor(nn.Module):
    """The released ``mtp.*`` head (``models/mtp.py``): ``fc`` over [pre_fc_norm_embedding(emb) ;
    pre_fc_norm_hidden(h)] shared by every depth, one gated full-attention MoE layer per depth
    (``layers.{k}``), then ``norm``. The embedding and LM head are the main model's."""

    def __init__(self, arch: Qwen3_5MoeArch, parts: LayerParts, linear_core):
        super().__init__()
        h, eps = arch.hidden_size, arch.rms_norm_eps
        full = dataclasses.replace(arch, layer_types=["full_attention"])
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = ZeroCenteredRMSNorm(h, eps)
        self.pre_fc_norm_hidden = ZeroCenteredRMSNorm(h, eps)
        self.layers = nn.ModuleList(
            [DecoderLayer(full, 0, parts, linear_core) for _ in range(arch.mtp_num_hidden_layers)]
        )
        self.norm = ZeroCenteredRMSNorm(h, eps)

    def forward(self, h_BTD, emb_BTD, cos, sin, layout, k: int):
        x = combine(self.pre_fc_norm_embedding, self.pre_fc_norm_hidden, self.fc, emb_BTD, h_BTD)
        x, aux = self.layers[k](x, cos, sin, layout)
        return self.norm(x), aux


class Qwen3_5MoeForCausalLM(CausalLM):
    """Qwen3.5-MoE: the shared causal LM (models/base.py) over this family's hybrid decoder layer."""

    family = "qwen3_5_moe"
    norm_cls = ZeroCenteredRMSNorm

    def make_layer(self, index: int, parts: LayerParts) -> nn.Module:
        linear_core = registry.get("linear_attention", parts.prims.linear_attention).factory
        return DecoderLayer(self.arch, index, parts, linear_core)

    def make_mtp(self, parts: LayerParts):
        if not self.arch.mtp_num_hidden_layers:
            return None
        return MultiTokenPredictor(
            self.arch, parts, registry.get("linear_attention", parts.prims.linear_attention).factory
        )

    def mtp_modules(self) -> int:
        return 0 if self.mtp is None else len(self.mtp.layers)

    def mtp_forward(self, k: int, h_BTD, emb_BTD, cos, sin, layout):
        return self.recompute.layer(self.mtp, h_BTD, emb_BTD, cos, sin, layout, k)

    def mtp_units(self) -> list[nn.Module]:
        return [self.mtp]

    def rotary_dim(self) -> int:
        return self.arch.rotary_dim

    def init_vectors(self, std: float) -> dict:
        """Zeros for the (1 + w) norms, then the GDN's own rules (ones for its output norm and
        dt_bias, A_log = log U(0.01, 16))."""
        rules = {}
        for mn, m in self.named_modules():
            if isinstance(m, ZeroCenteredRMSNorm):
                rules[f"{mn}.weight"] = init.const(0.0)
            elif isinstance(m, GatedDeltaNet):
                rules.update({f"{mn}.{pn}": fill for pn, fill in m.init_rules(std).items()})
        return rules
