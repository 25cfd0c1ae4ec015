"""Blocks the families compose, all over the configured primitives: GQA attention (gated or not,
with the q/k norm, biases, sinks and window a family asks for), the SwiGLU MLP, the routed MoE
(router, capacity, dispatch, experts; shared experts gated or not) and the pre-norm decoder
layer around a token mixer and an MLP. Module names are Hugging Face's.

Legend: B batch, T tokens, H hidden, N query heads, K kv heads, D head dim, E experts.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch import nn

from bumblebee import registry
from bumblebee.errors import ConfigError
from bumblebee.primitives import replay_check
from bumblebee.primitives.fused import swiglu
from bumblebee.primitives.moe import replay as routing_replay
from bumblebee.primitives.moe.balance import router_stats
from bumblebee.primitives.moe.capacity import drop_over_capacity
from bumblebee.primitives.moe.experts import Experts
from bumblebee.primitives.moe.router import build_router
from bumblebee.primitives.norms import RMSNorm
from bumblebee.primitives.packed import DocLayout
from bumblebee.primitives.parallel import ParallelState
from bumblebee.primitives.recompute import NoRecompute
from bumblebee.primitives.rope import apply_rope


class Attention(nn.Module):
    """HF ``self_attn``: q/k/v projections, q/k norm, RoPE on the model's tables, the attention
    core, ``o_proj``. What a family does otherwise is an argument:

    - ``gate``: ``q_proj`` emits [query | gate] per head and the core's output is scaled by the
      gate's sigmoid (Qwen3.5);
    - ``qk_norm``: ``"head"`` (one [D] weight for every head), ``"all"`` (one norm over all heads
      of a token, [N x D] and [K x D] weights: MiniMax-M2) or ``""``; ``norm``: its class;
    - ``bias`` (q/k/v) and ``o_bias``; ``sinks`` (per-head sink logits [N]) and ``window`` (keys
      a query reads, 0: all), options of the core (primitives/attention/options.py).
    """

    def __init__(
        self,
        arch,
        attend,
        recompute,
        *,
        gate: bool = False,
        qk_norm: str = "head",
        norm: type = RMSNorm,
        bias: bool = False,
        o_bias: bool = False,
        sinks: bool = False,
        window: int = 0,
    ):
        super().__init__()
        h, d = arch.hidden_size, arch.head_dim
        self.n_heads, self.n_kv, self.head_dim = (
            arch.num_attention_heads,
            arch.num_key_value_heads,
            d,
        )
        self.q_proj = nn.Linear(h, self.n_heads * d * (2 if gate else 1), bias=bias)
        self.k_proj = nn.Linear(h, self.n_kv * d, bias=bias)
        self.v_proj = nn.Linear(h, self.n_kv * d, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=o_bias)
        self.q_norm = self.k_norm = None
        if qk_norm:
            all_heads = qk_norm == "all"
            self.q_norm = norm(self.n_heads * d if all_heads else d, arch.rms_norm_eps)
            self.k_norm = norm(self.n_kv * d if all_heads else d, arch.rms_norm_eps)
        self.sinks = nn.Parameter(torch.empty(self.n_heads)) if sinks else None
        self.gate, self.qk_norm, self.window = gate, qk_norm, window
        self.attend, self.recompute = attend, recompute

    def _heads(self, y, heads: int, norm):
        """q or k, [B, T, heads x D] (or [B, T, heads, D]), normed as asked -> [B, heads, T, D]."""
        B, T = y.shape[:2]
        if self.qk_norm == "all":
            if y.shape[-1] != heads * self.head_dim:
                # a norm over a rank's part of the heads is another model, not an approximation
                raise ConfigError(
                    "the q/k norm spans all heads of a token; heads split over ranks (tensor "
                    "parallelism) would need a cross-rank sum of squares, not implemented"
                )
            y = norm(y)
        y = y.view(B, T, heads, self.head_dim)
        if self.qk_norm == "head":
            y = norm(y)
        return y.transpose(1, 2)

    def _core(self, q, k, v, layout, sinks):
        return self.attend(q, k, v, layout, self.head_dim**-0.5, window=self.window, sinks=sinks)

    def forward(self, x_BTH, cos, sin, layout: DocLayout):
        B, T, _ = x_BTH.shape
        q, gate_BTND = self.q_proj(x_BTH), None
        if self.gate:
            q, gate_BTND = q.view(B, T, self.n_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self._heads(q, self.n_heads, self.q_norm)
        k = self._heads(self.k_proj(x_BTH), self.n_kv, self.k_norm)
        v = self.v_proj(x_BTH).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.sinks is None and not self.window:  # no options: the call every core takes
            o_BNTD = self.recompute.module(
                "attn_core", self.attend, q, k, v, layout, self.head_dim**-0.5
            )
        else:
            o_BNTD = self.recompute.module("attn_core", self._core, q, k, v, layout, self.sinks)
        o_BTX = o_BNTD.transpose(1, 2).reshape(B, T, -1)
        if self.gate:
            o_BTX = o_BTX * torch.sigmoid(gate_BTND.reshape(B, T, -1))
        return self.o_proj(o_BTX)


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
    """Router -> dispatch -> experts -> combine, plus shared experts. Returns (output, router
    stats): the stats vector of ``primitives/moe/balance.py`` the model turns into a balance loss.

    ``recompute``: the block runs under the policy's ``moe`` (and ``shared_expert``) modules;
    ``router``: the architecture's router, taken where the config keeps the default
    ``softmax_topk``; ``shared``: ``"gated"`` (HF ``shared_expert`` scaled by
    ``sigmoid(shared_expert_gate(x))``, Qwen), ``"ungated"`` (``shared_experts`` of
    ``n_shared_experts x moe_intermediate_size``, DeepSeek; none when 0) or ``""``;
    ``expert_bias`` / ``act``: biased experts, another GLU (``Experts``)."""

    def __init__(
        self,
        arch,
        prims,
        dispatch,
        groups: ParallelState,
        recompute=None,
        *,
        router: str = "",
        shared: str = "",
        expert_bias: bool = False,
        act=None,
    ):
        super().__init__()
        if router and prims.router == "softmax_topk":
            prims = dataclasses.replace(prims, router=router)
        self.gate = build_router(prims.router, arch)
        self.moe_index = -1  # position among the model's MoE layers (set by CausalLM)
        self.label = "a MoE layer"  # what errors call it, "layer 3" (set by CausalLM)
        self.num_experts = arch.num_experts
        self.capacity_factor = (
            0.0  # > 0: expert capacity with token dropping (CausalLM.set_capacity)
        )
        # only this rank's E / ep experts live here (expert parallelism)
        self.experts = Experts(
            arch.num_experts // groups.ep_size,
            arch.hidden_size,
            arch.moe_intermediate_size,
            bias=expert_bias,
            act=act,
        )
        self.expert_fn = registry.get("experts", prims.experts).factory
        self.dispatch = dispatch
        self.recompute = NoRecompute() if recompute is None else recompute
        self.shared = "" if shared == "ungated" and not arch.n_shared_experts else shared
        if self.shared:
            name = "shared_expert" if self.shared == "gated" else "shared_experts"
            setattr(self, name, MLP(arch.hidden_size, arch.shared_expert_intermediate_size))
        if self.shared == "gated":
            self.shared_expert_gate = nn.Linear(arch.hidden_size, 1, bias=False)

    def _run_experts(self, x_NH, counts_E, schedule=None):
        """The experts primitive on rows sorted by expert. A dispatcher that schedules the expert
        GEMMs itself (moe_comm = chunked) passes ``schedule(x, counts, w_gate_up, w_down, expert_fn=)``
        instead: it runs once per layer inside ``Experts.forward`` (one FSDP2 all-gather)."""
        if schedule is None:
            return self.experts(x_NH, counts_E, self.expert_fn)
        return self.experts(x_NH, counts_E, functools.partial(schedule, expert_fn=self.expert_fn))

    def routed(self, x_BTH):
        """The routed experts alone: (output, router stats)."""
        with replay_check.labelled(self.label):  # names this block in a recompute's check
            return self._routed(x_BTH)

    def _routed(self, x_BTH):
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

    def _shared(self, x_BTH):
        if self.shared == "gated":
            return torch.sigmoid(self.shared_expert_gate(x_BTH)) * self.shared_expert(x_BTH)
        return self.shared_experts(x_BTH)

    def forward(self, x_BTH):
        y_BTH, aux = self.recompute.module("moe", self.routed, x_BTH)
        if self.shared:
            y_BTH = y_BTH + self.recompute.module("shared_expert", self._shared, x_BTH)
        return y_BTH, aux


def feed_forward(arch, index: int, parts, moe: bool | None = None, **traits) -> nn.Module:
    """Layer ``index``'s MLP block: a ``MoE`` with ``traits`` where ``arch.is_moe_layer`` (or
    ``moe``) says so, else a dense SwiGLU of ``intermediate_size``."""
    if arch.is_moe_layer(index) if moe is None else moe:
        return MoE(arch, parts.prims, parts.dispatch, parts.groups, parts.recompute, **traits)
    return MLP(arch.hidden_size, arch.intermediate_size)


class DecoderLayer(nn.Module):
    """The pre-norm decoder layer: h = x + mixer(input_layernorm(x)), then
    h + mlp(post_attention_layernorm(h)); returns (output, the MoE block's router stats or a 0-d
    zero). ``mixer``: attention ``(x, cos, sin, layout) -> y``, or, for a ``layer_type`` of
    ``"linear_attention"``, a linear mixer ``(x, layout) -> (y, state)``; it sits at
    ``mixer_name`` (HF's: ``self_attn``, Qwen's ``linear_attn``). ``keep_mixer_io``: the mixer's
    input and output stay alive through the MLP block (the memory the family's ``ModelSpec``
    counts, ``stream_tensors``)."""

    def __init__(
        self,
        arch,
        parts,
        mixer: nn.Module,
        mlp: nn.Module,
        *,
        norm: type = RMSNorm,
        layer_type: str = "full_attention",
        mixer_name: str = "self_attn",
        keep_mixer_io: bool = False,
    ):
        super().__init__()
        self.recompute = parts.recompute
        self.layer_type, self.mixer_name, self.keep_mixer_io = layer_type, mixer_name, keep_mixer_io
        self.input_layernorm = norm(arch.hidden_size, arch.rms_norm_eps)
        setattr(self, mixer_name, mixer)
        self.post_attention_layernorm = norm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = mlp
        self.is_moe = isinstance(mlp, MoE)

    def forward(self, x_BTH, cos, sin, layout: DocLayout):
        rc = self.recompute
        h_in = rc.module("norm", self.input_layernorm, x_BTH)
        mixer = getattr(self, self.mixer_name)
        if self.layer_type == "linear_attention":
            mixed, _state = mixer(h_in, layout)
        else:
            mixed = mixer(h_in, cos, sin, layout)
        h = x_BTH + mixed
        if not self.keep_mixer_io:
            del h_in, mixed
        y_in = rc.module("norm", self.post_attention_layernorm, h)
        if self.is_moe:
            y, aux = self.mlp(y_in)
        else:
            y, aux = rc.module("mlp", self.mlp, y_in), h.new_zeros((), dtype=torch.float32)
        return h + y, aux
