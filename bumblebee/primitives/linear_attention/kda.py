"""The Kimi Delta Attention token mixer (KDA; Kimi Team, "Kimi Linear: An Expressive, Efficient
Attention Architecture", arXiv:2510.26692), with HF ``KimiLinearDeltaAttention``'s names.

KDA is the gated delta rule with a per-channel forget gate: Gated DeltaNet's decay a_t (one
scalar per head) becomes a vector over the K key channels,

    S_t = diag(a_t) (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T,     o_t = S_t^T q_t

(the decay is applied to S_{t-1} before the delta step, as in the scalar rule). Per layer:

    q, k, v = q_proj(x), k_proj(x), v_proj(x) -> one depthwise causal conv each -> SiLU
    g    = -exp(A_log) * softplus(f_b_proj(f_a_proj(x)) + dt_bias)   # [H, K] log decay, fp32
    beta = sigmoid(b_proj(x))                                          # [H]
    o    = gated_delta_rule(q, k, v, g, beta)                          # ``linear_attention`` slot
    y    = o_proj(RMSNorm(o) * w * sigmoid(g_b_proj(g_a_proj(x))))     # all in fp32, then cast

H heads with K = V = ``head_dim`` and no grouped keys. The decay and output gates are low rank
(through ``head_dim``). The core is the same ``linear_attention`` slot as Gated DeltaNet: its
implementations take g [B, T, H, K] as well as [B, T, H]. The layer shares ``GatedDeltaNet``'s
interface (``project``, ``conv1d``, ``split_heads``, ``finish``), so its forward, the carried
``GDNState`` and context parallelism (``cp.py``: the affine scan, or the relay) are Gated
DeltaNet's, unchanged: the scan's probe runs the core on [v | 0] from [0 | I], which carries a
per-channel decay exactly as a scalar one (the transition stays a dense [K, K] map, so the bytes
exchanged equal Gated DeltaNet's at the same H, K, V).

The three convs are stored apart (HF checkpoints: ``q_conv1d``, ``k_conv1d``, ``v_conv1d``);
``conv1d`` runs them as one conv over [q | k | v] channels (weights concatenated per call).

Legend: B batch, T tokens, D hidden, H heads, K key dim (= V value dim), R gate rank (= K).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from bumblebee.primitives import init
from bumblebee.primitives.linear_attention.conv import CausalConv1d
from bumblebee.primitives.linear_attention.gdn import GatedDeltaNet
from bumblebee.primitives.recompute import lean


class JointConv:
    """Separate q / k / v depthwise convs run as one over the concatenated channels (the
    ``CausalConv1d`` call the Gated DeltaNet forward and its CP path make)."""

    _fused = staticmethod(CausalConv1d._fused)
    __call__ = CausalConv1d.forward

    def __init__(self, *convs: CausalConv1d):
        self.convs = convs

    @property
    def weight(self) -> torch.Tensor:
        return torch.cat([c.weight for c in self.convs])

    @property
    def window(self) -> int:
        return self.convs[0].window


def sigmoid_gated_rms_norm(x, z, weight, eps: float):
    """HF ``KimiLinearRMSNormGated``: fp32 ``w * rmsnorm(x) * sigmoid(z)``, cast to x's dtype."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * x32 * torch.sigmoid(z.float())).to(x.dtype)


class SigmoidGatedRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x, z):
        # autograd keeps x and z: the fp32 temporaries are rebuilt in backward
        return lean(sigmoid_gated_rms_norm, x, z, self.weight, self.eps)


def inverse_softplus_dt(lo: float = 1e-3, hi: float = 1e-1):
    """dt_bias = softplus^-1(dt), dt = exp(U(log lo, log hi)) (FLA's / HF's KDA init)."""

    def fill(t: torch.Tensor, g: torch.Generator) -> None:
        dt = t.uniform_(math.log(lo), math.log(hi), generator=g)
        dt = dt.exp_().clamp_min_(1e-4)
        t.copy_(dt + torch.log(-torch.expm1(-dt)))

    return fill


