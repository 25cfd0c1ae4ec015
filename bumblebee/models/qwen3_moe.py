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

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from bumblebee import registry
from bumblebee.models.arch import Qwen3MoeArch
from bumblebee.primitives.cp.layout import build_cp_layout
from bumblebee.primitives.moe.experts import Experts
from bumblebee.primitives.moe.router import load_balancing_loss
from bumblebee.primitives.norms import RMSNorm
from bumblebee.primitives.parallel import ParallelGroups
from bumblebee.primitives.packed import DocLayout, default_position_ids, doc_layout
from bumblebee.primitives.rope import apply_rope, rope_cos_sin


@dataclass
class LossTerms:
    """What a training step needs from one micro-batch's forward."""

    loss_sum: torch.Tensor  # summed token losses over the valid labels of this micro-batch
    num_tokens: torch.Tensor  # number of valid labels (int64 scalar)
    aux_loss: torch.Tensor  # load-balancing loss, mean over MoE layers (0 if none)


class Attention(nn.Module):
    def __init__(self, arch: Qwen3MoeArch, attend, recompute):
        super().__init__()
        h, d = arch.hidden_size, arch.head_dim
        self.n_heads, self.n_kv, self.head_dim = arch.num_attention_heads, arch.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.n_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.n_kv * d, bias=False)
        self.v_proj = nn.Linear(h, self.n_kv * d, bias=False)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, arch.rms_norm_eps)
        self.k_norm = RMSNorm(d, arch.rms_norm_eps)
        self.attend, self.recompute = attend, recompute

    def forward(self, x_BTH, cos, sin, layout: DocLayout):
        B, T, _ = x_BTH.shape
        q = self.q_norm(self.q_proj(x_BTH).view(B, T, self.n_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x_BTH).view(B, T, self.n_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x_BTH).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o_BNTD = self.recompute.module("attn_core", self.attend, q, k, v, layout, self.head_dim ** -0.5)
        return self.o_proj(o_BNTD.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    """Dense SwiGLU MLP (HF ``Qwen3MoeMLP``)."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    """Router -> dispatch -> experts -> combine. Returns (output, balance loss)."""

    def __init__(self, arch: Qwen3MoeArch, prims, dispatch, groups: ParallelGroups):
        super().__init__()
        ep_size = groups.ep_size
        self.cp_group = groups.cp_group if groups.cp_size > 1 else None  # balance stats span the sequence
        router_cls = registry.get("router", prims.router).factory
        self.gate = router_cls(arch.hidden_size, arch.num_experts, arch.num_experts_per_tok, arch.norm_topk_prob)
        # only this rank's E / ep experts live here (expert parallelism)
        self.experts = Experts(arch.num_experts // ep_size, arch.hidden_size, arch.moe_intermediate_size)
        self.expert_fn = registry.get("experts", prims.experts).factory
        self.dispatch = dispatch

    def _run_experts(self, x_NH, counts_E, schedule=None):
        """The experts primitive on rows sorted by expert. A dispatcher that schedules the expert
        GEMMs itself (moe_comm = chunked) passes ``schedule(x, counts, w_gate_up, w_down, expert_fn=)``
        instead: it runs once per layer inside ``Experts.forward`` (one FSDP2 all-gather)."""
        if schedule is None:
            return self.experts(x_NH, counts_E, self.expert_fn)
        return self.experts(x_NH, counts_E, functools.partial(schedule, expert_fn=self.expert_fn))

    def forward(self, x_BTH):
        B, T, H = x_BTH.shape
        x_TH = x_BTH.reshape(-1, H)
        r = self.gate(x_TH)
        y_TH = self.dispatch(x_TH, r.idx_TK, r.weight_TK, self._run_experts)
        return y_TH.view(B, T, H), load_balancing_loss(r.probs_TE, r.idx_TK, self.cp_group)


class DecoderLayer(nn.Module):
    def __init__(self, arch: Qwen3MoeArch, idx: int, prims, attend, dispatch, recompute, groups: ParallelGroups):
        super().__init__()
        self.recompute = recompute
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch, attend, recompute)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.is_moe = arch.is_moe_layer(idx)
        self.mlp = MoE(arch, prims, dispatch, groups) if self.is_moe else MLP(arch.hidden_size, arch.intermediate_size)

    def forward(self, x_BTH, cos, sin, layout: DocLayout):
        rc = self.recompute
        h = x_BTH + self.self_attn(rc.module("norm", self.input_layernorm, x_BTH), cos, sin, layout)
        y_in = rc.module("norm", self.post_attention_layernorm, h)
        if self.is_moe:
            y, aux = rc.module("moe", self.mlp, y_in)
        else:
            y, aux = rc.module("mlp", self.mlp, y_in), h.new_zeros((), dtype=torch.float32)
        return h + y, aux


class Backbone(nn.Module):
    """HF ``model.*``: embeddings, decoder layers, final norm."""

    def __init__(self, arch: Qwen3MoeArch, prims, dispatch, recompute, groups: ParallelGroups):
        super().__init__()
        # one attention core for the whole model: the CP implementation when the sequence is split
        attend = registry.get("cp", prims.cp).factory if groups.cp_size > 1 else \
            registry.get("attention", prims.attention).factory
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch, i, prims, attend, dispatch, recompute, groups)
                                    for i in range(arch.num_hidden_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)


class Qwen3MoeForCausalLM(nn.Module):
    """The public model object (see DESIGN.md, public API)."""

    family = "qwen3_moe"

    def __init__(self, arch: Qwen3MoeArch, prims=None, groups: ParallelGroups | None = None):
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
        """HF-style init: normal(0, 0.02) for matrices, ones for norms. Expert weights are
        drawn at full size and sliced, so every layout initializes identically for a seed."""
        ep, r = self.groups.ep_size, self.groups.ep_rank
        for name, p in self.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            elif name.endswith(("experts.w_gate_up", "experts.w_down")) and ep > 1:
                full = torch.empty((p.shape[0] * ep,) + tuple(p.shape[1:]), dtype=p.dtype, device=p.device)
                p.copy_(full.normal_(0.0, std)[r * p.shape[0]:(r + 1) * p.shape[0]])
            else:
                p.normal_(0.0, std)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def layer_context(self, position_ids_BT, dtype):
        """What every decoder layer takes besides its input: RoPE (cos, sin) in ``dtype`` and the
        document layout (the CP layout when the sequence is split). Pipeline stages rebuild it."""
        cp_group = self.groups.cp_group if self.groups.cp_size > 1 else None
        layout = build_cp_layout(position_ids_BT, cp_group) if cp_group is not None else doc_layout(position_ids_BT)
        cos, sin = rope_cos_sin(position_ids_BT, self.arch.head_dim, self.arch.rope_theta, dtype)
        return cos, sin, layout

    def layer_flops(self, seq_len: int) -> tuple[list[float], float]:
        """Estimated forward FLOPs of one ``seq_len``-token sequence through each decoder layer
        (attention projections + causal core, then the router + top-k experts, or the dense
        MLP), and through the LM head (the embedding is a lookup). Pipeline stages balance on these."""
        a, T, H = self.arch, seq_len, self.arch.hidden_size
        attn = 2 * T * H * a.head_dim * (2 * a.num_attention_heads + 2 * a.num_key_value_heads)
        attn += 2 * T * T * a.num_attention_heads * a.head_dim  # QK^T and PV, half of them causal-masked
        moe = 2 * T * H * (a.num_experts + 3 * a.num_experts_per_tok * a.moe_intermediate_size)
        mlp = 6 * T * H * a.intermediate_size
        layers = [attn + (moe if a.is_moe_layer(i) else mlp) for i in range(a.num_hidden_layers)]
        return layers, 2 * T * H * a.vocab_size

    def hidden_states(self, input_ids_BT, position_ids_BT=None):
        """Final-norm hidden states [B, T, H] and the mean balance loss over MoE layers."""
        if position_ids_BT is None:
            position_ids_BT = default_position_ids(input_ids_BT)
        x = self.model.embed_tokens(input_ids_BT)
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        cos, sin, layout = self.layer_context(position_ids_BT, dtype)
        aux_total, n_moe = x.new_zeros((), dtype=torch.float32), 0
        for layer in self.model.layers:
            x, aux = self.recompute.layer(layer, x, cos, sin, layout)
            aux_total, n_moe = aux_total + aux, n_moe + int(layer.is_moe)
        return self.model.norm(x), aux_total / max(n_moe, 1)

    def loss_terms(self, input_ids_BT, labels_BT, position_ids_BT=None) -> LossTerms:
        h_BTH, aux = self.hidden_states(input_ids_BT, position_ids_BT)
        labels_T = labels_BT.reshape(-1)
        loss_sum = self.loss_fn(h_BTH.reshape(-1, h_BTH.shape[-1]), self.lm_head_weight, labels_T, reduction="sum")
        return LossTerms(loss_sum, (labels_T != -100).sum(), aux)

    def forward(self, input_ids, position_ids=None, labels=None):
        """Logits [B, T, V] without labels; with labels (already shifted, -100 ignored)
        the mean cross-entropy through the configured loss primitive."""
        if labels is None:
            h_BTH, _ = self.hidden_states(input_ids, position_ids)
            return F.linear(h_BTH, self.lm_head_weight)
        terms = self.loss_terms(input_ids, labels, position_ids)
        return terms.loss_sum / terms.num_tokens.clamp(min=1)
