"""DeepSeek-V3.2 (HF ``deepseek_v32``): DeepSeek-V3 plus DeepSeek Sparse Attention (a lightning
indexer selects each query's top-k keys)."""

from bumblebee.models.deepseek_v3 import names
from bumblebee.models.deepseek_v3.model import ROUTER
from bumblebee.models.deepseek_v32.arch import DeepseekV32Arch
from bumblebee.models.deepseek_v32.model import DeepseekV32ForCausalLM
from bumblebee.models.deepseek_v32.presets import PRESETS
from bumblebee.models.family import Family, register_family

FAMILY = register_family(
    Family(
        name="deepseek_v32",
        arch=DeepseekV32Arch,
        model=DeepseekV32ForCausalLM,
        presets=PRESETS,
        hf_model_types=("deepseek_v32",),
        hf_name_in=names.hf_name_in,
        hf_name_out=names.hf_name_out,
        hf_copies=names.hf_copies,
        mtp_arch_key="num_nextn_predict_layers",
        router=ROUTER,
    )
)
