"""Architecture hyper-parameters of Qwen3-Next (HF ``Qwen3NextConfig``).

The same hybrid as Qwen3.5-MoE (``qwen3_5_moe/arch.py``, whose checks and HF mapping this
extends): field names are HF's ``config.json`` keys, defaults HF's (Qwen3-Next-80B-A3B).
Qwen3-Next adds HF's dense-layer keys (``mlp_only_layers``, ``decoder_sparse_step``,
``intermediate_size``) and a real ``norm_topk_prob``. ``num_nextn_predict_layers`` is read as
an alias of ``mtp_num_hidden_layers`` (the MTP depth; 0 unless the config states one).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from bumblebee.models.arch import ArchError, check_positive
from bumblebee.models.qwen3_5_moe.arch import Qwen3_5MoeArch, default_layer_types


@dataclass(kw_only=True)
class Qwen3NextArch(Qwen3_5MoeArch):
    model_type: str = "qwen3_next"
    vocab_size: int = 151936
    hidden_size: int = 2048
    num_hidden_layers: int = 48
    layer_types: list = field(default_factory=lambda: default_layer_types(48))
    max_position_embeddings: int = 32768
    # dense SwiGLU layers (HF rule: listed in mlp_only_layers or off the sparse step)
    intermediate_size: int = 5632
    decoder_sparse_step: int = 1
    mlp_only_layers: list = field(default_factory=list)
    num_experts: int = 512
    num_experts_per_tok: int = 10
    norm_topk_prob: bool = True

    def is_moe_layer(self, i: int) -> bool:
        return i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    def validate(self) -> None:
        super().validate()
        check_positive(self, "decoder_sparse_step")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ArchError(f"mlp_only_layers {bad} out of range 0..{self.num_hidden_layers - 1}")
        dense = any(not self.is_moe_layer(i) for i in range(self.num_hidden_layers))
        if dense and self.intermediate_size <= 0:
            raise ArchError("dense-MLP layers need intermediate_size > 0")

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> Qwen3NextArch:
        d = dict(d)
        if "num_nextn_predict_layers" in d and "mtp_num_hidden_layers" not in d:
            d["mtp_num_hidden_layers"] = d["num_nextn_predict_layers"]
        if d.get("mlp_only_layers") is None:
            d.pop("mlp_only_layers", None)
        return super().from_hf_dict(d)

    def to_hf_dict(self) -> dict[str, Any]:
        d = super().to_hf_dict()
        d["architectures"] = ["Qwen3NextForCausalLM"]
        return d

    def to_spec(self, name: str = "custom"):
        """Qwen3.5's spec (same mixers, same parameter counts: the fused GDN projections hold the
        same weights) with this family's dense layers."""
        spec = super().to_spec(name)
        return dataclasses.replace(spec, family="qwen3_next", dense_ffn=self.intermediate_size)
