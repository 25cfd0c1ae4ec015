"""Architecture hyper-parameters of GLM-4.5 / 4.6 / 4.7 (HF ``Glm4MoeConfig``).

Field names are HF's ``config.json`` keys; defaults are HF's, so a key a config omits means
what it means to ``transformers`` (``head_dim`` omitted: hidden / heads, as HF's attention
reads it). ``rope_parameters`` is flattened to ``rope_theta`` and ``partial_rotary_factor``
(HF's default 0.5); ``num_mtp_layers`` is read as ``num_nextn_predict_layers``, the MTP depth
(a checkpoint without MTP tensors loads with 0, models/mtp_names.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from bumblebee.models.arch import (
    ArchError,
    BaseArch,
    check_divisible,
    check_field_types,
    check_norm_and_rope,
    check_partial_rotary,
    check_positive,
    check_silu,
    flatten_rope,
)

ROPE_TYPES = ("default",)  # the RoPE kinds this family implements


@dataclass(kw_only=True)
class Glm4MoeArch(BaseArch):
    model_type: str = "glm4_moe"
    vocab_size: int = 151552
    hidden_size: int = 4096
    intermediate_size: int = 10944  # dense layers
    moe_intermediate_size: int = 1408
    num_hidden_layers: int = 46
    first_k_dense_replace: int = 1
    # GQA with optional q/k RMSNorm, q/k/v biases, partial RoPE
    num_attention_heads: int = 96
    num_key_value_heads: int = 8
    head_dim: int = 0  # 0: hidden_size // num_attention_heads (HF's fallback)
    attention_bias: bool = False
    use_qk_norm: bool = False
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.5
    max_position_embeddings: int = 131072
    # MoE: sigmoid router with selection bias, group-limited top-k, shared experts
    n_routed_experts: int = 128
    num_experts_per_tok: int = 8
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    # not an HF key: the balance loss weight (GLM balances with the router bias, as DeepSeek-V3)
    router_aux_loss_coef: float = 0.0001
    num_nextn_predict_layers: int = 0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"

    def __post_init__(self):
        if not self.head_dim and self.num_attention_heads > 0:
            self.head_dim = self.hidden_size // self.num_attention_heads

    # ------------------------------------------------------------------ names the shared code reads
    @property
    def num_experts(self) -> int:
        return self.n_routed_experts

    @property
    def shared_expert_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.n_shared_experts

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense_replace

    def validate(self) -> None:
        check_field_types(self)
        check_norm_and_rope(self.rms_norm_eps, self.rope_theta)
        check_positive(
            self,
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "moe_intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "n_routed_experts",
            "num_experts_per_tok",
            "n_group",
            "topk_group",
        )
        for name in ("n_shared_experts", "first_k_dense_replace", "num_nextn_predict_layers"):
            if getattr(self, name) < 0:
                raise ArchError(f"{name} must be >= 0, got {getattr(self, name)}")
        check_divisible(self, "num_attention_heads", "num_key_value_heads")
        check_partial_rotary(self)
        check_divisible(self, "n_routed_experts", "n_group")
        per_group = self.n_routed_experts // self.n_group
        if not 1 <= self.topk_group <= self.n_group or per_group < 2 and self.n_group > 1:
            raise ArchError(
                f"need 1 <= topk_group <= n_group and >= 2 experts per group, got topk_group "
                f"{self.topk_group}, n_group {self.n_group}, {per_group} experts per group"
            )
        if not 1 <= self.num_experts_per_tok <= self.topk_group * per_group:
            raise ArchError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be within 1..topk_group x "
                f"experts per group ({self.topk_group * per_group})"
            )
        check_silu(self)

    # ------------------------------------------------------------------ HF mapping
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> Glm4MoeArch:
        d = dict(d)
        if "num_mtp_layers" in d and "num_nextn_predict_layers" not in d:
            d["num_nextn_predict_layers"] = d["num_mtp_layers"]
        if "num_local_experts" in d and "n_routed_experts" not in d:
            d["n_routed_experts"] = d["num_local_experts"]
        flatten_rope(d, ROPE_TYPES)
        return cls.from_fields(d)

    def to_hf_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("router_aux_loss_coef")
        d["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": d.pop("rope_theta"),
            "partial_rotary_factor": d.pop("partial_rotary_factor"),
        }
        d["num_mtp_layers"] = self.num_nextn_predict_layers  # HF's field name for the same count
        d["architectures"] = ["Glm4MoeForCausalLM"]
        return d

    # ------------------------------------------------------------------ arithmetic
    def to_spec(self, name: str = "custom"):
        """Parameters, shapes and FLOPs for the planner (models/spec.py)."""
        return self.spec(
            name,
            "glm4_moe",
            attn_bias=self.attention_bias,
            qk_norm=self.use_qk_norm,
            shared_ffn=self.shared_expert_intermediate_size,
            shared_gate=False,
            dense_ffn=self.intermediate_size,
            mtp_depth=self.num_nextn_predict_layers,
        )
