"""The Qwen3-MoE architecture: Hugging Face ``qwen3_moe`` config keys in and out."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from bumblebee.models.arch import (
    ArchError,
    BaseArch,
    check_divisible,
    check_field_types,
    check_norm_and_rope,
    check_positive,
    check_silu,
    flatten_rope,
)

ROPE_TYPES = ("default",)  # the RoPE kinds this family implements


@dataclass(kw_only=True)
class Qwen3MoeArch(BaseArch):
    model_type: str = "qwen3_moe"
    vocab_size: int = 272
    hidden_size: int = 128
    intermediate_size: int = 256  # dense-MLP layers only
    moe_intermediate_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    num_experts: int = 8
    num_experts_per_tok: int = 2
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list = field(default_factory=list)
    router_aux_loss_coef: float = 0.001
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    max_position_embeddings: int = 262144
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    attention_bias: bool = False

    def is_moe_layer(self, i: int) -> bool:
        """HF rule: MoE unless listed in mlp_only_layers or off the sparse step."""
        return (
            i not in self.mlp_only_layers
            and self.num_experts > 0
            and (i + 1) % self.decoder_sparse_step == 0
        )

    def validate(self) -> None:
        check_field_types(self)
        check_positive(
            self,
            "vocab_size",
            "hidden_size",
            "moe_intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "decoder_sparse_step",
        )
        check_divisible(self, "num_attention_heads", "num_key_value_heads")
        if self.head_dim % 2:
            raise ArchError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if (
            self.num_experts < 1
        ):  # (HF reads 0 as "every layer dense": not a MoE model to train here)
            raise ArchError(
                f"num_experts must be >= 1 (a MoE model; dense layers go in mlp_only_layers), "
                f"got {self.num_experts}"
            )
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ArchError(
                f"need 1 <= num_experts_per_tok <= num_experts, got "
                f"{self.num_experts_per_tok} and {self.num_experts}"
            )
        check_norm_and_rope(self.rms_norm_eps, self.rope_theta)
        check_silu(self)
        if self.attention_bias:
            raise ArchError("attention_bias = true is not supported (Qwen3 checkpoints have none)")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ArchError(f"mlp_only_layers {bad} out of range 0..{self.num_hidden_layers - 1}")
        if (
            any(not self.is_moe_layer(i) for i in range(self.num_hidden_layers))
            and self.intermediate_size <= 0
        ):
            raise ArchError("dense-MLP layers need intermediate_size > 0")

    # ------------------------------------------------------------------ HF mapping
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> Qwen3MoeArch:
        d = dict(d)
        if "num_local_experts" in d and "num_experts" not in d:
            d["num_experts"] = d["num_local_experts"]
        flatten_rope(d, ROPE_TYPES)
        if d.get("use_sliding_window"):
            raise ArchError("use_sliding_window = true is not supported")
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in names}
        if "head_dim" not in d and "hidden_size" in d and "num_attention_heads" in d:
            kwargs["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
        arch = cls(**kwargs)
        arch.validate()
        return arch

    def to_hf_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        theta = d.pop("rope_theta")
        d["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
        d["architectures"] = ["Qwen3MoeForCausalLM"]
        d["use_sliding_window"] = False
        d["sliding_window"] = None
        d["output_router_logits"] = False
        return d

    # ------------------------------------------------------------------ arithmetic
    def to_spec(self, name: str = "custom"):
        """Parameters, shapes and FLOPs for the planner (models/spec.py)."""
        return self.spec(name, "qwen3_moe", dense_ffn=self.intermediate_size)
