"""Bytes a decoder layer's code keeps alive under full recompute, counted from that code.

``memory.py`` holds the planner's term formulas; the functions here are the pieces of them
that follow one module's code line by line (which tensor each Python local or autograd node
keeps, for how long), so that each can be read beside the module it counts: the norms
(``primitives/norms.py``), the router (``primitives/moe/router.py``), the decoder layer's
locals (``models/*.py``), the ring of flash-attention calls (``primitives/cp/ring_flash.py``)
and Gated DeltaNet's CP scan (``primitives/linear_attention/cp.py``, ``gdn.py``, ``fla.py``).
Each was checked against the dry run (``plan/dryrun.py``), which executes that code on fake
tensors: ``tests/unit/test_plan_dryrun.py`` asserts every term within 10% on both presets'
shapes; the figures are in ``skills/plan/memory.md``.

Units: bytes per local token (t = seq * micro_batch / cp; tensor parallelism divides by tp),
plus fixed bytes where a tensor does not grow with t.
"""

from __future__ import annotations

from bumblebee.plan.layout import Layout
from bumblebee.plan.spec import ModelSpec
from bumblebee.primitives.linear_attention.gdn import NORM_BLOCK

BF16, FP32 = 2, 4


def norm_bytes(spec: ModelSpec, tp: int) -> float:
    """Bytes per token one RMSNorm over H keeps for backward, its output included (the next matmul
    saves it): Qwen3's / DeepSeek's ``RMSNorm`` its fp32 input, the bf16 normalized cast the weight
    multiplies and the bf16 output (8H); Qwen3.5's ``ZeroCenteredRMSNorm`` its fp32 input, the fp32
    normalized value and the bf16 output (10H) (``primitives/norms.py``)."""
    return (FP32 + (FP32 if spec.fp32_norm else BF16) + BF16) * spec.hidden / tp


def router_bytes(spec: ModelSpec, tp: int) -> float:
    """The router's bf16 logits and fp32 probabilities [t, E] (``primitives/moe/router.py``)."""
    return (BF16 + FP32) * spec.experts / tp


def stream_tensors(spec: ModelSpec) -> int:
    """bf16 [t, H] tensors a decoder layer's forward holds as Python locals while its MLP block runs:
    the residual h and the block's normed input; a hybrid layer (Qwen3.5) also keeps the mixer's normed
    input and output: ``ModelSpec.stream_tensors``, set by the family."""
    return spec.stream_tensors


def attn_core_bytes(spec: ModelSpec, lay: Layout) -> tuple[float, float, str]:
    """Per-token transient bytes of the attention core beyond its inputs and saved tensors, counted from
    the code CUDA runs: (forward, backward, formula). cp > 1, ring of varlen flash calls
    (``primitives/cp/ring_flash.py``): forward the fp32 output accumulator and LSE, the next K/V block
    in flight, and per block pair (zigzag: t/2 queries) the kernel's bf16 output and the three fp32
    [t/2, N, D] temporaries of the merge; backward the contiguous dO, fp32 dQ and block dK/dV
    accumulators, the pair's gathered dO, Q, O, K, V and two pairs' kernel outputs dq/dk/dv (the
    previous pair's stay bound while the next call allocates). cp = 1 (``varlen_attn``): forward its
    bf16 output and LSE; backward dO's copy and dq/dk/dv. Checked: dry run of Qwen3-30B-A3B's
    attention (ep 4, cp 2) within 2% (forward 61.4 KB/token, backward 123 KB/token)."""
    tp = lay.tp
    nd = spec.n_heads * spec.head_dim / tp
    kvd = max(1.0, spec.n_kv_heads / tp) * spec.head_dim
    n = spec.n_heads / tp
    if lay.cp == 1:
        fwd, bwd = nd * BF16 + n * FP32, nd * BF16 + (nd + 2 * kvd) * BF16
        return fwd, bwd, f"varlen flash: fwd out {nd:.0f}x2 + lse; bwd dO copy + dq/dk/dv"
    fwd = nd * FP32 + n * FP32 + 2 * kvd * BF16 + (nd * BF16 + 3 * nd * FP32) / 2
    bwd = (
        nd * BF16
        + nd * FP32
        + 2 * kvd * FP32
        + (3 * nd + 2 * kvd) * BF16 / 2
        + 2 * (nd + 2 * kvd) * BF16 / 2
    )
    return (
        fwd,
        bwd,
        (
            f"ring: fwd fp32 o {nd:.0f}x4 + next K/V 2x{kvd:.0f}x2 + pair (t/2) out + 3 fp32 merge "
            f"temporaries; bwd dO + fp32 dq + fp32 dk/dv + pair gathers + 2 pairs' dq/dk/dv"
        ),
    )


