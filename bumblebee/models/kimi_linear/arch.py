"""Architecture hyper-parameters of Kimi Linear (HF ``KimiLinearConfig``, ``kimi_linear``).

DeepSeek-V3's fields (``deepseek_v3/arch.py``: MLA, sigmoid routing with a correction bias,
shared experts, its checks and arithmetic) plus the hybrid's: ``layer_types``
("linear_attention" = Kimi Delta Attention, "full_attention" = MLA without RoPE),
``mlp_layer_types`` ("dense" / "sparse") and the KDA sizes. Defaults are
``transformers==5.23.0``'s (those of Kimi-Linear-48B-A3B), including its default layer rule
(full attention at 0-based layers 4, 8, ...) and MLP rule (``first_k_dense_replace`` dense
layers, default 1).

Kimi's ``config.json`` names differ from DeepSeek's; both spellings are read:
``num_experts`` / ``num_local_experts`` (= ``n_routed_experts``), ``num_experts_per_token``,
``num_shared_experts``, ``moe_renormalize`` (= ``norm_topk_prob``), ``num_expert_group``
(= ``n_group``), ``model_max_length``, and the released checkpoint's ``linear_attn_config``
(``head_dim``, ``num_heads``, ``short_conv_kernel_size``, 1-based ``kda_layers`` /
``full_attn_layers``). ``to_hf_dict`` writes what ``transformers``' ``save_pretrained`` writes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from bumblebee.models.arch import ArchError, check_positive
from bumblebee.models.deepseek_v3.arch import DeepseekV3Arch

LINEAR, FULL = "linear_attention", "full_attention"
# Kimi's config.json key -> DeepSeek field (HF's KimiLinearConfig attribute_map, reversed)
_ALIASES = {
    "num_experts": "n_routed_experts",
    "num_local_experts": "n_routed_experts",
    "num_experts_per_token": "num_experts_per_tok",
    "num_shared_experts": "n_shared_experts",
    "moe_renormalize": "norm_topk_prob",
    "num_expert_group": "n_group",
    "model_max_length": "max_position_embeddings",
}
_LINEAR_CONFIG = {"head_dim": "linear_head_dim", "num_heads": "linear_num_heads",
                  "short_conv_kernel_size": "linear_conv_kernel_dim"}  # fmt: skip


@dataclass(kw_only=True)
class KimiLinearArch(DeepseekV3Arch):
    # Kimi's config.json (the release and transformers' save_pretrained) names the experts per token
    # num_experts_per_token (models/__init__.py's required keys otherwise)
    REQUIRED_HF_KEYS = (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "moe_intermediate_size",
        "num_experts_per_token",
    )
    model_type: str = "kimi_linear"
    vocab_size: int = 163840
    hidden_size: int = 2304
    intermediate_size: int = 9216
    moe_intermediate_size: int = 1024
    num_hidden_layers: int = 27
    first_k_dense_replace: int = 1  # only read when mlp_layer_types is not given
    num_attention_heads: int = 32
    q_lora_rank: int = 0
    kv_lora_rank: int = 512
    rope_interleave: bool = False  # unused: no RoPE
    max_position_embeddings: int = 1048576
    n_routed_experts: int = 256
    num_experts_per_tok: int = 8
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 2.446
    rms_norm_eps: float = 1e-5
    # the hybrid ([] = HF's default rules, filled in __post_init__)
    layer_types: list = field(default_factory=list)
    mlp_layer_types: list = field(default_factory=list)
    linear_head_dim: int = 128
    linear_num_heads: int = 32
    linear_conv_kernel_dim: int = 4

    def __post_init__(self):
        n = self.num_hidden_layers
        if not self.layer_types:
            self.layer_types = [FULL if i and i % 4 == 0 else LINEAR for i in range(n)]
        if not self.mlp_layer_types:
            k = self.first_k_dense_replace
            self.mlp_layer_types = ["dense" if i < k else "sparse" for i in range(n)]

    def is_moe_layer(self, i: int) -> bool:
        return self.mlp_layer_types[i] == "sparse"

    def optional_slots(self) -> tuple[str, ...]:
        return ("linear_attention",) if LINEAR in self.layer_types else ()

    def context_parallel_error(self, cp: int, seq_len: int) -> str | None:
        # the causal conv reads its window from the previous zigzag chunk only
        chunk, window = seq_len // (2 * cp), self.linear_conv_kernel_dim - 1
        if LINEAR in self.layer_types and chunk < window:
            return (
                f"Kimi Delta Attention with parallel.cp = {cp}: each zigzag chunk has {seq_len} / "
                f"{2 * cp} = {chunk} tokens, fewer than the conv window ({window}); use "
                f"train.seq_len >= {2 * cp * window} or a smaller cp"
            )
        return None

    def validate(self) -> None:
        super().validate()
        n = self.num_hidden_layers
        for name, valid in (("layer_types", (LINEAR, FULL)), ("mlp_layer_types", ("dense", "sparse"))):  # fmt: skip
            values = getattr(self, name)
            if len(values) != n or not set(values) <= set(valid):
                raise ArchError(
                    f"{name} must list {n} entries from {', '.join(valid)}, got {values}"
                )
        check_positive(self, "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim")
        if self.tie_word_embeddings:  # HF's KimiLinearForCausalLM ties nothing (no tied keys)
            raise ArchError("tie_word_embeddings = true is not supported for Kimi Linear")
        if self.num_nextn_predict_layers:
            raise ArchError("Kimi Linear has no multi-token prediction modules")

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> KimiLinearArch:
        d = {k: v for k, v in d.items() if v is not None or k == "q_lora_rank"}
        for kimi, ours in _ALIASES.items():
            if kimi in d:
                d.setdefault(ours, d.pop(kimi))
        lin = d.pop("linear_attn_config", None) or {}
        for kimi, ours in _LINEAR_CONFIG.items():
            if kimi in lin:
                d.setdefault(ours, lin[kimi])
        if not d.get("layer_types") and "full_attn_layers" in lin and "kda_layers" in lin:
            n = d.get("num_hidden_layers", cls.num_hidden_layers)
            types = [None] * n
            for kind, key in ((FULL, "full_attn_layers"), (LINEAR, "kda_layers")):
                for i in lin[key]:  # 1-based in the checkpoint's config
                    if not 1 <= i <= n:
                        raise ArchError(f"linear_attn_config.{key}: layer {i} not in 1..{n}")
                    types[i - 1] = kind
            if None in types:
                raise ArchError("linear_attn_config: kda_layers and full_attn_layers miss a layer")
            d["layer_types"] = types
        d.pop("num_nextn_predict_layers", None)  # 0 in the release; HF reads none
        return super().from_hf_dict(d)

    def to_hf_dict(self) -> dict[str, Any]:
        d = super().to_hf_dict()
        for name in ("rope_parameters", "rope_interleave", "first_k_dense_replace",
                     "num_nextn_predict_layers"):  # fmt: skip
            d.pop(name)
        for kimi, ours in _ALIASES.items():
            if kimi != "num_local_experts":
                d[kimi] = d.pop(ours)
        d["architectures"] = ["KimiLinearForCausalLM"]
        # HF's default (163839) would make its embedding a padding_idx one, whose row never
        # trains: bumblebee trains every row, so the export says there is none
        d["pad_token_id"] = None
        return d

    def to_spec(self, name: str = "custom"):
        """DeepSeek-V3's spec (MLA, its MLPs) with KDA on the linear layers."""
        from bumblebee.models.spec import ATTN, GDN

        return dataclasses.replace(
            super().to_spec(name),
            family="kimi_linear",
            mixers=tuple(GDN if t == LINEAR else ATTN for t in self.layer_types),
            gdn_k_heads=self.linear_num_heads,
            gdn_v_heads=self.linear_num_heads,
            gdn_k_dim=self.linear_head_dim,
            gdn_v_dim=self.linear_head_dim,
            gdn_conv=self.linear_conv_kernel_dim,
            kda_gate_rank=self.linear_head_dim,
        )
