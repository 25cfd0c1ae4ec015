"""MiniMax-M2 / M2.1 (HF ``minimax_m2``): GQA with q/k RMSNorm over all heads of a token, partial
RoPE, sigmoid routing with a correction bias in every layer, Mixtral's expert names."""

from bumblebee.models.family import Family, register_family
from bumblebee.models.minimax_m2 import names
from bumblebee.models.minimax_m2.arch import MiniMaxM2Arch
from bumblebee.models.minimax_m2.model import ROUTER, MiniMaxM2ForCausalLM
from bumblebee.models.minimax_m2.presets import PRESETS

FAMILY = register_family(
    Family(
        name="minimax_m2",
        arch=MiniMaxM2Arch,
        model=MiniMaxM2ForCausalLM,
        presets=PRESETS,
        hf_model_types=("minimax_m2",),
        hf_name_in=names.hf_name_in,
        hf_name_out=names.hf_name_out,
        transformers_renames={"mlp.gate.e_score_correction_bias": "mlp.e_score_correction_bias"},
        router=ROUTER,
    )
)
