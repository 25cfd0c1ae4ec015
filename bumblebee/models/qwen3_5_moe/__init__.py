"""Qwen3.5-MoE (HF ``qwen3_5_moe``): the Gated DeltaNet / gated-attention hybrid, Qwen3.5-35B-A3B."""

from bumblebee.models.family import Family, register_family
from bumblebee.models.qwen3_5_moe.arch import Qwen3_5MoeArch
from bumblebee.models.qwen3_5_moe.model import Qwen3_5MoeForCausalLM
from bumblebee.models.qwen3_5_moe.presets import PRESETS

# also the released multimodal wrapper: its text_config is the language model, stored under
# model.language_model.*, its MTP head under mtp.*; the vision tower is not part of it
FAMILY = register_family(
    Family(
        name="qwen3_5_moe",
        arch=Qwen3_5MoeArch,
        model=Qwen3_5MoeForCausalLM,
        presets=PRESETS,
        launches_per_layer=(510, 0, "cp 2 ring"),
        hf_model_types=("qwen3_5_moe_text", "qwen3_5_moe"),
        hf_prefixes={"model.language_model.": "model."},
        skip_prefixes=("model.visual.",),
        mtp_arch_key="mtp_num_hidden_layers",
    )
)
