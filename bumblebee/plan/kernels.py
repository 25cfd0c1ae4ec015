"""Which kernels the plan assumes, from the runtime's kernel choice (``primitives/kernel_choice.py``).

The planner's efficiencies (``hardware.Efficiency``: ``attn_fwd``/``attn_bwd`` for flash
attention, fitted to FA3 / TE runs; ``gdn`` for FLA's chunk kernel) and its activation memory
model fused CUDA kernels: FA3, FLA's chunk kernel and causal conv, the glue compiled.
This module asks the kernel choice what a CUDA bf16 run of the recipe's primitives would run, and
says so in the plan; when flash-linear-attention is not importable where the plan is made, the
note says that a run with these packages would fall back to the pure-PyTorch chunked core
(the planner does not model that fallback's cost: it is launch-bound, ~256 chunk steps per
16K-token segment and layer, far below the ``gdn`` efficiency).
"""

from __future__ import annotations

from bumblebee.config import PrimitivesConfig
from bumblebee.primitives import kernel_choice


def measured_per_layer(family: str | None) -> tuple:
    """(launches, syncs, layout) per layer per micro-batch the family's table entry records
    (``Family.launches_per_layer``, counted with ``benchmarks/launches.py --part layers``); the time
    model does not charge them (it assumes the host runs ahead of the GPU), the plan prints them."""
    from bumblebee.models.family import FAMILIES

    entry = FAMILIES.get(family)
    return (entry.launches_per_layer if entry else None) or (None, None, "")


def attention_options(spec) -> dict:
    """The attention options of a ``ModelSpec`` the kernel choice asks about (sinks, window)."""
    return {"sinks": spec.attn_sinks, "window": any(spec.windows)} if spec is not None else {}


def assumed_kernels(
    cp: int, *, fla: bool = True, fa3: bool = True, spec=None
) -> dict[str, kernel_choice.Kernel]:
    """slot -> Kernel of a CUDA bf16 run with the default primitives at context parallelism ``cp``
    (FA3 and FLA present: the attention efficiencies were fitted to FA3 / TE runs); ``spec``: the
    model, whose attention options (sinks, window) may change the kernel."""
    return kernel_choice.kernel_table(
        PrimitivesConfig(), "cuda", "bfloat16", cp=cp, fla=fla, fa3=fa3, **attention_options(spec)
    )


def kernels_note(
    cp: int, has_gdn: bool, family: str | None = None, spec=None, tokens: int = 0
) -> str:
    """One line for the plan: the kernels its figures assume, the launch / sync counts measured
    for the family (per layer; with ``tokens``, the micro-batch's local tokens, the LM head + loss
    too and the micro-batch's total), and warnings when FLA or FA3 is absent here."""
    table = assumed_kernels(cp, spec=spec)
    if not has_gdn:
        table.pop("linear_attention")
        table.pop("conv")
    line = "kernels assumed (CUDA, bf16): " + kernel_choice.describe(table)
    line += " (activation memory still modelled with the eager glue and conv blocks: conservative)"
    launches, syncs, layout = measured_per_layer(family)
    if launches is not None:
        line += (
            f"; measured per layer per micro-batch with these kernels (emulated CUDA, {layout}, "
            f"benchmarks/launches.py): {launches} kernel launches, {syncs:g} host syncs"
        )
    if tokens and spec is not None and "loss" in table:
        from bumblebee.primitives.loss import linear_ce_tiles

        fwd, bwd = linear_ce_tiles.launches(tokens, spec.vocab)
        line += (
            f"; LM head + linear CE ({table['loss'].label}): {fwd + bwd} launches per micro-batch of "
            f"{tokens} tokens (counted from the tile loop, linear_ce_tiles.launches)"
        )
        if launches is not None:
            total = launches * len(spec.mixers) + fwd + bwd
            line += (
                f"; {len(spec.mixers)} layers + loss: ~{total:,} launches per micro-batch (without "
                f"pipeline stages)"
            )
    if has_gdn and not kernel_choice.package_present("fla"):
        line += (
            "; flash-linear-attention is not installed here: a run with these packages would use the "
            "pure-PyTorch chunked GDN core, which this plan does not model (pip install -e '.[gpu]')"
        )
    if kernel_choice.flash_impl() != "FA3":
        line += (
            "; FA3 is not available here (flash_attn_interface on a Hopper GPU): torch's flash ops "
            "would run FA2, slower than the FA3-class attention efficiencies assumed (not modelled)"
        )
    return line


def assumptions(cp: int, has_gdn: bool, spec=None) -> dict:
    """What every prediction of a plan assumes (``--json``: ``assumptions``): dtypes, the kernels
    the efficiencies and the memory terms follow, and which slots a run *with the packages of
    this environment* would execute in pure PyTorch on CUDA (its TFLOPs would be lower than
    predicted: the model does not cost those paths)."""
    table = assumed_kernels(cp, spec=spec)
    here = kernel_choice.kernel_table(
        PrimitivesConfig(), "cuda", "bfloat16", cp=cp, **attention_options(spec)
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
