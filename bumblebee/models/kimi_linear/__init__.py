"""Kimi Linear (HF ``kimi_linear``): Kimi Delta Attention / NoPE-MLA hybrid with DeepSeek-V3's
MoE, Kimi-Linear-48B-A3B."""

from bumblebee.models.deepseek_v3.model import ROUTER
from bumblebee.models.family import Family, register_family
from bumblebee.models.kimi_linear import names
from bumblebee.models.kimi_linear.arch import KimiLinearArch
from bumblebee.models.kimi_linear.model import KimiLinearForCausalLM
from bumblebee.models.kimi_linear.presets import PRESETS

FAMILY = register_family(
    Family(
        name="kimi_linear",
        arch=KimiLinearArch,
        model=KimiLinearForCausalLM,
        presets=PRESETS,
        hf_model_types=("kimi_linear",),
        hf_name_in=names.hf_name_in,
        hf_name_out=names.hf_name_out,
        router=ROUTER,
    )
)
