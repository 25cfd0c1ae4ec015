"""Architecture hyper-parameters of MiniMax-M2 / M2.1 (HF ``MiniMaxM2Config``).

Field names are HF's ``config.json`` keys; defaults are HF's. ``intermediate_size`` is the
routed experts' FFN width (every layer is MoE; there is no dense MLP and no shared expert).
``rope_parameters`` is flattened to ``rope_theta`` and ``partial_rotary_factor``; released
configs state the rotated dims as the legacy ``rotary_dim`` instead (HF reads it as
``rotary_dim / head_dim``, as here; without either, HF rotates the whole head). Released keys
``transformers`` ignores are checked where they would change the model: ``use_qk_norm``,
``qk_norm_type`` (q/k RMSNorm over all heads of a token: ``per_layer``), ``scoring_func``
(sigmoid), ``use_routing_bias``, ``shared_intermediate_size`` (0) and ``attn_type_list`` (1 =
full softmax attention in every layer; 0 would be MiniMax-01's lightning attention).
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
    flatten_rope,
)

ROPE_TYPES = ("default",)  # the RoPE kinds this family implements


@dataclass(kw_only=True)
class MiniMaxM2Arch(BaseArch):
    # keys a config.json must state (models/__init__.py): the expert width is intermediate_size
    REQUIRED_HF_KEYS = (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "num_experts_per_tok",
    )
    model_type: str = "minimax_m2"
    vocab_size: int = 200064
    hidden_size: int = 3072
    intermediate_size: int = 1536  # routed experts' FFN width
    num_hidden_layers: int = 62
    num_attention_heads: int = 48
    num_key_value_heads: int = 8
    head_dim: int = 128
    rope_theta: float = 5000000.0
    partial_rotary_factor: float = 1.0
    max_position_embeddings: int = 196608
    num_local_experts: int = 256
    num_experts_per_tok: int = 8
    # HF's weight of its (softmax) Switch balance loss; bumblebee weights its own balance loss
    # of the sigmoid router's normalized scores with it (the correction bias balances too)
    router_aux_loss_coef: float = 0.001
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    # released keys transformers does not read; other values would be another model
    use_qk_norm: bool = True
    qk_norm_type: str = "per_layer"
    scoring_func: str = "sigmoid"
    use_routing_bias: bool = True
    shared_intermediate_size: int = 0

    # ------------------------------------------------------------------ names the shared code reads
    @property
    def num_experts(self) -> int:
        return self.num_local_experts

    @property
    def moe_intermediate_size(self) -> int:
        return self.intermediate_size

    @property
    def n_shared_experts(self) -> int:
        return 0  # DeepSeek-V3's MoE block (reused) without its shared experts

    @property
    def norm_topk_prob(self) -> bool:
        return True  # the kept sigmoid scores are always renormalized to sum 1

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, i: int) -> bool:
        return True

    def validate(self) -> None:
        check_field_types(self)
        check_norm_and_rope(self.rms_norm_eps, self.rope_theta)
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
        )
        check_divisible(self, "num_attention_heads", "num_key_value_heads")
        check_partial_rotary(self)
        if self.num_experts_per_tok > self.num_local_experts:
            raise ArchError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_local_experts "
                f"({self.num_local_experts})"
            )
        fixed = {
            "hidden_act": "silu",
            "use_qk_norm": True,
            "qk_norm_type": "per_layer",
            "scoring_func": "sigmoid",
            "use_routing_bias": True,
            "shared_intermediate_size": 0,
        }
        for name, valid in fixed.items():
            if getattr(self, name) != valid:
                raise ArchError(
                    f"{name} = {getattr(self, name)!r} is not supported; valid: {valid!r}"
                )

    # ------------------------------------------------------------------ HF mapping
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> MiniMaxM2Arch:
        d = dict(d)
        if any(t != 1 for t in d.get("attn_type_list") or []):
            raise ArchError("attn_type_list: only full attention (1) in every layer is supported")
        flatten_rope(d, ROPE_TYPES)
        head_dim = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
        if "partial_rotary_factor" not in d and d.get("rotary_dim") is not None:
            d["partial_rotary_factor"] = d["rotary_dim"] / head_dim  # HF's rule for the legacy key
        return cls.from_fields(d)

    def to_hf_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": d.pop("rope_theta"),
            "partial_rotary_factor": d.pop("partial_rotary_factor"),
        }
        d["rotary_dim"] = self.rotary_dim  # what released configs (and inference engines) read
        d["architectures"] = ["MiniMaxM2ForCausalLM"]
        return d

    # ------------------------------------------------------------------ arithmetic
    def to_spec(self, name: str = "custom"):
        """Parameters, shapes and FLOPs for the planner (models/spec.py)."""
        return self.spec(name, "minimax_m2", qk_norm_all_heads=True)
