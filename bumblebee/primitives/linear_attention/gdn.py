"""The Gated DeltaNet token mixer (HF ``Qwen3_5MoeGatedDeltaNet``, ``linear_attn.*``).

Yang et al., "Gated Delta Networks: Improving Mamba2 with Delta Rule" (ICLR
2025), as parameterized by Qwen3.5 (HF's Qwen3.5-MoE):

    qkv = conv1d(in_proj_qkv(x)) -> SiLU -> split [q (G*K) | k (G*K) | v (H*V)]
    z = in_proj_z(x)                             # output gate, [H, V]
    beta = sigmoid(in_proj_b(x))                 # write strength per value head
    g = -exp(A_log) * softplus(in_proj_a(x) + dt_bias)   # log decay (Mamba2-style), fp32
    o = gated_delta_rule(q, k, v, g, beta)       # the ``linear_attention`` slot
    y = out_proj(GatedRMSNorm(o, z))             # RMSNorm over V, weight, then * SiLU(z)

The conv window and the recurrent state restart at every packed document; both
can be carried in (``GDNState``) and are returned for the row ends. Under context
parallelism (a ``CPShards``) the layer hands its projections to ``cp.py``, which
carries both across ranks.

Legend: B batch, T tokens, D hidden, G key heads, H value heads, K key dim,
V value dim, C conv channels (2*G*K + H*V), P conv window (kernel - 1).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from bumblebee.primitives import emulation, init
from bumblebee.primitives.cp.zigzag import CPShards
from bumblebee.primitives.fused import fused
from bumblebee.primitives.kernel_choice import select
from bumblebee.primitives.linear_attention.conv import CausalConv1d
from bumblebee.primitives.linear_attention.cp import gated_delta_net_cp
from bumblebee.primitives.linear_attention.tree import gated_delta_net_tree
from bumblebee.primitives.packed import DocLayout
from bumblebee.primitives.prefix_tree import TreeLayout
from bumblebee.primitives.recompute import lean


@dataclass
class GDNState:
    """What one Gated DeltaNet layer carries across a sequence split (per row)."""

    conv_BPC: torch.Tensor  # last kernel-1 pre-conv inputs of the qkv projection
    recurrent_BHKV: torch.Tensor  # delta-rule state, fp32

    def continued(self, continues_B: torch.Tensor) -> GDNState:
        """The state to pass on: zero for rows whose next segment starts a new document
        (e.g. ``continues_B = position_ids_next[:, 0] != 0``), kept for rows that continue one."""
        keep = continues_B.to(self.recurrent_BHKV.dtype)
        return GDNState(
            self.conv_BPC * keep[:, None, None].to(self.conv_BPC.dtype),
            self.recurrent_BHKV * keep[:, None, None, None],
        )


NORM_BLOCK = 2048  # tokens per recompute block of the gated norm (fp32 temporaries: ~8 x block x H x V bytes)


class GatedRMSNorm(nn.Module):
    """HF ``Qwen3_5MoeRMSNormGated``: ``(w * rmsnorm(x).to(dtype)) * silu(z)`` (the gate in fp32),
    cast back to x's dtype. The weight multiplies directly (init ones), unlike the model's norms."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        # autograd keeps x and z only: the fp32 intermediates (4 x the bf16 output) are recomputed
        # in backward, in blocks of NORM_BLOCK tokens over all rows once a call has more than two
        # blocks' worth (per-token maths: the same values as one call up to the kernels' reduction
        # order; the weight gradient sums the blocks' parts). Up to 2 x NORM_BLOCK tokens stay one
        # call, as before (the planner's per-token model of this layer assumes one call there).
        tokens = x.shape[:-2].numel() if x.dim() >= 3 else 0
        if select("glue", "fused", emulation.kind(x), x.dtype).name == "compiled":
            # one fused kernel over all tokens: no fp32 temporaries in memory, so no blocks
            return fused("gated_rms_norm", gated_rms_norm, x, z, self.weight, self.eps, weight=True)
        if tokens <= 2 * NORM_BLOCK:
            return lean(self._forward, x, z)
        x_NHV, z_NHV = x.reshape((tokens,) + x.shape[-2:]), z.reshape((tokens,) + z.shape[-2:])
        return torch.cat(
            [
                lean(self._forward, xs, zs)
                for xs, zs in zip(x_NHV.split(NORM_BLOCK), z_NHV.split(NORM_BLOCK))
            ]
        ).view(x.shape)

    def _forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, z, self.weight, self.eps)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float):
    """``GatedRMSNorm``'s maths (one fused kernel on CUDA: ``fused.py``)."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * x32.to(dtype) * F.silu(z.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """One Gated DeltaNet layer; ``core`` is a ``linear_attention`` implementation."""

    def __init__(
        self,
        hidden: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel: int,
        eps: float,
        core: Callable,
        recompute,
        cp_carry: str = "scan",
    ):
        super().__init__()
        if min(hidden, num_k_heads, num_v_heads, head_k_dim, head_v_dim, conv_kernel) <= 0:
            raise ValueError("GatedDeltaNet: all sizes must be positive")
        if num_v_heads % num_k_heads:
            raise ValueError(
                f"GatedDeltaNet: value heads ({num_v_heads}) must be a multiple of key heads "
                f"({num_k_heads})"
            )
        self.G, self.H, self.K, self.V = num_k_heads, num_v_heads, head_k_dim, head_v_dim
        key_dim, value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.in_proj_qkv = nn.Linear(hidden, 2 * key_dim + value_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden, value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden, num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden, num_v_heads, bias=False)
        self.conv1d = CausalConv1d(2 * key_dim + value_dim, conv_kernel)
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.empty(num_v_heads))
        self.norm = GatedRMSNorm(head_v_dim, eps)
        self.out_proj = nn.Linear(value_dim, hidden, bias=False)
        self.core, self.recompute = core, recompute
        self.cp_carry = (
            cp_carry  # how context parallelism carries the state: "scan" | "relay" (cp.py)
        )
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        """HF init: matrices and conv normal(0, std), dt_bias 1, A = exp(A_log) ~ U(0.01, 16), norm 1."""
        for lin in (
            self.in_proj_qkv,
            self.in_proj_z,
            self.in_proj_b,
            self.in_proj_a,
            self.out_proj,
            self.conv1d,
        ):
            lin.weight.normal_(0.0, std)
        self.dt_bias.fill_(1.0)
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(0.01, 16).log_())
        self.norm.weight.fill_(1.0)

    def init_rules(self, std: float = 0.02) -> dict:
        """The same init as fill rules (primitives/init.py), for layout-independent model init."""
        rules = {
            f"{n}.weight": init.normal(std)
            for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "conv1d")
        }
        return {
            **rules,
            "dt_bias": init.const(1.0),
            "A_log": init.log_uniform(0.01, 16),
            "norm.weight": init.const(1.0),
        }

    def project(self, x_BTD: torch.Tensor):
        """The per-token input projections: (pre-conv qkv [B, T, C], z [B, T, H, V], beta [B, T, H],
        g [B, T, H] fp32). Any token order works (context parallelism runs them on its shard)."""
        B, T, _ = x_BTD.shape
        qkv_pre_BTC = self.in_proj_qkv(x_BTD)
        z_BTHV = self.in_proj_z(x_BTD).view(B, T, self.H, self.V)
        beta_BTH = torch.sigmoid(self.in_proj_b(x_BTD))
        g_BTH = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x_BTD).float() + self.dt_bias)
        return qkv_pre_BTC, z_BTHV, beta_BTH, g_BTH

    def split_heads(self, qkv_BTC: torch.Tensor, activated: bool = False):
        """Post-conv qkv -> SiLU (unless ``activated``: the conv applied it) -> (q [B, T, G, K],
        k [B, T, G, K], v [B, T, H, V])."""
        B, T, _ = qkv_BTC.shape
        G, H, K, V = self.G, self.H, self.K, self.V
        q, k, v = (qkv_BTC if activated else F.silu(qkv_BTC)).split([G * K, G * K, H * V], dim=-1)
        return q.reshape(B, T, G, K), k.reshape(B, T, G, K), v.reshape(B, T, H, V)

    def finish(self, o_BTHV: torch.Tensor, z_BTHV: torch.Tensor) -> torch.Tensor:
        """Gated RMSNorm and the output projection -> y [B, T, D]."""
        B, T = o_BTHV.shape[:2]
        return self.out_proj(self.norm(o_BTHV, z_BTHV).reshape(B, T, self.H * self.V))

    def forward(
        self, x_BTD: torch.Tensor, layout: DocLayout | CPShards, state: GDNState | None = None
    ):
        """-> (y [B, T, D], GDNState at the end of every row). ``state`` continues each row's
        first document (see ``gated_delta_rule``); None starts from zeros. The layout cannot tell
        whether row b's first token opens a new document, so a caller carrying a state across a
        split passes ``state.continued(continues_B)``.

        With a ``CPShards`` (the sequence is zigzag-sharded over a CP group) the layer runs
        context-parallel (``linear_attention/cp.py``): the state is carried across ranks
        internally, no ``state`` may be passed, and the returned state is None. A shared-prefix
        ``TreeLayout`` likewise (``linear_attention/tree.py``)."""
        if isinstance(layout, CPShards):
            if state is not None:
                raise ValueError(
                    "GatedDeltaNet: a carried state cannot be combined with context parallelism "
                    "(the CP layout already carries the state across ranks); pass state=None"
                )
            return gated_delta_net_cp(self, x_BTD, layout, carry=self.cp_carry), None
        if isinstance(layout, TreeLayout):  # shared prefixes: a branch continues its parent's state
            if state is not None:
                raise ValueError(
                    "GatedDeltaNet: a carried state cannot be combined with a tree layout"
                )
            return gated_delta_net_tree(self, x_BTD, layout), None
        qkv_pre_BTC, z_BTHV, beta_BTH, g_BTH = self.project(x_BTD)
        qkv_BTC, conv_BPC = self.conv1d(
            qkv_pre_BTC, layout, None if state is None else state.conv_BPC, F.silu
        )
        q_BTGK, k_BTGK, v_BTHV = self.split_heads(qkv_BTC, activated=True)
        o_BTHV, S_BHKV = self.recompute.module(
            "linear_attn_core",
            self.core,
            q_BTGK,
            k_BTGK,
            v_BTHV,
            g_BTH,
            beta_BTH,
            layout,
            None if state is None else state.recurrent_BHKV,
        )
        return self.finish(o_BTHV, z_BTHV), GDNState(conv_BPC, S_BHKV)
