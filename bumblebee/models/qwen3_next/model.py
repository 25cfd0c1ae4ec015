"""Qwen3-Next composed from primitives: Qwen3.5's hybrid (``qwen3_5_moe/model.py``) with
Qwen3-Next's checkpoint layout.

Decoder layer i (``arch.layer_types[i]``): x + Mixer(ZeroCenteredRMSNorm(x)), then
h + MLP(ZeroCenteredRMSNorm(h)), where the mixer is Qwen3.5's gated full attention or a Gated
DeltaNet, and the MLP is Qwen3.5's routed + sigmoid-gated shared expert block (a dense SwiGLU
on the layers HF marks dense). What differs from Qwen3.5 is the GDN's projections:
``in_proj_qkvz`` and ``in_proj_ba`` (HF ``Qwen3NextGatedDeltaNet``) are fused and grouped per
key head, [q (K) | k (K) | v (r x V) | z (r x V)] and [b (r) | a (r)] for each of the G key
heads (r = H / G value heads per key head). ``FusedGatedDeltaNet.project`` regroups them into
the [q | k | v] conv channels of the shared primitive, so the conv, the ``linear_attention``
core and its context-parallel carry (``primitives/linear_attention/cp.py``) are Qwen3.5's.

MTP: the released ``mtp.*`` head has Qwen3.5's layout and is Qwen3.5's ``MultiTokenPredictor``.

Legend: B batch, T tokens, D hidden, G key heads, H value heads, K key dim, V value dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bumblebee.models.qwen3_5_moe.model import Qwen3_5MoeForCausalLM
from bumblebee.primitives import init
from bumblebee.primitives.linear_attention.gdn import GatedDeltaNet

_SPLIT_PROJ = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")


class FusedGatedDeltaNet(GatedDeltaNet):
    """The shared Gated DeltaNet with HF ``Qwen3NextGatedDeltaNet``'s fused projections."""

    def __init__(self, hidden: int, *args, **kwargs):
        super().__init__(hidden, *args, **kwargs)
        for name in _SPLIT_PROJ:
            delattr(self, name)
        G, H, K, V = self.G, self.H, self.K, self.V
        self.in_proj_qkvz = nn.Linear(hidden, 2 * G * K + 2 * H * V, bias=False)
        self.in_proj_ba = nn.Linear(hidden, 2 * H, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        if not hasattr(self, "in_proj_ba"):  # (the base constructor's call, before the swap)
            return super().reset_parameters(std)
        for lin in (self.in_proj_qkvz, self.in_proj_ba, self.out_proj, self.conv1d):
            lin.weight.normal_(0.0, std)
        self.dt_bias.fill_(1.0)
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(0.01, 16).log_())
        self.norm.weight.fill_(1.0)

    def init_rules(self, std: float = 0.02) -> dict:
        rules = {k: v for k, v in super().init_rules(std).items() if k[:-7] not in _SPLIT_PROJ}
        rules.update({f"{n}.weight": init.normal(std) for n in ("in_proj_qkvz", "in_proj_ba")})
        return rules

    def project(self, x_BTD: torch.Tensor):
        B, T, _ = x_BTD.shape
        G, H, K, V = self.G, self.H, self.K, self.V
        r = H // G
        q, k, v, z = (
            self.in_proj_qkvz(x_BTD)
            .view(B, T, G, 2 * K + 2 * r * V)
            .split([K, K, r * V, r * V], dim=-1)
        )
        b, a = self.in_proj_ba(x_BTD).view(B, T, G, 2 * r).split([r, r], dim=-1)
        qkv_pre_BTC = torch.cat(
            [q.reshape(B, T, G * K), k.reshape(B, T, G * K), v.reshape(B, T, H * V)], dim=-1
        )
        beta_BTH = torch.sigmoid(b.reshape(B, T, H))
        g_BTH = -self.A_log.float().exp() * F.softplus(a.reshape(B, T, H).float() + self.dt_bias)
        return qkv_pre_BTC, z.reshape(B, T, H, V), beta_BTH, g_BTH


class Qwen3NextForCausalLM(Qwen3_5MoeForCausalLM):
    """Qwen3-Next: Qwen3.5's causal LM with the fused-projection Gated DeltaNet."""

    family = "qwen3_next"
    linear_mixer = FusedGatedDeltaNet
