"""MoE routed buffers, per local token: the planner's counts of the [k*t, .] tensors of each ``moe_comm``
(declared by each implementation: ``MoeCommCosts.routed``, primitives/moe/costs.py).

Every [k*t, .] tensor of the dispatch / expert / combine code at its
largest moment, in units X = one bf16 [k*t, H] row tensor and A = one bf16 [k*t, F]
(balanced routing: this rank's experts receive k*t rows). Counted from the code of each
``moe_comm`` (Python locals keep a tensor alive until the function returns):
  local     fwd max(2X+4A, 3X)   recompute (4-e)X+4A   backward 4X+5A
  alltoall  fwd max(4X+4A, 7X)   recompute (8-e)X+4A   backward 4X+5A   (overlap_mb: alike,
            for each of the two micro-batches inside a layer at once, ``pair_factor``)
  chunked   fwd 3X+2A+3X/c       recompute 2X+2A/c     backward 4X+4A+(X+5A)/c, or 4X+4A+2A/c
(split into home-side and expert-side tensors; skewed routing scales the expert side)
plus, in backward, the experts' weight gradients (``expert_grad_bytes``). alltoall's
combine path holds send, receive, regrouped, expert output, returned and unpermuted
copies at once; a recompute stops before allocating the output of the layer's last op
that saves (torch's early stop): without a shared expert (e = 1) that is the combine's
weighted product; chunked issues every chunk's dispatch up front, its recompute skips fc2
and the combine, and its backward peaks at the first delayed wgrad (every chunk's output
gradient and dh, the last chunk's dgrad locals, dx sent and received, fc1's weight
gradient) or at the second (fc1's gradients summed beside fc2's).

``memory.py`` holds the other terms; ``layer_moments.py`` places these on a layer's moments.
Legend: t local tokens, H hidden, k experts per token, F expert FFN.
"""

from __future__ import annotations

from bumblebee.config import PrimitivesConfig
from bumblebee.plan.layout import Layout
from bumblebee.plan.memory import BF16, moe_costs
from bumblebee.plan.spec import ModelSpec


def routed_units(spec: ModelSpec, tp: int) -> tuple[float, float]:
    """(X, A): bytes per local token of one bf16 [k*t, H] and one bf16 [k*t, F] routed tensor."""
    return spec.top_k * spec.hidden * BF16 / tp, spec.top_k * spec.expert_ffn * BF16 / tp


def routed_buffers(
    spec: ModelSpec, prims: PrimitivesConfig, tp: int, skew: float = 1.0
) -> dict[str, tuple[float, str]]:
    """Per-token bytes of the routed [k*t, .] tensors alive at the MoE block's largest moment of
    each phase: "fwd" (a forward whose tensors autograd does not keep: full recompute's first
    pass), "recompute" (the forward again, inside backward, saving) and "bwd". Each count is
    split into home-side tensors (this rank's own k*t rows: permuted, sent, returned) and
    expert-side ones (rows this rank's experts receive), which ``skew`` scales: with skewed
    routing this rank's experts receive ``skew`` x the balanced k*t rows."""
    X, A = routed_units(spec, tp)
    c = max(1, prims.moe_chunks)
    # a recompute stops at the layer's last op that saves a tensor (torch's early stop), before that op
    # allocates its output: without a shared expert after it, the combine's weighted product is never made
    last = 0 if spec.shared_ffn else 1
    costs = moe_costs(prims)
    f = skew if costs.exchanges else 1.0

    def total(v):  # unskewed bytes of one candidate moment
        (hx, ha), (ex, ea) = v
        return (hx + ex) * X + (ha + ea) * A

    # phase -> (home, expert side), in units of X and A: (x, a) pairs; the largest moment
    table = {ph: max(alts, key=total) for ph, alts in costs.routed(c, last).items()}
    out = {}
    for phase, ((hx, ha), (ex, ea)) in table.items():
        v = hx * X + ha * A + f * (ex * X + ea * A)
        out[phase] = (
            v,
            f"home {hx:g}X+{ha:g}A + {f:g} x expert side {ex:g}X+{ea:g}A, X={X:.0f}, A={A:.0f} B/token",
        )
    return out


def expert_grad_bytes(
    spec: ModelSpec, lay: Layout, prims: PrimitivesConfig, phase: str = "bwd"
) -> float:
    """Bytes of the local experts' weight gradients (bf16, the compute dtype) alive at a MoE
    backward's ``phase``: chunked's first delayed wgrad holds fc1's; its second sums fc1's over
    chunks (dw + new -> sum: 3 x fc1) beside fc2's; the others fc1's and fc2's."""
    w1 = spec.experts / lay.ep * 2 * spec.expert_ffn * spec.hidden * BF16
    w2 = spec.experts / lay.ep * spec.expert_ffn * spec.hidden * BF16
    return moe_costs(prims).expert_grads(w1, w2, phase)


def routed_saved(spec: ModelSpec, prims: PrimitivesConfig, tp: int) -> float:
    """Routed bytes per token one micro-batch keeps to its backward without full recompute."""
    X, A = routed_units(spec, tp)
    return 2 * X + (4 * A if prims.recompute == "none" else 2 * A)
