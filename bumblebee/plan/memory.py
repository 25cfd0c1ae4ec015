"""Analytic per-GPU memory: the bytes of each term, per token or per stage (formulas only).

``timeline.py`` places these terms on the moments of a training step (forward of a layer,
recomputed backward of a layer, loss, optimizer step) and takes the largest moment per
pipeline stage as its peak. Every function here returns bytes and the formula it used, so
``bumblebee plan --explain`` prints exactly what the peak is made of. The formulas follow
the code that runs (bumblebee's primitives on the CUDA kernels ``plan/kernels.py`` names);
``plan/dryrun.py`` executes that code on fake tensors and measures each term (how each was
checked: see the dry-run figures in ``skills/plan/memory.md``).

Static state (ZeRO, Rajbhandari et al. 2020; Megatron distributed optimizer): bytes per
parameter. ``none``: bf16 parameters 2 + fp32 gradients 4 + fp32 master, Adam m, v 12, all
replicated. ``zero1``: the 12 sharded over the data-parallel ranks of the parameter (dense:
dp*cp, experts: edp). ``fsdp2`` (torch ``fully_shard`` with a bf16 compute policy): fp32
sharded parameters (they are the master copy) 4 + fp32 sharded gradients 4 + Adam m, v 8,
all sharded; the bf16 compute copy exists per unit (the all-gather term). Dense matrices
split by tp, routed experts by ep.

Activations, per local token (t = seq * micro_batch / cp tokens; sequence parallel divides
everything by tp):
- saved inputs: what one micro-batch keeps between its forward and its backward on a stage
  (``full``: each layer's bf16 input; ``selective``: the non-elementwise tensors; ``none``:
  every saved tensor, routed rows included); while layer j runs (or is recomputed and runs
  backward) only layers 0..j of its micro-batch have saved theirs, so a layer kind peaks at
  its last layer on the stage (``timeline.py``);
- live layer: under full recompute, counted from the code: the layer's recomputed saved
  tensors (mixer, its input norm ``norm_bytes``, the MLP block's norm, the router) and the
  gradients in flight at the MoE backward; the attention mixer's forward and backward are the
  core's inputs, saved tensors and gradients plus the core's transients (``attn_core_bytes``:
  ring of flash calls under CP); Gated DeltaNet under CP has its own counts (``gdn_cp_bytes``).
  Other recompute policies keep the older estimate (saved tensors, ``BWD_GRAD_FRACTION`` of
  them as gradients in flight, the CP buffers of ``cp_extra``), not checked by a dry run;
- MoE routed buffers: every [k*t, .] tensor of the dispatch / expert / combine code at its
  largest moment, counted per ``moe_comm`` in ``routed_bytes.py``, plus, in backward, the
  experts' weight gradients;
- loss: ``ce`` keeps bf16 logits and one fp32 working copy that softmax and its gradient
  reuse in place (6 B per logit of the [t, V/tp] block; ``primitives/loss/ce.py``) beside
  the final norm's saved tensors; ``linear_ce`` the head's bf16 gradient, the final norm, an
  fp32 dh and the bf16 hidden gradient [t, H], and its tiles;
- optimizer temporaries: torch's foreach AdamW allocates one fp32 tensor per parameter it
  updates (``sqrt(v)``), 4 B per local (sharded) parameter.

Legend: t local tokens, H hidden, V vocabulary (k, F, X, A: ``routed_bytes.py``).
"""

from __future__ import annotations

from bumblebee import registry
from bumblebee.config import PrimitivesConfig
from bumblebee.plan.layer_bytes import gdn_cp_backward, norm_bytes
from bumblebee.plan.layout import Layout, Workload
from bumblebee.plan.spec import ATTN, MOE, ModelSpec
from bumblebee.primitives import loss as _losses  # noqa: F401  (registers their costs)
from bumblebee.primitives import sharding as _shardings  # noqa: F401  (registers their costs)
from bumblebee.primitives.loss.costs import LossCosts
from bumblebee.primitives.moe.costs import MoeCommCosts
from bumblebee.primitives.sharding.costs import ShardingCosts

BF16, FP32 = 2, 4
# Gradient buffers alive in a layer's backward, relative to its saved tensors: small because
# autograd frees each saved tensor once its node has run. Checked, not fitted: the dry run of
# one layer measures 0.1-0.2 (see skills/plan/memory.md).
BWD_GRAD_FRACTION = 0.15
ADAM_TEMP_B = FP32  # foreach AdamW: sqrt(v) for every parameter it updates


