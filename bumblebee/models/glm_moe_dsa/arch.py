"""Architecture of GLM-5 (HF ``glm_moe_dsa``): DeepSeek-V3.2's layer (MLA + DeepSeek Sparse
Attention, DeepSeek-V3's MoE) with GLM's dimensions and an interleaved indexer RoPE.

Defaults are HF's ``GlmMoeDsaConfig``. HF's cross-layer top-k sharing (``indexer_types``
"shared": a layer reuses the previous full layer's selection) is not built: a config must
give every layer its own indexer ("full", HF's default pattern).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bumblebee.models.arch import ArchError
from bumblebee.models.deepseek_v32.arch import DeepseekV32Arch


@dataclass(kw_only=True)
class GlmMoeDsaArch(DeepseekV32Arch):
    model_type: str = "glm_moe_dsa"
    vocab_size: int = 154880
    hidden_size: int = 6144
    intermediate_size: int = 12288
    num_hidden_layers: int = 78
    num_attention_heads: int = 64
    q_lora_rank: int = 2048
    qk_nope_head_dim: int = 192
    v_head_dim: int = 256
    n_group: int = 1
    topk_group: int = 1
    max_position_embeddings: int = 202752
    rms_norm_eps: float = 1e-5
    index_n_heads: int = 32
    hf_architecture = "GlmMoeDsaForCausalLM"
    index_rope_interleave = True

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]):
        d = dict(d)
        types = d.pop("indexer_types", None)
        pattern = d.pop("index_topk_pattern", None)
        freq = d.pop("index_topk_freq", 1)
        if pattern is not None and types is None:
            types = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern]
        if types is None and max(freq or 1, 1) > 1:
            types = ["shared"]  # HF derives shared layers from a frequency above 1
        if types is not None and any(t != "full" for t in types):
            raise ArchError(
                "indexer_types other than 'full' (cross-layer top-k sharing) are not supported"
            )
        return super().from_hf_dict(d)

    def to_hf_dict(self) -> dict[str, Any]:
        d = super().to_hf_dict()
        d["indexer_types"] = ["full"] * self.num_hidden_layers
        return d
