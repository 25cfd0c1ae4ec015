"""DeepSeek-V3 (also DeepSeek-R1 and Kimi-K2 checkpoints) composed from primitives.

Decoder layer i: x + MLA(RMSNorm(x)), then h + FFN(RMSNorm(h)) with

- MLA: Multi-head Latent Attention (``primitives/attention/mla.py``); its core is the
  ``attention`` slot (the ``cp`` slot when the sequence is split), on RoPE or YaRN tables
  (``primitives/rope.py``) over the decoupled rope dims;
- FFN: a dense SwiGLU on the first ``first_k_dense_replace`` layers, then routed experts
  (router, expert FFN and dispatch slots, as Qwen3-MoE) plus ``n_shared_experts`` ungated
  shared experts (one SwiGLU of ``n_shared_experts x moe_intermediate_size``);
- router: the ``router`` slot's ``sigmoid_bias`` (primitives/moe/sigmoid_bias.py): sigmoid
  scores, a selection-only bias ``e_score_correction_bias`` (aux-loss-free balancing,
  DeepSeek-V3 report arXiv:2412.19437 sec. 2.1.2), group-limited top-k, the kept scores
  renormalized and scaled by ``routed_scaling_factor``.

Module and parameter names follow HF's ``DeepseekV3ForCausalLM`` (experts stacked, see
``models/hf.py``). Multi-token prediction modules (``models/mtp.py``) are held as ``mtp.{k}``
and stored by DeepSeek as ``model.layers.{num_hidden_layers + k}`` (``hf_name_in`` / ``hf_name_out``;
the checkpoint's per-module copies of the embedding and LM head are the shared ones: skipped on
load, written again by every export through ``hf_copies``).

Legend: B batch, T tokens, H hidden, E experts, K experts per token, G expert groups.
"""

from __future__ import annotations

from torch import nn

from bumblebee.models import blocks
from bumblebee.models.base import CausalLM, LayerParts
from bumblebee.models.deepseek_v3.arch import DeepseekV3Arch
from bumblebee.models.kv_cache import KVCache
from bumblebee.models.mtp import combine
from bumblebee.primitives.attention.mla import MultiHeadLatentAttention
from bumblebee.primitives.norms import RMSNorm
from bumblebee.primitives.rope import yarn_mscale

ROUTER = "sigmoid_bias"  # the architecture's router


# the architecture's MoE block (HF ``DeepseekV3MoE``): the router above and ungated shared experts
MOE_TRAITS = {"router": ROUTER, "shared": "ungated"}


def mla_scale(arch: DeepseekV3Arch) -> float:
    """Softmax scale: D^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN (HF's rule)."""
    scale, rope = arch.head_dim**-0.5, arch.rope_parameters
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        scale *= yarn_mscale(rope["factor"], rope["mscale_all_dim"]) ** 2
    return scale


def mla_args(arch: DeepseekV3Arch, parts: LayerParts, eps: float | None = None) -> dict:
    """MLA's keyword arguments from the arch (``eps``: the latent norms' epsilon, default the arch's)."""
    return dict(
        q_lora_rank=arch.q_lora_rank,
        kv_lora_rank=arch.kv_lora_rank,
        qk_nope_head_dim=arch.qk_nope_head_dim,
        qk_rope_head_dim=arch.qk_rope_head_dim,
        v_head_dim=arch.v_head_dim,
        eps=arch.rms_norm_eps if eps is None else eps,
        scale=mla_scale(arch),
        rope_interleave=arch.rope_interleave,
        attend=parts.attend,
        recompute=parts.recompute,
        cp_latents=parts.prims.cp
        if parts.groups.cp_size > 1 and parts.prims.cp in ("allgather", "ring")
        else "",
    )


class DecoderLayer(blocks.DecoderLayer):
    """The shared pre-norm layer over MLA and the architecture's MoE (dense SwiGLU on the first
    ``first_k_dense_replace`` layers; ``moe``: MoE regardless)."""

    def __init__(self, arch: DeepseekV3Arch, idx: int, parts: LayerParts, moe: bool | None = None):
        attention = self.make_attention(arch, parts)
        mlp = blocks.feed_forward(arch, idx, parts, moe, **MOE_TRAITS)
        super().__init__(arch, parts, attention, mlp)

    def make_attention(self, arch, parts: LayerParts) -> nn.Module:
        """MLA (a family built on DeepSeek-V3's layer swaps in its own attention here)."""
        return MultiHeadLatentAttention(
            arch.hidden_size, arch.num_attention_heads, **mla_args(arch, parts)
        )


class SharedHead(nn.Module):
    """HF ``shared_head``: the MTP output norm (its ``head`` is the main LM head, shared)."""

    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(hidden, eps)


def mtp_layer_class(decoder: type) -> type:
    """One MTP depth in DeepSeek's layout (``models/mtp.py``), stored as ``model.layers.{L + k}``:
    a MoE ``decoder`` layer plus ``enorm``, ``hnorm``, ``eh_proj`` and ``shared_head.norm`` (GLM
    ships the same layout over its own decoder layer)."""

    class MTPLayer(decoder):
        def __init__(self, arch, parts: LayerParts):
            super().__init__(arch, arch.num_hidden_layers, parts, moe=True)
            self.enorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
            self.hnorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
            self.eh_proj = nn.Linear(2 * arch.hidden_size, arch.hidden_size, bias=False)
            self.shared_head = SharedHead(arch.hidden_size, arch.rms_norm_eps)

        def forward(self, h_BTH, emb_BTH, cos, sin, layout):
            x, aux = super().forward(
                combine(self.enorm, self.hnorm, self.eh_proj, emb_BTH, h_BTH), cos, sin, layout
            )
            return self.shared_head.norm(x), aux

    return MTPLayer


class LayerMTP:
    """The causal LM's MTP hooks for DeepSeek-layout modules (``mtp_layer``, built by
    ``mtp_layer_class``), counted by ``arch.num_nextn_predict_layers``."""

    mtp_layer: type

    def make_mtp(self, parts: LayerParts):
        n = self.arch.num_nextn_predict_layers
        return nn.ModuleList([self.mtp_layer(self.arch, parts) for _ in range(n)]) if n else None

    def mtp_modules(self) -> int:
        return 0 if self.mtp is None else len(self.mtp)

    def mtp_forward(self, k: int, h_BTH, emb_BTH, cos, sin, layout):
        return self.recompute.layer(self.mtp[k], h_BTH, emb_BTH, cos, sin, layout)

    def mtp_units(self) -> list[nn.Module]:
        return list(self.mtp)


class DeepseekV3ForCausalLM(LayerMTP, CausalLM):
    """DeepSeek-V3: the shared causal LM (models/base.py) over MLA + MoE decoder layers."""

    family = "deepseek_v3"
    norm_cls = RMSNorm
    mtp_layer = mtp_layer_class(DecoderLayer)

    def make_layer(self, index: int, parts: LayerParts, moe: bool | None = None) -> nn.Module:
        return DecoderLayer(self.arch, index, parts, moe)

    def rotary_dim(self) -> int:
        return self.arch.qk_rope_head_dim

    def new_kv_cache(self, rows: int, length: int) -> KVCache:
        """Expanded per-head keys / values (v zero-padded to the q/k head dim, as MLA attends)."""
        a, w = self.arch, self.lm_head_weight
        return KVCache(
            len(self.decoder_layers),
            rows,
            a.num_attention_heads,
            length,
            a.head_dim,
            w.dtype,
            w.device,
        )