def stage_layers(spec: ModelSpec, pp: int) -> list[range]:
    """Contiguous, near-even split of the decoder layers over pp stages."""
    base, extra = divmod(spec.layers, pp)
    out, start = [], 0
    for s in range(pp):
        n = base + (1 if s < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


def stage_kinds(spec: ModelSpec, layers: range) -> dict[tuple[str, str], int]:
    """(mixer, mlp) kind -> number of such layers on the stage (layers of one kind are identical)."""
    kinds: dict[tuple[str, str], int] = {}
    for i in layers:
        key = (spec.mixers[i], spec.mlps[i])
        kinds[key] = kinds.get(key, 0) + 1
    return kinds


def kind_params(spec: ModelSpec, kind: tuple[str, str]) -> tuple[int, int]:
    """(non-expert, expert) parameters of one layer of this kind."""
    dense, expert = spec.mlp_params(kind[1])
    return spec.mixer_params(kind[0]) + dense, expert


def local_tokens(work: Workload, lay: Layout) -> int:
    return work.seq * work.micro_batch // lay.cp


def micro_batches(work: Workload, lay: Layout) -> int:
    return max(1, work.global_batch // (lay.dp_shard * work.micro_batch))


def in_flight(
    work: Workload, lay: Layout, stage: int, prims: PrimitivesConfig | None = None
) -> int:
    """Micro-batches whose saved inputs are alive at once on ``stage``: 1F1B's ``min(pp - s, m)``;
    at pp = 1 the step balance loss (``train.balance`` "auto" or "step") runs every
    micro-batch's forward before the first backward (runtime/step.py), so all ``m`` are; with
    ``moe_comm = overlap_mb`` two run at once (``pair_factor``), so at least two are."""
    m = micro_batches(work, lay)
    if lay.pp == 1 and work.balance in ("auto", "step"):
        return m
    return max(min(lay.pp - stage, m), min(pair_factor(prims), m))


def pair_factor(prims: PrimitivesConfig | None) -> int:
    """Micro-batches inside a layer at once: 2 under a paired exchange (``moe_comm =
    overlap_mb``: each one's all-to-alls run under the other's compute, so both hold a layer's
    working set), else 1."""
    return 2 if prims is not None and registry.paired(prims) else 1


# ------------------------------------------------------------------------ static state (bytes)


def sharding_costs(prims: PrimitivesConfig) -> ShardingCosts:
    """The configured sharding's cost facts, declared next to its code (primitives/sharding/)."""
    return registry.get("sharding", prims.sharding).costs


def static_bytes(
    spec: ModelSpec, lay: Layout, prims: PrimitivesConfig, layers: range, first: bool, last: bool
):
    """(parameters, gradients, optimizer, parameters this rank's optimizer updates, formula)."""
    kinds = stage_kinds(spec, layers)
    dense = sum(n * kind_params(spec, k)[0] for k, n in kinds.items())
    expert = sum(n * kind_params(spec, k)[1] for k, n in kinds.items())
    if first:
        dense += spec.embed_params
    if last:
        dense += spec.head_params if not (spec.tied and lay.pp == 1) else spec.hidden
        if spec.tied and lay.pp > 1:
            dense += spec.embed_params  # the last stage keeps its own copy of the tied weight
    d, e = dense / lay.tp, expert / lay.ep
    shard = d / (lay.dp_shard * lay.cp) + e / lay.edp
    where = f"dense {d / 1e9:.3f}B/tp-shard, experts {e / 1e9:.3f}B/ep-shard"
    c = sharding_costs(prims)
    own = d + e  # parameters of this rank's stage, tp and ep shards
    why = c.explain.format(
        shard=shard / 1e9, full=own / 1e9, where=where, dpcp=lay.dp_shard * lay.cp, edp=lay.edp
    )
    return (
        c.param_bytes * (shard if c.params_sharded else own),
        c.grad_bytes * (shard if c.params_sharded else own),
        c.optim_bytes * (shard if c.optim_sharded else own),
        shard if c.optim_sharded else own,
        f"{prims.sharding}: {why}",
    )


def allgather_bytes(
    spec: ModelSpec, lay: Layout, layers: range, first: bool, last: bool
) -> tuple[float, float]:
    """FSDP2 units = decoder layers (+ embedding, + LM head): (forward, backward) bytes of the
    unit being computed and the prefetched one in bf16; backward adds the unsharded fp32
    gradient of one unit before its reduce-scatter."""
    layer = (
        max(
            kind_params(spec, k)[0] / lay.tp + kind_params(spec, k)[1] / lay.ep
            for k in stage_kinds(spec, layers)
        )
        if len(layers)
        else 0.0
    )
    units = [layer] * min(len(layers), 2)  # identical-size neighbours suffice for the max pair
    if first:
        units.insert(0, spec.embed_params / lay.tp)
    if last:
        units.append(spec.head_params / lay.tp)
    if not units:
        return 0.0, 0.0
    pair = max(units[i] + (units[i + 1] if i + 1 < len(units) else 0.0) for i in range(len(units)))
    return BF16 * pair, BF16 * pair + FP32 * max(units)


# ---------------------------------------------------------------- activations (bytes per local token)


def mixer_act(spec: ModelSpec, kind: str, tp: int) -> tuple[float, float]:
    """(kept, cheap) saved bytes per token of the token mixer: ``selective`` keeps ``kept`` and
    recomputes ``cheap``; both include the sub-layer input and the RMSNorm's fp32 upcast."""
    h = spec.hidden
    if kind == ATTN:
        nd = spec.n_heads * spec.head_dim / tp
        kvd = max(1.0, spec.n_kv_heads / tp) * spec.head_dim
        g = 1 if spec.attn_gate else 0
        if (
            not g
        ):  # Qwen3: q/k RMSNorm keep their fp32 input and bf16 normalized output; the core keeps
            # roped q, k, v, its output and fp32 logsumexp (skills/plan/memory.md: checked by the dry run)
            kept = (2 * nd + 2 * kvd + 2 * spec.n_heads / tp + h / tp) * BF16
            cheap = (nd + kvd + h / tp) * BF16 + (h / tp + nd + kvd) * FP32
            return kept, cheap
        # q(+gate) and k, v projections, flash-attention output + fp32 logsumexp
        kept = nd * (1 + g) + 2 * kvd + nd + 2 * spec.n_heads / tp
        # roped q/k, gated output; normed input, q/k before RoPE, sigmoid(gate) and the gated product
        cheap = nd + kvd + nd * g + h / tp + nd + kvd + 2 * nd * g
        return kept * BF16 + h / tp * BF16, cheap * BF16 + (h / tp + nd + kvd) * FP32
    kd = spec.gdn_k_heads * spec.gdn_k_dim / tp
    vd = spec.gdn_v_heads * spec.gdn_v_dim / tp
    vh = spec.gdn_v_heads / tp
    cheap = (2 * kd + vd) + 2 * kd  # conv output, l2-normed q/k
    if spec.kda_gate_rank:  # KDA: the decay is per key channel (fp32 [Hk*K] per token, not [Hv])
        r = spec.kda_gate_rank  # the low-rank gates' inner activations (not split by TP)
        kept = (2 * kd + vd) + vd + vh + 2 * r + vd  # q/k/v, output gate, beta, f_a/g_a, core out
        # fp32 decay kept three times: f + dt_bias and softplus(.) (autograd), g (the core)
        return kept * BF16 + 3 * kd * FP32 + h / tp * BF16, cheap * BF16 + (h / tp + vd) * FP32
    kept = (2 * kd + vd) + vd + 2 * vh + vd  # in_proj qkv, z, b/a, core output
    return kept * BF16 + 2 * vh * FP32 + h / tp * BF16, cheap * BF16 + (h / tp + vd) * FP32


def cp_extra(spec: ModelSpec, kind: str, lay: Layout) -> tuple[float, float, str]:
    """Per-token bytes a layer adds under context parallelism: (kept for backward, transient in a
    forward or backward of the mixer), and the formula."""
    if lay.cp == 1:
        return 0.0, 0.0, ""
    tp = lay.tp
    if kind == ATTN and spec.dsa_topk:  # DSA fetches its keys: plan/dsa_terms.py
        return 0.0, 0.0, ""
    if kind == ATTN and spec.mla:  # MLA's latent ring (primitives/cp/ring_latent.py)
        x = spec.mla_kv_rank + spec.mla_rope_dim
        nd = spec.n_heads * spec.head_dim / tp
        kv = spec.n_heads / tp * (spec.head_dim + spec.mla_v_dim)  # one block expanded: K + V
        b = 2 * x * BF16 + kv * BF16 + 2 * nd * FP32 + kv * FP32 + 2 * x * FP32
        return (
            0.0,
            b,
            (
                f"latent ring: latent blocks 2x{x}x2 + expanded K/V {kv:.0f}x2 + fp32 o/dq 2x{nd:.0f}x4 "
                f"+ fp32 block dK/dV {kv:.0f}x4 + fp32 d latent 2x{x}x4 (mixer only)"
            ),
        )
    if (
        kind == ATTN
    ):  # ring: current + next K/V block, fp32 out/dq accumulators, fp32 dk/dv in flight
        nd = spec.n_heads * spec.head_dim / tp
        kvd = max(1.0, spec.n_kv_heads / tp) * spec.head_dim
        b = 4 * kvd * BF16 + 2 * nd * FP32 + 4 * kvd * FP32
        return (
            0.0,
            b,
            f"ring K/V 4x{kvd:.0f}x2 + fp32 o/dq 2x{nd:.0f}x4 + fp32 dk/dv 4x{kvd:.0f}x4 (mixer only)",
        )
    # Gated DeltaNet CP scan on FLA (linear_attention/cp.py, cp_probe.py): kept, the probe's bf16 e
    # (StateCorrection); forward, o|0 beside the output, e's fp32 copy and the fp32 product; backward
    # (gdn_cp_backward), e and the fp32 output gradient, e's fp32 copy and bf16 gradient
    hv, v, k = spec.gdn_v_heads / tp, spec.gdn_v_dim, spec.gdn_k_dim
    moving = hv * v * BF16 + hv * k * FP32 + hv * v * FP32
    return (
        hv * k * BF16,
        moving,
        f"GDN CP scan: kept bf16 e {hv:.0f}x{k}x2; forward {moving:.0f} B/token; backward "
        f"{gdn_cp_backward(spec, lay):.0f} B/token",
    )


def mlp_act(spec: ModelSpec, kind: str, tp: int) -> tuple[float, float]:
    """(kept, cheap) saved bytes per token of the MLP block without its routed rows."""
    h = spec.hidden
    if kind != MOE:
        f = spec.dense_ffn
        return (h + 2 * f) * BF16 / tp, (h + f) * BF16 / tp
    fs = spec.shared_ffn
    kept = h * BF16 + spec.experts * FP32  # input, router probs
    cheap = h * FP32 + spec.experts * FP32  # fp32 norm upcast, softmax
    if fs:
        kept += (2 * fs + h) * BF16
        cheap += fs * BF16
    return kept / tp, cheap / tp


# ------------------------------------------------------------------------------------ loss (bytes)


def moe_costs(prims: PrimitivesConfig) -> MoeCommCosts:
    """The chosen MoE exchange's declared costs (primitives/moe/costs.py)."""
    return registry.get("moe_comm", prims.moe_comm).costs


def loss_costs(prims: PrimitivesConfig) -> LossCosts:
    """The configured loss's cost facts, declared next to its code (primitives/loss/)."""
    return registry.get("loss", prims.loss).costs


def loss_kept(spec: ModelSpec, lay: Layout, prims: PrimitivesConfig) -> float:
    """Bytes per token a micro-batch's finished loss forward keeps for its backward: the final norm's
    saved tensors (its bf16 output is the head's input) and the loss's own (``linear_ce``: the
    per-token int64 target, valid flag and fp32 log-sum-exp; ``ce``: its fp32 log-probabilities
    [t, V/tp]; checked: dry run 0.08 and 0.35 GB at 4K tokens, Qwen3.5 dims, 16K vocabulary)."""
    c, norm = loss_costs(prims), norm_bytes(spec, 1)
    return norm + c.kept_per_token + c.kept_per_logit * spec.vocab / lay.tp


def loss_bytes(
    spec: ModelSpec, lay: Layout, prims: PrimitivesConfig, work: Workload
) -> tuple[float, str]:
    """Loss temporaries on the last stage at the loss moment. Tokens: all t local tokens
    (the LM head's input is gathered over tp; its vocabulary is split over tp)."""
    t, h = local_tokens(work, lay), spec.hidden
    vshard = spec.vocab / lay.tp
    norm = norm_bytes(spec, 1)  # the final norm's saved tensors (the hidden is gathered over tp)
    c = loss_costs(prims)
    b = (
        t * vshard * c.work_per_logit
        + t * norm
        + c.work_per_hidden * t * h
        + c.head_grad_per_weight * vshard * h
        + c.workspace
    )
    return b, f"{prims.loss}: " + c.explain.format(t=t, v=vshard, h=h, norm=norm)
