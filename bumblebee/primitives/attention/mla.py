"""Multi-head Latent Attention (MLA; DeepSeek-V2, arXiv:2405.04434 sec. 2.1; DeepSeek-V3).

Keys and values of all heads come from one low-rank latent per token, and RoPE is
carried by a few decoupled dimensions:

    c_kv, k_rope = split(W_kva x)            latent [C] and one shared rope key [R]
    [k_nope_n | v_n] = W_kvb RMSNorm(c_kv)   per head n: [Dn | Dv]
    q = W_qb RMSNorm(W_qa x)  (q LoRA)  or  W_q x;  q_n = [q_nope_n | q_rope_n]
    k_n = [k_nope_n | RoPE(k_rope)],  q_n = [q_nope_n | RoPE(q_rope_n)]
    o = W_o concat_n softmax(q_n k_n^T * scale) v_n

``scale`` is ``(Dn + R)^-0.5``, times ``mscale(factor, mscale_all_dim)^2`` under YaRN
(the cos/sin tables carry the rest of YaRN, ``primitives/rope.py``). With
``rope_interleave`` (HF's default for DeepSeek-V3) the checkpoint's rope dims are laid
out in (even, odd) pairs; they are de-interleaved into the half-split layout first, the
same permutation for q and k, so q.k is unchanged.

The attention core is the configured ``attention`` slot (``cp`` slot when the sequence is
split): it sees ordinary per-head q / k / v, so every core runs MLA. Under context
parallelism the CP group exchanges MLA's per-token latent instead (``cp_latents``, chosen by
bytes: the normalized latent and the roped rope key are C + R values, 1.1 KiB at DeepSeek-V3's
dims, against 96 KiB of expanded K and padded V, 85x; ``benchmarks/mla_cp_bytes.py`` counts
them at the communication calls): ``"allgather"`` all-gathers the latents and every rank
expands the whole row (``kv_b_proj`` over T instead of T / cp tokens); ``"ring"`` passes latent
blocks around the ring and re-expands each block on every hop (``primitives/cp/ring_latent.py``).
``cp_latents = ""`` sends the expanded heads through the ``attend`` core (any other ``cp``
implementation; the benchmark's expanded-head ring).
Cores and the K/V cache expect one head dim for q, k and v: v is zero-padded from Dv to
Dn + R and the output sliced back (exact: the padded columns are 0 forward and get no
gradient). Parameter names follow Hugging Face's ``DeepseekV3Attention``. ``use_rope=False``
keeps the layout and leaves the rope dims unrotated (a shared, position-free key part).

Legend: B batch, T tokens, H hidden, N heads, C kv latent (kv_lora_rank), Q q latent,
Dn nope dims, R rope dims, Dv value dims, D = Dn + R.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bumblebee.primitives.cp.allgather import GatherSequence, attend_gathered
from bumblebee.primitives.cp.ring_latent import latent_ring_attention
from bumblebee.primitives.cp.zigzag import CPShards
from bumblebee.primitives.norms import RMSNorm
from bumblebee.primitives.rope import apply_rope


class MultiHeadLatentAttention(nn.Module):
    def __init__(
        self,
        hidden: int,
        heads: int,
        *,
        q_lora_rank: int,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        eps: float,
        scale: float,
        rope_interleave: bool,
        attend,
        recompute,
        cp_latents: str = "",
        use_rope: bool = True,
    ):
        super().__init__()
        self.n_heads, self.nope, self.rope, self.v_dim = (
            heads,
            qk_nope_head_dim,
            qk_rope_head_dim,
            v_head_dim,
        )
        self.head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.kv_lora_rank, self.q_lora_rank = kv_lora_rank, q_lora_rank
        if q_lora_rank:
            self.q_a_proj = nn.Linear(hidden, q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(q_lora_rank, eps)
            self.q_b_proj = nn.Linear(q_lora_rank, heads * self.head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, eps)
        self.kv_b_proj = nn.Linear(
            kv_lora_rank, heads * (qk_nope_head_dim + v_head_dim), bias=False
        )
        # the latent CP ring reads this weight itself: LoRA (models/lora.py) leaves it frozen
        self.kv_b_proj.reads_weight = True
        self.o_proj = nn.Linear(heads * v_head_dim, hidden, bias=False)
        self.scale, self.rope_interleave = scale, rope_interleave
        self.use_rope = use_rope  # False: the decoupled dims stay, unrotated (a NoPE MLA)
        if cp_latents not in ("", "allgather", "ring"):
            raise ValueError(f"cp_latents must be '', 'allgather' or 'ring', got {cp_latents!r}")
        self.attend, self.recompute, self.cp_latents = attend, recompute, cp_latents

    def _rope(self, x, cos, sin):
        if not self.use_rope:
            return x
        if self.rope_interleave:  # (x0, x1), (x2, x3), ... -> [x0, x2, ... | x1, x3, ...]
            x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
        return apply_rope(x, cos, sin)

    def latents(self, x_BTH):
        """(normalized kv latent [B, T, C], rope key before RoPE [B, 1, T, R]): what MLA needs per token."""
        B, T, _ = x_BTH.shape
        c_kv, k_rope = self.kv_a_proj_with_mqa(x_BTH).split([self.kv_lora_rank, self.rope], dim=-1)
        return self.kv_a_layernorm(c_kv), k_rope.view(B, T, 1, self.rope).transpose(1, 2)

    def forward(self, x_BTH, cos, sin, layout):
        B, T, _ = x_BTH.shape
        q = (
            self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BTH)))
            if self.q_lora_rank
            else self.q_proj(x_BTH)
        )
        q_nope, q_rope = (
            q.view(B, T, self.n_heads, self.head_dim)
            .transpose(1, 2)
            .split([self.nope, self.rope], -1)
        )
        c_kv, k_rope = self.latents(x_BTH)
        k_rope, attend = self._rope(k_rope, cos, sin), self.attend
        q = torch.cat((q_nope, self._rope(q_rope, cos, sin)), dim=-1)
        if self.cp_latents == "ring" and isinstance(
            layout, CPShards
        ):  # latent blocks around the ring
            lat = torch.cat((c_kv, k_rope[:, 0]), dim=-1).to(
                q.dtype
            )  # the dtype kv_b_proj computes in
            o_BNTV = self.recompute.module(
                "attn_core",
                latent_ring_attention,
                q,
                lat,
                self.kv_b_proj.weight,
                layout,
                self.scale,
                self.v_dim,
            )
            return self.o_proj(o_BNTV.transpose(1, 2).reshape(B, T, -1))
        if self.cp_latents == "allgather" and isinstance(
            layout, CPShards
        ):  # the row's latents, global order
            latent = GatherSequence.apply(torch.cat((c_kv[:, None], k_rope), dim=-1), layout)
            c_kv, k_rope = latent[:, 0].split([self.kv_lora_rank, self.rope], dim=-1)
            k_rope, attend, T = k_rope[:, None], attend_gathered, latent.shape[2]
        kv = self.kv_b_proj(c_kv).view(B, T, self.n_heads, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat((k_nope, k_rope.expand(-1, self.n_heads, -1, -1)), dim=-1)
        if self.v_dim < self.head_dim:
            v = F.pad(v, (0, self.head_dim - self.v_dim))
        o_BNTD = self.recompute.module("attn_core", attend, q, k, v, layout, self.scale)
        T = x_BTH.shape[1]
        return self.o_proj(o_BNTD[..., : self.v_dim].transpose(1, 2).reshape(B, T, -1))
