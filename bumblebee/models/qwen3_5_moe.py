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
``models/hf.py``).

Legend: B batch, T tokens, D hidden, N query heads, K kv heads, E head dim, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bumblebee import registry
from bumblebee.models.arch_qwen3_5 import Qwen3_5MoeArch
from bumblebee.models.qwen3_moe import MLP, LossTerms, MoE
from bumblebee.primitives.cp.layout import build_cp_layout
from bumblebee.primitives.linear_attention.gdn import GatedDeltaNet, GatedRMSNorm
from bumblebee.primitives.norms import ZeroCenteredRMSNorm
from bumblebee.primitives.packed import DocLayout, default_position_ids, doc_layout
from bumblebee.primitives.parallel import ParallelGroups
from bumblebee.primitives.rope import apply_rope, rope_cos_sin


class GatedAttention(nn.Module):
    """HF ``self_attn``: gated full attention."""

    def __init__(self, arch: Qwen3_5MoeArch, attend, recompute):
        super().__init__()
        h, e = arch.hidden_size, arch.head_dim
        self.n_heads, self.n_kv, self.head_dim = arch.num_attention_heads, arch.num_key_value_heads, e
        self.q_proj = nn.Linear(h, self.n_heads * e * 2, bias=False)  # per head: [query (E) | gate (E)]
        self.k_proj = nn.Linear(h, self.n_kv * e, bias=False)
        self.v_proj = nn.Linear(h, self.n_kv * e, bias=False)
        self.o_proj = nn.Linear(self.n_heads * e, h, bias=False)
        self.q_norm = ZeroCenteredRMSNorm(e, arch.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(e, arch.rms_norm_eps)
        self.attend, self.recompute = attend, recompute

    def forward(self, x_BTD, cos, sin, layout: DocLayout):
        B, T, _ = x_BTD.shape
        q_BTNE, gate_BTNE = self.q_proj(x_BTD).view(B, T, self.n_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q_BTNE).transpose(1, 2)
        k = self.k_norm(self.k_proj(x_BTD).view(B, T, self.n_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x_BTD).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o_BNTE = self.recompute.module("attn_core", self.attend, q, k, v, layout, self.head_dim ** -0.5)
        o_BTX = o_BNTE.transpose(1, 2).reshape(B, T, -1) * torch.sigmoid(gate_BTNE.reshape(B, T, -1))
        return self.o_proj(o_BTX)


class SharedExpertMoE(MoE):
    """HF ``Qwen3_5MoeSparseMoeBlock``: routed experts (Qwen3-MoE's block) + gated shared expert."""

    def __init__(self, arch: Qwen3_5MoeArch, prims, dispatch, recompute, groups: ParallelGroups):
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
    def __init__(self, arch: Qwen3_5MoeArch, idx: int, prims, attend, linear_core, dispatch, recompute, groups):
        super().__init__()
        self.recompute = recompute
        self.layer_type = arch.layer_types[idx]
        self.input_layernorm = ZeroCenteredRMSNorm(arch.hidden_size, arch.rms_norm_eps)
        if self.layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(
                arch.hidden_size, arch.linear_num_key_heads, arch.linear_num_value_heads, arch.linear_key_head_dim,
                arch.linear_value_head_dim, arch.linear_conv_kernel_dim, arch.rms_norm_eps, linear_core, recompute)
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


class Backbone(nn.Module):
    """HF ``model.*``: embeddings, decoder layers, final norm."""

    def __init__(self, arch: Qwen3_5MoeArch, prims, dispatch, recompute, groups: ParallelGroups):
        super().__init__()
        # full attention: the CP implementation when the sequence is split (zigzag shards)
        attend = registry.get("cp", prims.cp).factory if groups.cp_size > 1 else \
            registry.get("attention", prims.attention).factory
        linear_core = registry.get("linear_attention", prims.linear_attention).factory
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch, i, prims, attend, linear_core, dispatch, recompute, groups)
                                    for i in range(arch.num_hidden_layers))
        self.norm = ZeroCenteredRMSNorm(arch.hidden_size, arch.rms_norm_eps)