def gdn_cp_bytes(
    spec: ModelSpec, lay: Layout, micro_batch: int = 1, tokens: int = 0
) -> dict[str, tuple[float, float]]:
    """A Gated DeltaNet (or KDA: same scan, per-channel fp32 gate) layer under context parallelism
    with full recompute, counted from its code
    (``linear_attention/gdn.py``, ``cp.py``, ``fla.py``): phase -> (bytes per token, fixed bytes).

    Per token (kd = Gk*K, vd = Hv*V, Hv*W with W = V+K: the extended core's value width):
    - "saved" (the layer's tensors after its recompute, at the MoE backward): bf16 pre-conv qkv and
      conv output 2 x 2(2kd+vd), z 2vd, fp32 beta/g/a 12Hv, the core's bf16 [v | 0] 2Hv*W, the fp32
      state correction 4vd, the corrected bf16 output 2vd, the gated norm's bf16 output 2vd;
    - "fwd" (first forward, at the gated norm): the same bf16 tensors, the fp32 [v | 0] and the core's
      fp32 output 2 x 4Hv*W, the fp32 correction 4vd, and the gated norm's fp32 input, silu(z) and
      product 12vd (autograd keeps nothing);
    - "recompute" (the recompute inside backward, at the gated norm): "saved" plus the fp32 [v | 0]
      and core output 2 x 4Hv*W, a second fp32 correction 4vd and the gated norm's fp32 12vd.
    Fixed (independent of t; R = 2 zigzag segments x micro-batch rows, C = cp): fp32 states
    [R, Hv, K, W] (initial, final, FLA's h0), the gathered transitions [C, R, Hv, K, W], the incoming
    states [R, Hv, K, V] and the scan's carried states. Checked: dry run of Qwen3.5-35B-A3B's shapes
    (ep 4, cp 2, 4K local tokens) within 1% per phase.

    The gated norm's fp32 12vd: a call over more than 2 x NORM_BLOCK tokens (``tokens``: the rank's
    tokens of one micro-batch, all rows) runs in blocks of NORM_BLOCK tokens (gdn.py), so the term
    is 12vd x NORM_BLOCK bytes, fixed, in "fwd" and "recompute" (checked at full size: Qwen3.5-35B-A3B,
    cp 4, 32K local tokens, where the per-token count over-predicted both moments by 20-27%)."""
    tp = lay.tp
    kd = spec.gdn_k_heads * spec.gdn_k_dim / tp
    vd = spec.gdn_v_heads * spec.gdn_v_dim / tp
    hv, k, v = spec.gdn_v_heads / tp, spec.gdn_k_dim, spec.gdn_v_dim
    hw = hv * (v + k)
    bf16 = 4 * (2 * kd + vd) + 2 * vd + 2 * vd  # pre-conv qkv, conv output, z, corrected output
    # fp32 gates: beta, g, a [Hv] each; KDA's decay is per key channel [Gk*K], kept three times
    # (f + dt_bias and softplus(.) for autograd, g for the core), plus beta [Hv]
    gates = 12 * kd + 4 * hv if spec.kda_gate_rank else 12 * hv
    saved = bf16 + gates + 2 * hw + 4 * vd + 2 * vd
    blocked = tokens > 2 * NORM_BLOCK
    norm_t, norm_fixed = (0.0, 12 * vd * NORM_BLOCK) if blocked else (12 * vd, 0.0)
    # KDA's separate q / k / v projections before their concat, transient
    proj = 2 * (2 * kd + vd) if spec.kda_gate_rank else 0.0
    fwd = bf16 + gates + 8 * hw + 4 * vd + norm_t + 2 * vd + proj
    recompute = saved + 8 * hw + 4 * vd + norm_t + proj
    r, c = 2 * micro_batch, lay.cp
    state_w, state_v = r * hv * k * (v + k) * FP32, r * hv * k * v * FP32
    return {
        "saved": (saved, (1 + c) * state_w + state_v + 2 * state_v / r),
        "fwd": (fwd, (2 + c) * state_w + state_v + norm_fixed),
        "recompute": (recompute, (3 + c) * state_w + state_v + 2 * state_v / r + norm_fixed),
    }
