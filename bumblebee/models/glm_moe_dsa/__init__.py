"""GLM-5 (HF ``glm_moe_dsa``): DeepSeek-V3.2's sparse-attention layer with GLM's dimensions and an
interleaved indexer RoPE (the class attributes of its arch say how it differs)."""

from bumblebee.models.deepseek_v3 import names
from bumblebee.models.deepseek_v3.model import ROUTER
from bumblebee.models.deepseek_v32.model import DeepseekV32ForCausalLM
from bumblebee.models.family import Family, register_family
from bumblebee.models.glm_moe_dsa.arch import GlmMoeDsaArch
from bumblebee.models.glm_moe_dsa.presets import PRESETS


class GlmMoeDsaForCausalLM(DeepseekV32ForCausalLM):
    family = "glm_moe_dsa"


FAMILY = register_family(
    Family(
        name="glm_moe_dsa",
        arch=GlmMoeDsaArch,
        model=GlmMoeDsaForCausalLM,
        presets=PRESETS,
        hf_model_types=("glm_moe_dsa",),
        hf_name_in=names.hf_name_in,
        hf_name_out=names.hf_name_out,
        hf_copies=names.hf_copies,
        mtp_arch_key="num_nextn_predict_layers",
        router=ROUTER,
    )
)
