"""Qwen3-MoE (HF ``qwen3_moe``): Qwen3-30B-A3B, Qwen3-235B-A22B."""

from bumblebee.models.family import Family, register_family
from bumblebee.models.qwen3_moe.arch import Qwen3MoeArch
from bumblebee.models.qwen3_moe.model import Qwen3MoeForCausalLM
from bumblebee.models.qwen3_moe.presets import PRESETS

FAMILY = register_family(
    Family(
        name="qwen3_moe",
        arch=Qwen3MoeArch,
        model=Qwen3MoeForCausalLM,
        presets=PRESETS,
        launches_per_layer=(378, 2, "ep 2 chunked"),
        hf_model_types=("qwen3_moe",),
    )
)
