"""A CUDA machine without the fused Gated DeltaNet kernel refuses a Qwen3.5 run up front (one line
naming the extra) instead of silently running the pure-PyTorch chunk loop; the user can opt in.
The CUDA side is asked through ``check_kernels(..., cuda=True)``: this machine has no GPU."""

import pytest

from bumblebee import load_config
from bumblebee.config import ConfigError
from bumblebee.models import resolve_arch
from bumblebee.primitives import kernel_choice
from bumblebee.runtime.launch.preflight import check_kernels


def cfg(*sets):
    return load_config(None, ["model.name=qwen3_5_moe", "model.preset=tiny", *sets])


@pytest.mark.skipif(
    kernel_choice.package_present("fla"), reason="fla is installed: the fused kernel runs"
)
def test_cuda_without_fla_refuses_gated_deltanet():
    c = cfg("train.dtype='bfloat16'")
    with pytest.raises(ConfigError, match=r"pip install -e '\.\[gpu\]'") as e:
        check_kernels(c, resolve_arch(c.model), cuda=True)
    assert "\n" not in str(e.value)
    c = cfg("primitives.allow_fallback=true")
    check_kernels(c, resolve_arch(c.model), cuda=True)  # opted in
    check_kernels(cfg(), resolve_arch(cfg().model), cuda=False)  # CPU: the PyTorch path is the path
    c = cfg("primitives.linear_attention='recurrent'")
    check_kernels(c, resolve_arch(c.model), cuda=True)  # the reference was asked for by name
    q = load_config(None, ["model.name=qwen3_moe"])
    check_kernels(q, resolve_arch(q.model), cuda=True)  # no Gated DeltaNet layer
