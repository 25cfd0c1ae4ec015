"""Which kernels the plan assumes, from the runtime's kernel dispatch (``primitives/dispatch.py``).

The planner's efficiencies (``hardware.Efficiency``: ``attn_fwd``/``attn_bwd`` for flash
attention, ``gdn`` for FLA's chunk kernel) and its activation memory model fused CUDA kernels.
This module asks the dispatch what a CUDA bf16 run of the recipe's primitives would run, and
says so in the plan; when flash-linear-attention is not importable where the plan is made, the
note says that a run with these packages would fall back to the pure-PyTorch chunked core
(the planner does not model that fallback's cost: it is launch-bound, ~256 chunk steps per
16K-token segment and layer, far below the ``gdn`` efficiency).
"""

from __future__ import annotations

from bumblebee.config import PrimitivesConfig
from bumblebee.primitives import dispatch


def assumed_kernels(cp: int, *, fla: bool = True) -> dict[str, dispatch.Kernel]:
    """slot -> Kernel of a CUDA bf16 run with the default primitives at context parallelism ``cp``."""
    return dispatch.kernel_table(PrimitivesConfig(), "cuda", "bfloat16", cp=cp, fla=fla)


def kernels_note(cp: int, has_gdn: bool) -> str:
    """One line for the plan: the kernels its figures assume, and a warning when FLA is absent here."""
    table = assumed_kernels(cp)
    if not has_gdn:
        table.pop("linear_attention")
        table.pop("conv")
    line = "kernels assumed (CUDA, bf16): " + dispatch.describe(table)
    if has_gdn and not dispatch.package_present("fla"):
        line += (
            "; flash-linear-attention is not installed here: a run with these packages would use the "
            "pure-PyTorch chunked GDN core, which this plan does not model (pip install -e '.[gpu]')"
        )
    return line


def assumptions(cp: int, has_gdn: bool) -> dict:
    """What every prediction of a plan assumes (``--json``: ``assumptions``): dtypes, the kernels
    the efficiencies and the memory terms follow, and which slots a run *with the packages of
    this environment* would execute in pure PyTorch on CUDA (its TFLOPs would be lower than
    predicted: the model does not cost those paths)."""
    table = assumed_kernels(cp)
    here = dispatch.kernel_table(
        PrimitivesConfig(), "cuda", "bfloat16", cp=cp
    )  # packages present here
    if not has_gdn:
        for slot in ("linear_attention", "conv"):
            table.pop(slot)
            here.pop(slot)
    pure = sorted(slot for slot, k in here.items() if not k.fused)
    return {
        "device": "cuda",
        "compute_dtype": "bfloat16",
        "master_dtype": "float32",
        "kernels": {slot: k.label for slot, k in table.items()},
        "pure_pytorch_here": pure,
        "tflops_basis": "fused kernels above"
        + (
            f"; with this environment's packages {', '.join(pure)} "
            f"would run pure PyTorch (slower, not modelled)"
            if pure
            else ""
        ),
    }
