"""Architecture of DeepSeek-V3.2 (HF ``deepseek_v32``): DeepSeek-V3's plus the lightning indexer.

Field names and defaults are HF's ``DeepseekV32Config``. Departures from DeepSeek-V3's arch:
the main attention's RoPE is always interleaved (HF has no ``rope_interleave`` key here), the
q LoRA is required (the indexer reads its normalized latent), and ``mlp_layer_types``, when a
config states it, must be the ``first_k_dense_replace`` pattern (the only one built).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from bumblebee.models.arch import ArchError
from bumblebee.models.deepseek_v3.arch import DeepseekV3Arch


@dataclass(kw_only=True)
class DeepseekV32Arch(DeepseekV3Arch):
    model_type: str = "deepseek_v32"
    max_position_embeddings: int = 163840
    index_topk: int = 2048  # keys each query's main attention reads
    index_head_dim: int = 128
    index_n_heads: int = 64
    # not HF keys: how the family's layers differ (class-level, not in config.json)
    hf_architecture = "DeepseekV32ForCausalLM"
    index_rope_interleave = False  # the indexer's RoPE: half-split (GLM-5: interleaved pairs)
    latent_norm_eps = 1e-6  # HF builds q_a_layernorm / kv_a_layernorm with its default eps

    def validate(self) -> None:
        super().validate()
        for name in ("q_lora_rank", "index_topk", "index_head_dim", "index_n_heads"):
            if getattr(self, name) <= 0:
                raise ArchError(f"{name} must be positive, got {getattr(self, name)}")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ArchError(
                f"index_head_dim ({self.index_head_dim}) must be >= qk_rope_head_dim "
                f"({self.qk_rope_head_dim}): the indexer ropes its first qk_rope_head_dim dims"
            )
        if not self.rope_interleave:
            raise ArchError(f"{self.model_type} always interleaves the main attention's RoPE")

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]):
        d = dict(d)
        types = d.pop("mlp_layer_types", None)
        if d.get("q_lora_rank", 1) is None:
            raise ArchError(
                f"{cls.model_type}: q_lora_rank = null is not supported (the indexer reads q)"
            )
        layers, dense = d.get("num_hidden_layers", 61), d.get("first_k_dense_replace", 3)
        if types is not None:
            want = ["dense"] * min(dense, layers) + ["sparse"] * max(layers - dense, 0)
            if list(types) != want:
                raise ArchError(
                    f"mlp_layer_types must be first_k_dense_replace ({dense}) dense layers then "
                    f"sparse ones, got {types}"
                )
        d.pop("rope_interleave", None)
        return super().from_hf_dict(d)

    def to_hf_dict(self) -> dict[str, Any]:
        d = super().to_hf_dict()
        d.pop("rope_interleave")
        d["architectures"] = [self.hf_architecture]
        return d

    def to_spec(self, name: str = "custom"):
        return dataclasses.replace(
            super().to_spec(name),
            family=self.model_type,
            dsa_topk=self.index_topk,
            dsa_heads=self.index_n_heads,
            dsa_dim=self.index_head_dim,
        )
