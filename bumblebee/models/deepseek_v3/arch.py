"""Architecture hyper-parameters of DeepSeek-V3 (HF ``DeepseekV3Config``; also Kimi-K2 and R1).

Field names are HF's ``config.json`` keys; defaults are HF's (the DeepSeek-V3 671B model),
so a key a config omits means what it means to ``transformers``. Departures, all lossless:
``q_lora_rank = 0`` stands for HF's ``null`` (a plain ``q_proj``); ``rope_parameters`` is
kept as HF's dict (``rope_type`` ``default`` or ``yarn``); ``num_nextn_predict_layers``
(HF alias ``num_mtp_layers``) is the number of multi-token-prediction modules the model
holds (``models/mtp.py``; a checkpoint without their tensors loads with 0).
"""

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
    check_rope_type,
    check_silu,
    hf_rope,
    rope_theta_of,
)

ROPE_TYPES = ("default", "yarn")  # the RoPE kinds this family implements

_DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}


@dataclass(kw_only=True)
class DeepseekV3Arch(BaseArch):
    model_type: str = "deepseek_v3"
    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432  # dense layers
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    first_k_dense_replace: int = 3
    # Multi-head Latent Attention
    num_attention_heads: int = 128
    q_lora_rank: int = 1536  # 0: no q compression (HF null)
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_interleave: bool = True
    rope_parameters: dict = field(default_factory=lambda: dict(_DEFAULT_ROPE))
    max_position_embeddings: int = 4096
    # MoE: sigmoid router with selection bias, group-limited top-k, shared experts
    n_routed_experts: int = 256
    num_experts_per_tok: int = 8
    n_shared_experts: int = 1
    n_group: int = 8
    topk_group: int = 4
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    # not an HF key: weight of the (batch-wise) balance loss; DeepSeek-V3 balances with the router bias
    # and a sequence-wise loss of weight 1e-4 (report sec. 2.1.2), hence the small default
    router_aux_loss_coef: float = 0.0001
    # multi-token prediction
    num_nextn_predict_layers: int = 0
    # rest
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    attention_bias: bool = False

    # ------------------------------------------------------------------ names the shared code reads
    @property
    def num_experts(self) -> int:
        return self.n_routed_experts

    @property
    def num_key_value_heads(self) -> int:
        return self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def rope_theta(self) -> float:
        return float(self.rope_parameters.get("rope_theta", 10000.0))

    @property
    def shared_expert_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.n_shared_experts

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense_replace

    def validate(self) -> None:
        check_field_types(self)
        check_positive(
            self,
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "moe_intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
            "n_routed_experts",
            "num_experts_per_tok",
            "n_group",
            "topk_group",
        )
        for name in (
            "q_lora_rank",
            "n_shared_experts",
            "first_k_dense_replace",
            "num_nextn_predict_layers",
        ):
            if getattr(self, name) < 0:
                raise ArchError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.qk_rope_head_dim % 2:
            raise ArchError(
                f"qk_rope_head_dim must be even for rotary embeddings, got {self.qk_rope_head_dim}"
            )
        if self.v_head_dim > self.head_dim:
            raise ArchError(
                f"v_head_dim ({self.v_head_dim}) must be <= qk_nope_head_dim + qk_rope_head_dim "
                f"({self.head_dim})"
            )
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
        if self.attention_bias:
            raise ArchError(
                "attention_bias = true is not supported (DeepSeek-V3 checkpoints have none)"
            )
        check_rope_type(self.rope_parameters, ROPE_TYPES)
        check_norm_and_rope(self.rms_norm_eps, rope_theta_of(self.rope_parameters, 10000.0))

    # ------------------------------------------------------------------ HF mapping
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> DeepseekV3Arch:
        d = dict(d)
        if "num_mtp_layers" in d and "num_nextn_predict_layers" not in d:
            d["num_nextn_predict_layers"] = d["num_mtp_layers"]
        if "num_local_experts" in d and "n_routed_experts" not in d:
            d["n_routed_experts"] = d["num_local_experts"]
        d["rope_parameters"] = hf_rope(d, theta=10000.0)
        heads, kv_heads = d.get("num_attention_heads"), d.get("num_key_value_heads")
        if kv_heads is not None and heads is not None and kv_heads != heads:
            raise ArchError(
                f"num_key_value_heads ({kv_heads}) must equal num_attention_heads ({heads}) in MLA"
            )
        if d.get("q_lora_rank", 1) is None:
            d["q_lora_rank"] = 0
        return cls.from_fields(d)

    def to_hf_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("router_aux_loss_coef")
        d["q_lora_rank"] = self.q_lora_rank or None
        d["num_key_value_heads"] = self.num_attention_heads
        d["architectures"] = ["DeepseekV3ForCausalLM"]
        return d

    # ------------------------------------------------------------------ arithmetic
    def to_spec(self, name: str = "custom"):
        """Parameters, shapes and FLOPs for the planner (models/spec.py)."""
        return self.spec(
            name,
            "deepseek_v3",
            shared_ffn=self.shared_expert_intermediate_size,
            shared_gate=False,
            dense_ffn=self.intermediate_size,
            mla_q_rank=self.q_lora_rank,
            mla_kv_rank=self.kv_lora_rank,
            mla_rope_dim=self.qk_rope_head_dim,
            mla_v_dim=self.v_head_dim,
            mtp_depth=self.num_nextn_predict_layers,
        )
