"""DeepSeek-V3 (HF ``deepseek_v3``; also R1 and Kimi-K2 checkpoints): MLA, sigmoid routing with a
correction bias, shared experts, multi-token prediction."""

from bumblebee.models.deepseek_v3 import names
from bumblebee.models.deepseek_v3.arch import DeepseekV3Arch
from bumblebee.models.deepseek_v3.model import ROUTER, DeepseekV3ForCausalLM
from bumblebee.models.deepseek_v3.presets import PRESETS
from bumblebee.models.family import Family, register_family

FAMILY = register_family(
    Family(
        name="deepseek_v3",
        arch=DeepseekV3Arch,
        model=DeepseekV3ForCausalLM,
        presets=PRESETS,
        launches_per_layer=(668, 2, "cp 2 ring, ep 2 chunked"),
        hf_model_types=("deepseek_v3", "kimi_k2"),
        hf_name_in=names.hf_name_in,
        hf_name_out=names.hf_name_out,
        hf_copies=names.hf_copies,
        mtp_arch_key="num_nextn_predict_layers",
        router=ROUTER,
    )
)
