"""Architecture hyper-parameters of the Qwen3.5-MoE hybrid (HF ``Qwen3_5MoeTextConfig``).

Field names are HF's ``config.json`` keys so configs map in and out without a
table; defaults are HF's defaults (the Qwen3.5-35B-A3B text model), so a key a
config omits means what it means to ``transformers``. ``from_hf_dict`` also
takes the multimodal ``qwen3_5_moe`` config (its ``text_config`` is the language
model) and flattens ``rope_parameters`` (``rope_theta``, ``partial_rotary_factor``;
the M-RoPE sections are ignored: with text positions all three are equal, so
M-RoPE is plain RoPE). The router always renormalizes its top-k weights in
Qwen3.5, hence the constant ``norm_topk_prob``.
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
    check_partial_rotary,
    check_positive,
    check_silu,
    flatten_rope,
    replace_fields,
)

ROPE_TYPES = ("default",)  # the RoPE kinds this family implements

LAYER_TYPES = ("linear_attention", "full_attention")


def default_layer_types(num_layers: int, full_attention_interval: int = 4) -> list[str]:
    """HF's default pattern: every ``full_attention_interval``-th layer is full attention."""
    return [
        "full_attention" if (i + 1) % full_attention_interval == 0 else "linear_attention"
        for i in range(num_layers)
    ]


@dataclass(kw_only=True)
class Qwen3_5MoeArch(BaseArch):
    model_type: str = "qwen3_5_moe_text"
    vocab_size: int = 248320
    hidden_size: int = 2048
    num_hidden_layers: int = 40
    layer_types: list = field(default_factory=lambda: default_layer_types(40))
    # gated full attention
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    head_dim: int = 256
    rope_theta: float = 1e7
    partial_rotary_factor: float = 0.25
    attention_bias: bool = False
    # Gated DeltaNet
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    # MoE with a shared expert
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    num_experts: int = 256
    num_experts_per_tok: int = 8
    router_aux_loss_coef: float = 0.001
    # multi-token prediction (the released checkpoints' mtp.* tensors: one full-attention MoE layer)
    mtp_num_hidden_layers: int = 0
    # rest
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"

    norm_topk_prob = True  # not a field: Qwen3.5's router always renormalizes the top-k weights

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, i: int) -> bool:
        return True  # every Qwen3.5 layer has a sparse MoE block

    def optional_slots(self) -> tuple[str, ...]:
        return ("linear_attention",) if "linear_attention" in self.layer_types else ()

    def context_parallel_error(self, cp: int, seq_len: int) -> str | None:
        # the causal conv reads its window from the previous zigzag chunk only
        chunk, window = seq_len // (2 * cp), self.linear_conv_kernel_dim - 1
        if "linear_attention" in self.layer_types and chunk < window:
            return (
                f"Gated DeltaNet with parallel.cp = {cp}: each zigzag chunk has {seq_len} / "
                f"{2 * cp} = {chunk} tokens, fewer than the conv window ({window}); use "
                f"train.seq_len >= {2 * cp * window} or a smaller cp"
            )
        return None

    def validate(self) -> None:
        check_field_types(self)
        check_norm_and_rope(self.rms_norm_eps, self.rope_theta)
        check_positive(
            self,
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "linear_conv_kernel_dim",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_num_key_heads",
            "linear_num_value_heads",
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
            "num_experts",
        )
        if len(self.layer_types) != self.num_hidden_layers:
            raise ArchError(
                f"layer_types has {len(self.layer_types)} entries, num_hidden_layers is "
                f"{self.num_hidden_layers}"
            )
        bad = sorted({t for t in self.layer_types if t not in LAYER_TYPES})
        if bad:
            raise ArchError(f"unknown layer_types {bad}; valid: {', '.join(LAYER_TYPES)}")
        check_divisible(self, "num_attention_heads", "num_key_value_heads")
        check_divisible(self, "linear_num_value_heads", "linear_num_key_heads")
        check_partial_rotary(self)
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ArchError(
                f"need 1 <= num_experts_per_tok <= num_experts, got "
                f"{self.num_experts_per_tok} and {self.num_experts}"
            )
        check_silu(self)
        if self.attention_bias:
            raise ArchError(
                "attention_bias = true is not supported (Qwen3.5 checkpoints have none)"
            )
        if self.mtp_num_hidden_layers < 0:
            raise ArchError(f"mtp_num_hidden_layers must be >= 0, got {self.mtp_num_hidden_layers}")

    # ------------------------------------------------------------------ HF mapping
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> Qwen3_5MoeArch:
        if (
            d.get("model_type") == "qwen3_5_moe"
        ):  # multimodal wrapper: the language model is text_config
            if not isinstance(d.get("text_config"), dict):
                raise ArchError("a qwen3_5_moe config needs a text_config section")
            top = d
            d = dict(d["text_config"], model_type="qwen3_5_moe_text")
            if "tie_word_embeddings" in top:
                d["tie_word_embeddings"] = top["tie_word_embeddings"]
        d = dict(d)
        flatten_rope(d, ROPE_TYPES)
        if d.get("mtp_use_dedicated_embeddings"):
            raise ArchError(
                "mtp_use_dedicated_embeddings = true is not supported (the MTP head shares the embedding)"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in names and v is not None}
        if "layer_types" not in kwargs:
            kwargs["layer_types"] = default_layer_types(
                kwargs.get("num_hidden_layers", cls.num_hidden_layers),
                d.get("full_attention_interval", 4),
            )
        kwargs["layer_types"] = list(kwargs["layer_types"])
        arch = cls(**kwargs)
        arch.validate()
        return arch

    def to_hf_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": d.pop("rope_theta"),
            "partial_rotary_factor": d.pop("partial_rotary_factor"),
        }
        d["architectures"] = ["Qwen3_5MoeForCausalLM"]
        d["output_router_logits"] = False
        return d

    def with_overrides(self, overrides: dict[str, Any]) -> Qwen3_5MoeArch:
        """Replace fields; changing ``num_hidden_layers`` without ``layer_types`` re-derives the
        layer pattern with HF's default rule (every 4th layer full attention)."""
        overrides = dict(overrides)
        if "num_hidden_layers" in overrides and "layer_types" not in overrides:
            overrides["layer_types"] = default_layer_types(overrides["num_hidden_layers"])
        return replace_fields(self, overrides)

    # ------------------------------------------------------------------ arithmetic
    def to_spec(self, name: str = "custom"):
        """Parameters, shapes and FLOPs for the planner (models/spec.py)."""
        from bumblebee.models.spec import ATTN, GDN

        return self.spec(
            name,
            "qwen3_5_moe",
            mixers=tuple(ATTN if t == "full_attention" else GDN for t in self.layer_types),
            attn_gate=True,
            gdn_k_heads=self.linear_num_key_heads,
            gdn_v_heads=self.linear_num_value_heads,
            gdn_k_dim=self.linear_key_head_dim,
            gdn_v_dim=self.linear_value_head_dim,
            gdn_conv=self.linear_conv_kernel_dim,
            shared_ffn=self.shared_expert_intermediate_size,
            mtp_depth=self.mtp_num_hidden_layers,
            fp32_norm=True,  # ZeroCenteredRMSNorm
            stream_tensors=4,  # the decoder layer keeps the mixer's input and output (model.py)
        )
