"""Qwen3-Next (HF ``qwen3_next``): the Gated DeltaNet / gated-attention hybrid, Qwen3-Next-80B-A3B."""

from bumblebee.models.family import Family, register_family
from bumblebee.models.qwen3_next.arch import Qwen3NextArch
from bumblebee.models.qwen3_next.model import Qwen3NextForCausalLM
from bumblebee.models.qwen3_next.presets import PRESETS

# the released checkpoints' MTP head mtp.* has Qwen3.5's layout (models/mtp.py); a config without
# mtp_num_hidden_layers builds none: then mtp.* is skipped on load and carried over on export
FAMILY = register_family(
    Family(
        name="qwen3_next",
        arch=Qwen3NextArch,
        model=Qwen3NextForCausalLM,
        presets=PRESETS,
        hf_model_types=("qwen3_next",),
        mtp_arch_key="mtp_num_hidden_layers",
    )
)
