"""What an MLA layer would exchange per token under context parallelism: expanded heads or latents.

Builds one Multi-head Latent Attention layer at a preset's real dims (default DeepSeek-V3; bf16
on the meta device, so no weights are allocated), runs it on a few tokens with an attention core
that records the K and V the ``cp`` slot would send around the ring, and compares their bytes per
token with the latent MLA computes per token (``c_kv`` + the shared rope key). Also prints the
FLOPs a receiver would spend re-expanding a latent block (``kv_b_proj``) per token and hop.
Figures are printed, never asserted.

    python benchmarks/mla_cp_bytes.py [--preset deepseek-v3-671b|kimi-k2] [--tokens 8]
"""

from __future__ import annotations

import argparse

import torch

from bumblebee.models import arch_from_hf_dict
from bumblebee.models.deepseek_v3 import mla_scale
from bumblebee.models.presets import preset
from bumblebee.primitives.attention.mla import MultiHeadLatentAttention
from bumblebee.primitives.recompute import NoRecompute
from bumblebee.primitives.rope import rope_cos_sin


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="deepseek-v3-671b")
    ap.add_argument("--tokens", type=int, default=8)
    args = ap.parse_args()
    a = arch_from_hf_dict(preset("deepseek_v3", args.preset))
    seen = {}

    def core(q, k, v, layout, scale):  # what a CP ring hop carries: this block's K and V
        seen["kv_bytes"] = k.numel() * k.element_size() + v.numel() * v.element_size()
        return torch.empty_like(q)

    with torch.device("meta"):
        layer = MultiHeadLatentAttention(
            a.hidden_size, a.num_attention_heads, q_lora_rank=a.q_lora_rank, kv_lora_rank=a.kv_lora_rank,
            qk_nope_head_dim=a.qk_nope_head_dim, qk_rope_head_dim=a.qk_rope_head_dim, v_head_dim=a.v_head_dim,
            eps=a.rms_norm_eps, scale=mla_scale(a), rope_interleave=a.rope_interleave, attend=core,
            recompute=NoRecompute()).to(torch.bfloat16)
        x = torch.empty(1, args.tokens, a.hidden_size, dtype=torch.bfloat16)
        pos = torch.arange(args.tokens)[None]
        cos, sin = rope_cos_sin(pos, a.qk_rope_head_dim, a.rope_theta, torch.bfloat16)
        layer(x, cos, sin, None)
        c_kv, k_rope = layer.latents(x)
    latent = (c_kv.numel() * c_kv.element_size() + k_rope.numel() * k_rope.element_size()) / args.tokens
    expanded = seen["kv_bytes"] / args.tokens
    expand_flops = 2 * a.kv_lora_rank * a.num_attention_heads * (a.qk_nope_head_dim + a.v_head_dim)
    print(f"{args.preset}: heads {a.num_attention_heads}, qk head dim {a.head_dim}, v head dim {a.v_head_dim}, "
          f"kv latent {a.kv_lora_rank} + rope {a.qk_rope_head_dim} (bf16)")
    print(f"  expanded K + V sent per token and hop (v padded to {a.head_dim}): {expanded / 1024:8.1f} KiB")
    print(f"  latent c_kv + rope key per token:                       {latent / 1024:8.2f} KiB  "
          f"({expanded / latent:.0f}x fewer bytes)")
    print(f"  re-expanding a received latent (kv_b_proj) per token and hop: {expand_flops / 1e6:.1f} MFLOP forward")


if __name__ == "__main__":
    main()
