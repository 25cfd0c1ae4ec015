"""Architecture hyper-parameters of gpt-oss (HF ``GptOssConfig``).

Field names are HF's ``config.json`` keys; defaults are HF's (gpt-oss-20b's dimensions), so a
key a config omits means what it means to ``transformers``: ``layer_types`` omitted alternates
sliding-window and full attention starting with a sliding layer; ``rope_parameters`` omitted is
HF's YaRN default (factor 32 over 4096 original positions, beta 32 / 1, not truncated,
``rope_theta`` 150000). ``rope_parameters`` is kept as HF's dict (``rope_type`` ``yarn`` or
``default``, ``rope_theta`` inside). The expert FFN is ``intermediate_size`` (gpt-oss has no
dense MLP); ``moe_intermediate_size`` / ``num_experts`` are the names the shared code reads.
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

_DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
    "rope_theta": 150000.0,
}
LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass(kw_only=True)
class GptOssArch(BaseArch):
    # what a config.json must state (its expert FFN is ``intermediate_size``)
    REQUIRED_HF_KEYS = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "num_experts_per_tok",
    )

    model_type: str = "gpt_oss"
    vocab_size: int = 201088
    hidden_size: int = 2880
    intermediate_size: int = 2880  # per expert
    num_hidden_layers: int = 24
    # GQA with biases on q/k/v/o, per-head sinks; sliding-window layers per ``layer_types``
    num_attention_heads: int = 64
    num_key_value_heads: int = 8
    head_dim: int = 64
    attention_bias: bool = True
    sliding_window: int = 128
    layer_types: list = field(default_factory=list)  # [] -> HF's alternation
    rope_parameters: dict = field(default_factory=lambda: dict(_DEFAULT_ROPE))
    max_position_embeddings: int = 131072
    # MoE: biased router, top-k logits then softmax; experts with biases and a clamped SwiGLU
    num_local_experts: int = 32
    num_experts_per_tok: int = 4
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    router_aux_loss_coef: float = 0.001  # HF's default
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"

    def __post_init__(self):
        if not self.layer_types and isinstance(self.num_hidden_layers, int):
            self.layer_types = [LAYER_TYPES[i % 2] for i in range(self.num_hidden_layers)]

    def with_overrides(self, overrides: dict[str, Any]):
        """A new layer count without ``layer_types`` takes HF's alternation for that count."""
        if "num_hidden_layers" in overrides and "layer_types" not in overrides:
            n = overrides["num_hidden_layers"]
            if isinstance(n, int) and not isinstance(n, bool):
                overrides = {**overrides, "layer_types": [LAYER_TYPES[i % 2] for i in range(n)]}
        return super().with_overrides(overrides)

    # ------------------------------------------------------------------ names the shared code reads
    @property
    def num_experts(self) -> int:
        return self.num_local_experts

    @property
    def moe_intermediate_size(self) -> int:
        return self.intermediate_size

    @property
    def norm_topk_prob(self) -> bool:
        return True  # softmax over the k kept logits: the weights sum to one

    @property
    def rope_theta(self) -> float:
        return float(self.rope_parameters.get("rope_theta", 150000.0))

    def window(self, i: int) -> int:
        """Layer ``i``'s attention window (0: full attention)."""
        return self.sliding_window if self.layer_types[i] == "sliding_attention" else 0

    def is_moe_layer(self, i: int) -> bool:
        return True

    def validate(self) -> None:
        check_field_types(self)
        check_positive(
            self,
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "num_local_experts",
            "num_experts_per_tok",
            "sliding_window",
        )
        check_divisible(self, "num_attention_heads", "num_key_value_heads")
        if self.head_dim % 2:
            raise ArchError(f"head_dim must be even (rotary halves), got {self.head_dim}")
        if self.num_experts_per_tok > self.num_local_experts:
            raise ArchError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be <= num_local_experts "
                f"({self.num_local_experts})"
            )
        if len(self.layer_types) != self.num_hidden_layers or not set(self.layer_types) <= set(
            LAYER_TYPES
        ):
            raise ArchError(
                f"layer_types must list {self.num_hidden_layers} of {', '.join(LAYER_TYPES)}, "
                f"got {self.layer_types!r}"
            )
        if self.swiglu_limit <= 0 or self.swiglu_alpha <= 0:
            raise ArchError("swiglu_alpha and swiglu_limit must be positive")
        check_rope_type(self.rope_parameters, ROPE_TYPES)
        check_norm_and_rope(self.rms_norm_eps, rope_theta_of(self.rope_parameters, 150000.0))
        check_silu(self)

    # ------------------------------------------------------------------ HF mapping
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> GptOssArch:
        d = dict(d)
        if d.get("quantization_config", {}).get("quant_method") == "mxfp4":
            raise ArchError(
                "MXFP4-quantized gpt-oss checkpoints are not read; use a bf16 export "
                "(e.g. transformers' dequantize=True save)"
            )
        if "num_experts" in d and "num_local_experts" not in d:
            d["num_local_experts"] = d["num_experts"]
        d["rope_parameters"] = hf_rope(d, _DEFAULT_ROPE, theta=150000.0)
        if d.get("sliding_window") is None:
            d.pop("sliding_window", None)
        return cls.from_fields(d)

    def to_hf_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["layer_types"] = list(self.layer_types)
        d["rope_parameters"] = dict(self.rope_parameters)
        d["architectures"] = ["GptOssForCausalLM"]
        return d

    # ------------------------------------------------------------------ arithmetic
    def to_spec(self, name: str = "custom"):
        """Parameters, shapes and FLOPs for the planner (models/spec.py)."""
        return self.spec(
            name,
            "gpt_oss",
            attn_bias=self.attention_bias,
            o_bias=self.attention_bias,
            attn_sinks=True,
            windows=tuple(self.window(i) for i in range(self.num_hidden_layers)),
            qk_norm=False,
            moe_bias=True,
        )
