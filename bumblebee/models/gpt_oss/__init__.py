"""gpt-oss (HF ``gpt_oss``): gpt-oss-20b, gpt-oss-120b. GQA with per-head attention sinks and
alternating sliding-window / full layers, YaRN RoPE, a biased top-k-then-softmax router and
biased experts with a clamped SwiGLU, stored fused and interleaved in its checkpoints."""

from bumblebee.models.family import Family, register_family
from bumblebee.models.gpt_oss.arch import GptOssArch
from bumblebee.models.gpt_oss.model import ROUTER, GptOssForCausalLM
from bumblebee.models.gpt_oss.presets import PRESETS
from bumblebee.models.hf_stored import StoredAs

FAMILY = register_family(
    Family(
        name="gpt_oss",
        arch=GptOssArch,
        model=GptOssForCausalLM,
        presets=PRESETS,
        hf_model_types=("gpt_oss",),
        hf_stored=(
            StoredAs("mlp.gate.weight", "mlp.router.weight"),
            StoredAs("mlp.gate.bias", "mlp.router.bias"),
            StoredAs("mlp.experts.w_gate_up", "mlp.experts.gate_up_proj", True, -2),
            StoredAs("mlp.experts.b_gate_up", "mlp.experts.gate_up_proj_bias", False, -1),
            StoredAs("mlp.experts.w_down", "mlp.experts.down_proj", True),
            StoredAs("mlp.experts.b_down", "mlp.experts.down_proj_bias"),
        ),
        router=ROUTER,
    )
)
