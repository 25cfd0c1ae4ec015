"""Blocks several families share: GQA attention with q/k RMSNorm and RoPE, the SwiGLU MLP and the
routed MoE (router, capacity, dispatch, experts), all over the configured primitives.

Legend: B batch, T tokens, H hidden, N query heads, K kv heads, D head dim, E experts.
"""

from __future__ import annotations

import functools

from torch import nn

from bumblebee import registry
from bumblebee.primitives.fused import swiglu
from bumblebee.primitives.moe import replay as routing_replay
from bumblebee.primitives.moe.balance import router_stats
from bumblebee.primitives.moe.capacity import drop_over_capacity
from bumblebee.primitives.moe.experts import Experts
from bumblebee.primitives.moe.router import build_router
from bumblebee.primitives.norms import RMSNorm
from bumblebee.primitives.packed import DocLayout
from bumblebee.primitives.parallel import ParallelState
from bumblebee.primitives.rope import apply_rope


class Attention(nn.Module):
    def __init__(self, arch, attend, recompute):
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
        self.q_norm = RMSNorm(d, arch.rms_norm_eps)
        self.k_norm = RMSNorm(d, arch.rms_norm_eps)
        self.attend, self.recompute = attend, recompute

    def forward(self, x_BTH, cos, sin, layout: DocLayout):
        B, T, _ = x_BTH.shape
        q = self.q_norm(self.q_proj(x_BTH).view(B, T, self.n_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x_BTH).view(B, T, self.n_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x_BTH).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o_BNTD = self.recompute.module(
            "attn_core", self.attend, q, k, v, layout, self.head_dim**-0.5
        )
        return self.o_proj(o_BNTD.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    """Dense SwiGLU MLP (HF ``Qwen3MoeMLP``)."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class MoE(nn.Module):
    """Router -> dispatch -> experts -> combine. Returns (output, router stats): the stats vector
    of ``primitives/moe/balance.py`` that the model turns into a balance loss."""

    def __init__(self, arch, prims, dispatch, groups: ParallelState):
        super().__init__()
        ep_size = groups.ep_size
        self.gate = build_router(prims.router, arch)
        self.moe_index = -1  # position among the model's MoE layers (set by CausalLM)
        self.num_experts = arch.num_experts
        self.capacity_factor = (
            0.0  # > 0: expert capacity with token dropping (CausalLM.set_capacity)
        )
        # only this rank's E / ep experts live here (expert parallelism)
        self.experts = Experts(
            arch.num_experts // ep_size, arch.hidden_size, arch.moe_intermediate_size
        )
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
        scope = routing_replay.current()  # routing replay / recording (primitives/moe/replay.py)
        given = None if scope is None else scope.given(self.moe_index, B, T)
        r = self.gate(x_TH) if given is None else self.gate(x_TH, given)
        if scope is not None:
            scope.note(self.moe_index, r.idx_TK, B, T)
        if self.capacity_factor > 0:  # pairs over an expert's capacity get id E: cut, zeros back
            idx_TK, dropped = drop_over_capacity(r.idx_TK, self.num_experts, self.capacity_factor)
            y_TH = self.dispatch(x_TH, idx_TK, r.weight_TK, self._run_experts, drops=True)
            return y_TH.view(B, T, H), router_stats(r.probs_TE, r.idx_TK, dropped)
        y_TH = self.dispatch(x_TH, r.idx_TK, r.weight_TK, self._run_experts)
        return y_TH.view(B, T, H), router_stats(r.probs_TE, r.idx_TK)