class KimiDeltaAttention(GatedDeltaNet):
    """One KDA layer; ``core`` is a ``linear_attention`` implementation (per-channel gates)."""

    def __init__(self, hidden: int, heads: int, head_dim: int, conv_kernel: int, eps: float,
                 core: Callable, recompute, cp_carry: str = "scan"):  # fmt: skip
        nn.Module.__init__(self)  # GatedDeltaNet's projections are not this layer's
        if min(hidden, heads, head_dim, conv_kernel) <= 0:
            raise ValueError("KimiDeltaAttention: all sizes must be positive")
        self.G = self.H = heads
        self.K = self.V = head_dim
        dim = heads * head_dim
        self.q_proj, self.k_proj, self.v_proj = (
            nn.Linear(hidden, dim, bias=False) for _ in range(3)
        )
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (
            CausalConv1d(dim, conv_kernel) for _ in range(3)
        )
        self.f_a_proj = nn.Linear(hidden, head_dim, bias=False)
        self.f_b_proj = nn.Linear(head_dim, dim, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(dim))
        self.A_log = nn.Parameter(torch.empty(1, 1, heads, 1))  # HF's shape
        self.b_proj = nn.Linear(hidden, heads, bias=False)
        self.g_a_proj = nn.Linear(hidden, head_dim, bias=False)
        self.g_b_proj = nn.Linear(head_dim, dim, bias=False)
        self.o_norm = SigmoidGatedRMSNorm(head_dim, eps)
        self.o_proj = nn.Linear(dim, hidden, bias=False)
        self.core, self.recompute, self.cp_carry = core, recompute, cp_carry
        self.reset_parameters()

    _MATRICES = ("q_proj", "k_proj", "v_proj", "q_conv1d", "k_conv1d", "v_conv1d", "f_a_proj",
                 "f_b_proj", "b_proj", "g_a_proj", "g_b_proj", "o_proj")  # fmt: skip

    @property
    def conv1d(self) -> JointConv:
        return JointConv(self.q_conv1d, self.k_conv1d, self.v_conv1d)

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        if self.A_log.is_meta or is_fake(self.A_log):  # shapes only (filled later, or never)
            return
        gen = torch.Generator().manual_seed(int(torch.randint(0, 2**62, (), device="cpu")))
        for name, fill in self.init_rules(std).items():
            fill(self.get_parameter(name).data, gen)

    def init_rules(self, std: float = 0.02) -> dict:
        """HF's init as fill rules: matrices normal(0, std), A = exp(A_log) ~ U(1, 16), dt_bias
        the inverse softplus of dt ~ logU(1e-3, 1e-1), norm weight 1."""
        rules = {f"{n}.weight": init.normal(std) for n in self._MATRICES}
        return {
            **rules,
            "A_log": init.log_uniform(1.0, 16.0),
            "dt_bias": inverse_softplus_dt(),
            "o_norm.weight": init.const(1.0),
        }

    def project(self, x_BTD: torch.Tensor):
        """(pre-conv [q | k | v] [B, T, 3HK], output gate [B, T, H, V], beta [B, T, H], per-channel
        log decay g [B, T, H, K] fp32). Per token: any token order works."""
        B, T, _ = x_BTD.shape
        H, K = self.H, self.K
        qkv_pre_BTC = torch.cat([self.q_proj(x_BTD), self.k_proj(x_BTD), self.v_proj(x_BTD)], -1)
        z_BTHV = self.g_b_proj(self.g_a_proj(x_BTD)).view(B, T, H, self.V)
        beta_BTH = torch.sigmoid(self.b_proj(x_BTD))
        f_BTC = self.f_b_proj(self.f_a_proj(x_BTD)).float() + self.dt_bias.float()
        g_BTHK = -self.A_log.float().exp() * F.softplus(f_BTC.view(B, T, H, K))
        return qkv_pre_BTC, z_BTHV, beta_BTH, g_BTHK

    def finish(self, o_BTHV: torch.Tensor, z_BTHV: torch.Tensor) -> torch.Tensor:
        B, T = o_BTHV.shape[:2]
        return self.o_proj(self.o_norm(o_BTHV, z_BTHV).reshape(B, T, self.H * self.V))
