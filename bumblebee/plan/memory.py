"""Analytic per-GPU memory model: static state, activations, loss temporaries, buffers.

Computed per pipeline stage (stages differ: the first holds the embedding and
the most in-flight micro-batches, the last holds the LM head and the logits),
in bytes, then reported in GB. The arithmetic follows the ZeRO paper (Rajbhandari et al., 2020) and Megatron-LM's
distributed-optimizer accounting:

- static state, bf16 parameters (2 B) + fp32 gradients (4 B) + fp32 master and
  Adam moments (12 B) per parameter. ``none`` replicates all of it; ``zero1``
  (Megatron distributed optimizer) shards the 12 B over the data-parallel ranks
  of each parameter (dense: dp*cp, experts: edp); ``fsdp2`` (ZeRO-3) shards all
  18 B, plus all-gather buffers for the unit being computed and the prefetched one.
  Dense matrices are split by tp, routed experts by ep.
- activations: what 1F1B keeps for its in-flight micro-batches (``min(pp - s, m)``
  on stage s) -- every saved tensor (``none``), the non-elementwise ones
  (``selective``) or only each layer's input (``full``) -- plus the working set of
  one layer's (re)forward and backward.
- loss temporaries on the last stage: ``ce`` materializes [tokens, vocab/tp]
  logits (bf16 GEMM output, fp32 copy, fp32 log-probs / gradient); ``linear_ce``
  only a token chunk of them. They do not coexist with a layer's backward working
  set, so a stage's peak is the larger of the two moments.
- MoE dispatch buffers: the routed-token copies [k * tokens, H] that all-to-all
  sends and receives; chunked EP keeps two chunks' worth of send/receive buffers
  in flight and, under full recompute, skips the combine in the recompute forward.
- overhead: fixed (context, workspaces, NCCL) + fragmentation of transient memory.

Legend: t local tokens of one micro-batch (seq * micro_batch / cp), H hidden,
k experts per token, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from bumblebee.plan.hardware import FIXED_OVERHEAD_GB, FRAGMENTATION, GB
from bumblebee.plan.layout import Layout, Primitives, Workload
from bumblebee.plan.spec import ATTN, MOE, ModelSpec

BF16, FP32 = 2, 4
PARAM_B, GRAD_B, OPTIM_B = 2, 4, 12  # bytes/param: bf16 params, fp32 grads, fp32 master + Adam m, v (ZeRO, 2020)
# Gradient buffers alive in a layer's backward, relative to its saved tensors: small,
# because autograd frees each saved tensor once its node has run (dry run: 0.1-0.2).
BWD_GRAD_FRACTION = 0.15
CE_BYTES_PER_LOGIT = BF16 + FP32 + FP32  # ce.py's peak: bf16 logits, fp32 copy and fp32 log-probs / grad (dry run: 10 B)


@dataclass
class MemoryBreakdown:
    """Per-GPU bytes of one pipeline stage."""

    parameters: float = 0.0
    gradients: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    logits: float = 0.0
    moe_buffers: float = 0.0
    allgather: float = 0.0
    overhead: float = 0.0

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))

    def as_gb(self) -> dict[str, float]:
        out = {"total": round(self.total / GB, 2)}
        out.update({f.name: round(getattr(self, f.name) / GB, 2) for f in fields(self)})
        return out


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


# ---------------------------------------------------------------------------------------------
# activations of one layer (bytes per local token on one GPU), split into tensors that a
# selective policy keeps ("kept") and cheap elementwise outputs it recomputes ("cheap")


def mixer_act(spec: ModelSpec, kind: str, tp: int) -> tuple[float, float]:
    h = spec.hidden
    if kind == ATTN:
        nd = spec.n_heads * spec.head_dim / tp
        kvd = max(1.0, spec.n_kv_heads / tp) * spec.head_dim
        g = 1 if spec.attn_gate else 0
        # q(+gate) and k, v projections, flash-attention output + fp32 logsumexp
        kept = nd * (1 + g) + 2 * kvd + nd + 2 * spec.n_heads / tp
        cheap = nd + kvd + nd * g  # roped q/k, gated output
        # + the sub-layer input; RMSNorms keep their fp32 upcast for backward (norms.py)
        return kept * BF16 + h / tp * BF16, cheap * BF16 + (h / tp + nd + kvd) * FP32
    kd = spec.gdn_k_heads * spec.gdn_k_dim / tp
    vd = spec.gdn_v_heads * spec.gdn_v_dim / tp
    vh = spec.gdn_v_heads / tp
    kept = (2 * kd + vd) + vd + 2 * vh + vd  # in_proj qkv, z, b/a, core output
    cheap = (2 * kd + vd) + 2 * kd  # conv output, l2-normed q/k
    # + fp32 decay/beta, the input; fp32 upcasts of the input RMSNorm and the gated output norm
    return kept * BF16 + 2 * vh * FP32 + h / tp * BF16, cheap * BF16 + (h / tp + vd) * FP32


def gdn_state_bytes(spec: ModelSpec, tp: int, chunk: int = 64) -> float:
    """Chunk states h [t/C, Hv, Dk, Dv] recomputed in backward, and their gradient (bf16)."""
    return 2 * BF16 * spec.gdn_v_heads / tp * spec.gdn_k_dim * spec.gdn_v_dim / chunk


def mlp_act(spec: ModelSpec, kind: str, tp: int) -> tuple[float, float, float]:
    """(kept, cheap, routed-token dispatch tensors) bytes per local token; tokens are
    sequence-parallel over tp, so everything scales 1/tp."""
    h, k = spec.hidden, spec.top_k
    if kind != MOE:
        f = spec.dense_ffn
        return (h + 2 * f) * BF16 / tp, (h + f) * BF16 / tp, 0.0
    f, fs = spec.expert_ffn, spec.shared_ffn
    kept = h * BF16 + spec.experts * FP32 + k * (2 * f) * BF16  # input, router probs, expert fc1 output
    cheap = h * FP32 + spec.experts * FP32 + 2 * k * f * BF16  # fp32 norm upcast, softmax, silu(gate), SwiGLU out
    if fs:
        kept += (2 * fs + h) * BF16
        cheap += fs * BF16
    routed = k * h * BF16  # one [k*t, H] routed-token tensor
    return kept / tp, cheap / tp, routed / tp


def moe_buffer_count(prims: Primitives) -> float:
    """Routed-token [k*t, H] tensors alive at a MoE layer's peak: dispatch receive (the
    expert input, saved) + combine receive (saved for the routing-weight gradient) +
    one send and one receive buffer in flight (none for the single-rank ``local``).
    Chunked EP holds two chunks of the in-flight pair and, under full recompute,
    keeps no combine receive."""
    if prims.moe_comm == "chunked":
        c = max(1, prims.moe_chunks)
        saved = 1 if prims.recompute == "full" else 2
        return saved + 2 * min(1.0, 2.0 / c)
    return 2.0 if prims.moe_comm == "local" else 4.0


# ---------------------------------------------------------------------------------------------


def _static(spec: ModelSpec, lay: Layout, prims: Primitives, layers: range, first: bool, last: bool):
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
    shard_d, shard_e = d / (lay.dp_shard * lay.cp), e / lay.edp
    if prims.sharding == "fsdp2":
        return PARAM_B * (shard_d + shard_e), GRAD_B * (shard_d + shard_e), OPTIM_B * (shard_d + shard_e)
    if prims.sharding == "zero1":
        return PARAM_B * (d + e), GRAD_B * (d + e), OPTIM_B * (shard_d + shard_e)
    return PARAM_B * (d + e), GRAD_B * (d + e), OPTIM_B * (d + e)


def _allgather(spec: ModelSpec, lay: Layout, layers: range, first: bool, last: bool) -> float:
    """FSDP2 units = decoder layers (+ embedding, + LM head): the unit being computed and
    the prefetched one in bf16, and the unsharded fp32 gradient of one unit in backward."""
    layer = max(kind_params(spec, k)[0] / lay.tp + kind_params(spec, k)[1] / lay.ep
                for k in stage_kinds(spec, layers)) if len(layers) else 0.0
    units = [layer] * min(len(layers), 2)  # identical-size neighbours suffice for the max pair
    if first:
        units.insert(0, spec.embed_params / lay.tp)
    if last:
        units.append(spec.head_params / lay.tp)
    if not units:
        return 0.0
    pair = max(units[i] + (units[i + 1] if i + 1 < len(units) else 0.0) for i in range(len(units)))
    return BF16 * pair + FP32 * max(units)


def stage_memory(spec: ModelSpec, lay: Layout, prims: Primitives, work: Workload) -> list[MemoryBreakdown]:
    t = local_tokens(work, lay)
    m = micro_batches(work, lay)
    out = []
    for s, layers in enumerate(stage_layers(spec, lay.pp)):
        first, last = s == 0, s == lay.pp - 1
        mem = MemoryBreakdown()
        mem.parameters, mem.gradients, mem.optimizer = _static(spec, lay, prims, layers, first, last)
        inflight = min(lay.pp - s, m)
        stored, working, moe = 0.0, 0.0, 0.0
        for (mixer, mlp), n in stage_kinds(spec, layers).items():
            mk, mc = mixer_act(spec, mixer, lay.tp)
            fk, fc, routed = mlp_act(spec, mlp, lay.tp)
            saved_routed = routed * (1 if prims.moe_comm == "chunked" and prims.recompute == "full" else 2)
            layer_all = mk + mc + fk + fc
            if prims.recompute == "full":
                stored += n * spec.hidden / lay.tp * BF16
                layer_work = layer_all * (1 + BWD_GRAD_FRACTION)
            elif prims.recompute == "selective":
                stored += n * (mk + fk + saved_routed)
                layer_work = (mc + fc) + (mk + fk) * BWD_GRAD_FRACTION
            else:
                stored += n * (layer_all + saved_routed)
                layer_work = layer_all * BWD_GRAD_FRACTION
            if mixer == ATTN and lay.cp > 1:  # gathered K/V of the other CP ranks, and their grads
                layer_work += 2 * 2 * max(1.0, spec.n_kv_heads / lay.tp) * spec.head_dim * BF16 * (lay.cp - 1)
            elif mixer != ATTN:
                layer_work += gdn_state_bytes(spec, lay.tp)
            working = max(working, layer_work)
            moe = max(moe, routed * moe_buffer_count(prims))
        # the peak is either in a layer's (re)forward + backward or in the loss (last stage):
        # both sit on top of what the in-flight micro-batches keep; the breakdown is the one
        # at the larger of the two moments
        mem.activations = t * (inflight * stored + working)
        mem.moe_buffers = t * moe
        if last:
            vshard = spec.vocab / lay.tp
            if prims.loss == "ce":
                loss = t * vshard * CE_BYTES_PER_LOGIT
            else:  # token chunks of ~H*t/V tokens: chunk logits + grad, fp32 dh, fp32 dW
                loss = 3 * FP32 * t * spec.hidden + FP32 * vshard * spec.hidden
            loss += t * spec.hidden * FP32  # final hidden states in fp32 for the loss
            if loss > t * (working + moe):
                mem.activations, mem.moe_buffers, mem.logits = t * inflight * stored, 0.0, loss
        if prims.sharding == "fsdp2":
            mem.allgather = _allgather(spec, lay, layers, first, last)
        transient = mem.activations + mem.moe_buffers + mem.allgather
        mem.overhead = FIXED_OVERHEAD_GB * GB + FRAGMENTATION * transient
        out.append(mem)
    return out


def peak_memory(spec: ModelSpec, lay: Layout, prims: Primitives, work: Workload) -> tuple[MemoryBreakdown, int]:
    """The stage whose GPUs need the most memory (the one that OOMs first), and its index."""
    stages = stage_memory(spec, lay, prims, work)
    idx = max(range(len(stages)), key=lambda s: stages[s].total)
    return stages[idx], idx
