"""GLM-4.5 / 4.6 / 4.7 (HF ``glm4_moe``): GQA with partial RoPE, DeepSeek-style MoE (dense first
layers, shared expert, sigmoid routing with a correction bias), multi-token prediction."""

from bumblebee.models.deepseek_v3 import names
from bumblebee.models.family import Family, register_family
from bumblebee.models.glm4_moe.arch import Glm4MoeArch
from bumblebee.models.glm4_moe.model import ROUTER, Glm4MoeForCausalLM
from bumblebee.models.glm4_moe.presets import PRESETS

# GLM's released MTP layer has DeepSeek-V3's layout (model.layers.{L + k}, with copies of the
# embedding and head), hence DeepSeek's name map (it reads only num_hidden_layers,
# num_nextn_predict_layers and tie_word_embeddings of the arch)
FAMILY = register_family(
    Family(
        name="glm4_moe",
        arch=Glm4MoeArch,
        model=Glm4MoeForCausalLM,
        presets=PRESETS,
        hf_model_types=("glm4_moe",),
        hf_name_in=names.hf_name_in,
        hf_name_out=names.hf_name_out,
        hf_copies=names.hf_copies,
        mtp_arch_key="num_nextn_predict_layers",
        router=ROUTER,
    )
)