class Qwen3_5MoeForCausalLM(nn.Module):
    """The public model object (see DESIGN.md, public API); same surface as ``Qwen3MoeForCausalLM``."""

    family = "qwen3_5_moe"

    def __init__(self, arch: Qwen3_5MoeArch, prims=None, groups: ParallelGroups | None = None):
        super().__init__()
        from bumblebee.config import PrimitivesConfig

        self.arch = arch
        self.prims = prims or PrimitivesConfig()
        self.groups = groups or ParallelGroups()
        dispatch = registry.get("moe_comm", self.prims.moe_comm).factory(
            num_experts=arch.num_experts, ep_group=self.groups.ep_group, num_chunks=self.prims.moe_chunks)
        self.recompute = registry.get("recompute", self.prims.recompute).factory(self.prims.recompute_modules)
        self.loss_fn = registry.get("loss", self.prims.loss).factory
        self.model = Backbone(arch, self.prims, dispatch, self.recompute, self.groups)
        self.lm_head = None if arch.tie_word_embeddings else nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        """HF init: normal(0, std) for matrices, zeros for the (1 + w) norms, ones for the GDN
        output norm and dt_bias, A_log = log U(0.01, 16). Expert weights are drawn at full size
        and sliced (as Qwen3-MoE), so every expert-parallel layout initializes alike for a seed."""
        ep, r = self.groups.ep_size, self.groups.ep_rank
        for name, p in self.named_parameters():
            if p.dim() > 1 and name.endswith(("experts.w_gate_up", "experts.w_down")) and ep > 1:
                full = torch.empty((p.shape[0] * ep,) + tuple(p.shape[1:]), dtype=p.dtype, device=p.device)
                p.copy_(full.normal_(0.0, std)[r * p.shape[0]:(r + 1) * p.shape[0]])
            elif p.dim() > 1:
                p.normal_(0.0, std)
        for m in self.modules():
            if isinstance(m, ZeroCenteredRMSNorm):
                m.weight.zero_()
            elif isinstance(m, GatedDeltaNet):
                m.reset_parameters(std)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def layer_context(self, position_ids_BT, dtype):
        """What every decoder layer takes besides its input: partial-RoPE (cos, sin) in ``dtype``
        and the document layout (the CP layout when the sequence is split). Pipeline stages rebuild it."""
        cos, sin = rope_cos_sin(position_ids_BT, self.arch.rotary_dim, self.arch.rope_theta, dtype)
        cp_group = self.groups.cp_group if self.groups.cp_size > 1 else None
        layout = build_cp_layout(position_ids_BT, cp_group) if cp_group is not None else doc_layout(position_ids_BT)
        return cos, sin, layout

    def layer_flops(self, seq_len: int) -> tuple[list[float], float]:
        """Estimated forward FLOPs of one ``seq_len``-token sequence through each decoder layer and
        through the LM head (see ``Qwen3MoeForCausalLM.layer_flops``). Gated DeltaNet: projections
        plus the chunked delta rule (64-token chunks: state update and intra-chunk products)."""
        a, T, H = self.arch, seq_len, self.arch.hidden_size
        nk, nv = a.linear_num_key_heads, a.linear_num_value_heads
        dk, dv = a.linear_key_head_dim, a.linear_value_head_dim
        full = 2 * T * H * a.head_dim * (3 * a.num_attention_heads + 2 * a.num_key_value_heads)  # q doubled: gate
        full += 2 * T * T * a.num_attention_heads * a.head_dim
        linear = 2 * T * H * (2 * nk * dk + 3 * nv * dv + 2 * nv) + 2 * T * nv * (2 * dk * dv + 64 * (dk + dv))
        moe = 2 * T * H * (a.num_experts + 3 * a.num_experts_per_tok * a.moe_intermediate_size
                           + 3 * a.shared_expert_intermediate_size + 1)
        layers = [(full if kind == "full_attention" else linear) + moe for kind in a.layer_types]
        return layers, 2 * T * H * a.vocab_size

    def hidden_states(self, input_ids_BT, position_ids_BT=None):
        """Final-norm hidden states [B, T, D] and the mean balance loss over MoE layers."""
        if position_ids_BT is None:
            position_ids_BT = default_position_ids(input_ids_BT)
        x = self.model.embed_tokens(input_ids_BT)
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        cos, sin, layout = self.layer_context(position_ids_BT, dtype)
        aux_total = x.new_zeros((), dtype=torch.float32)
        for layer in self.model.layers:
            x, aux = self.recompute.layer(layer, x, cos, sin, layout)
            aux_total = aux_total + aux
        return self.model.norm(x), aux_total / max(len(self.model.layers), 1)

    def loss_terms(self, input_ids_BT, labels_BT, position_ids_BT=None) -> LossTerms:
        h_BTD, aux = self.hidden_states(input_ids_BT, position_ids_BT)
        labels_T = labels_BT.reshape(-1)
        loss_sum = self.loss_fn(h_BTD.reshape(-1, h_BTD.shape[-1]), self.lm_head_weight, labels_T, reduction="sum")
        return LossTerms(loss_sum, (labels_T != -100).sum(), aux)

    def forward(self, input_ids, position_ids=None, labels=None):
        """Logits [B, T, V] without labels; with labels (already shifted, -100 ignored)
        the mean cross-entropy through the configured loss primitive."""
        if labels is None:
            h_BTD, _ = self.hidden_states(input_ids, position_ids)
            return F.linear(h_BTD, self.lm_head_weight)
        terms = self.loss_terms(input_ids, labels, position_ids)
        return terms.loss_sum / terms.num_tokens.clamp(min=1)
