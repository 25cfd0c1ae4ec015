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
    with full recompute, counted from the code CUDA runs (``linear_attention/gdn.py``, ``cp.py``, the
    two-call form of ``cp_probe.py``, ``fla.py``): phase -> (bytes per token, fixed bytes), at
    ``tokens`` (the rank's tokens of one micro-batch, all rows) where a phase has two candidate
    peaks. The probe is counted over whole segments (p = m, each row's first document spanning it):
    a cut probe keeps less (``cp_probe.probe_rows`` cuts only then).

    Per token (kd = Gk*K, vd = Hv*V, hk = Hv*K):
    - "saved" (the layer's tensors after its recompute, at the MoE backward): bf16 pre-conv qkv and
      conv output 2 x 2(2kd+vd), z 2vd, the scan's output 2vd (the gated norm's input), fp32
      beta/g/a 12Hv, the probe's bf16 output e 2hk (``StateCorrection`` keeps it; the two FLA calls
      keep views of the conv output and a stride-0 zero), the gated norm's bf16 output 2vd;
    - "fwd" (first forward; autograd keeps nothing), the larger of: at the gated norm, the bf16
      tensors and its fp32 input, silu(z) and product 12vd plus a bf16 2vd; inside
      ``StateCorrection`` at its GEMM, the bf16 tensors but the scan's output, o|0 2vd, e 2hk, its
      fp32 copy 4hk and the fp32 product 4vd (the larger one at 32K tokens, where the norm is blocked);
    - "recompute" (the mixer's backward, after its recompute), the larger of: the gated norm's
      backward, "saved" less its output plus the norm's recomputed fp32 input, z and silu(z), two bf16
      products and two fp32 gradients 24vd; ``StateCorrection``'s backward, the bf16 tensors less
      z and the output, e, the bf16 gradients of the norm's inputs 4vd, the fp32 output gradient 4vd,
      e's bf16 gradient 2hk and the fp32 e 4hk.
    Fixed (R = 2 zigzag segments x micro-batch rows, C = cp; fp32 [R, Hv, K, X] states
    state_X): the gathered transitions C state_(V+K) and the scan's carried states 2 state_V / R
    (kept by the scan's products), the probe's I_K state_K (kept by its FLA call), S_in state_V (kept
    by ``StateCorrection``); its backward adds dS_in state_V, its forward holds S_in only.
    "fla_bwd": the values call's FLA backward, the one moment FLA's chunk-state workspace is alive
    (``layer_moments`` adds it there, not at the two peaks above).
    Above 2 x NORM_BLOCK tokens the gated norm runs in blocks (gdn.py): its fp32 terms are fixed,
    12vd x NORM_BLOCK forward and 28vd x NORM_BLOCK in backward (one more fp32 gradient than
    unblocked), and each block's bf16 input gradients 4vd per token wait for the split's backward.
    Checked: dry run of Qwen3.5-35B-A3B's shapes (ep 4, cp 2) at 2K-32K local tokens (skills/plan/memory.md)."""
    tp = lay.tp
    kd = spec.gdn_k_heads * spec.gdn_k_dim / tp
    vd = spec.gdn_v_heads * spec.gdn_v_dim / tp
    hv, k, v = spec.gdn_v_heads / tp, spec.gdn_k_dim, spec.gdn_v_dim
    hk = hv * k
    bf16 = 4 * (2 * kd + vd) + 2 * vd + 2 * vd  # pre-conv qkv, conv output, z, the scan's output
    # fp32 gates: beta, g, a [Hv] each; KDA's decay is per key channel [Gk*K], kept three times
    # (f + dt_bias and softplus(.) for autograd, g for the core), plus beta [Hv]
    gates = 12 * kd + 4 * hv if spec.kda_gate_rank else 12 * hv
    saved = bf16 + gates + 2 * hk + 2 * vd
    blocked = tokens > 2 * NORM_BLOCK
    nb = NORM_BLOCK if blocked else 0
    # KDA's separate q / k / v projections before their concat, transient
    proj = 2 * (2 * kd + vd) if spec.kda_gate_rank else 0.0
    r, c = 2 * micro_batch, lay.cp
    state_w, state_v, state_k = (r * hv * k * x * FP32 for x in (v + k, v, k))
    kept = c * state_w + 2 * state_v / r + state_k + state_v

    def larger(*cands):  # (per token, fixed) of the candidate peak largest at `tokens`
        return max(cands, key=lambda pf: pf[0] * max(tokens, 1) + pf[1])

    fwd = larger(
        (bf16 + gates + (0 if blocked else 12 * vd) + 2 * vd + proj, 12 * vd * nb),
        (bf16 + gates + 6 * hk + 4 * vd, state_v),
    )
    recompute = larger(
        (saved - 2 * vd + (4 * vd if blocked else 24 * vd) + proj, kept + 28 * vd * nb),
        (bf16 - 4 * vd + gates + 2 * hk + 8 * vd + 6 * hk, kept + state_v),
    )
    # the values call's FLA backward (the probe's has run): the bf16 tensors less z and the output,
    # the norm inputs' gradients 4vd, the probe's dq, dk 4kd and dense dv 2hk, the call's own dq, dk,
    # dv 2(2kd+vd); FLA's chunk-state workspace is alive only here (layer_moments adds it)
    fla_bwd = (bf16 - 4 * vd + gates + 4 * vd + 4 * kd + 2 * hk + 2 * (2 * kd + vd), kept)
    return {"saved": (saved, kept), "fwd": fwd, "recompute": recompute, "fla_bwd": fla_bwd}


def gdn_cp_backward(spec: ModelSpec, lay: Layout) -> float:
    """Per-token bytes of the GDN CP scan's backward (``cp.StateCorrection``): its kept e, the fp32
    output gradient, e's fp32 copy and its bf16 gradient (0 without CP)."""
    if lay.cp == 1:
        return 0.0
    hv, v, k = spec.gdn_v_heads / lay.tp, spec.gdn_v_dim, spec.gdn_k_dim
    return hv * k * BF16 + hv * v * FP32 + hv * k * (FP32 + BF16)


def gdn_state_bytes(spec: ModelSpec, tp: int, chunk: int = 64) -> float:
    """Chunk states h [t/C, Hv, Dk, Dv] recomputed in backward, and their gradient (bf16). KDA's
    state is the same [Hv, Dk, Dv] (its per-channel decay changes the transition, not the state);
    FLA's chunk_kda also uses 64-token chunks."""
    return 2 * BF16 * spec.gdn_v_heads / tp * spec.gdn_k_dim * spec.gdn_v_dim / chunk
