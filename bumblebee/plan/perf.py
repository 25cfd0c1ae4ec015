"""Throughput model of a training step: per-op roofline + communication, what each primitive hides.

One micro-batch on one GPU of pipeline stage s costs, per decoder layer, what ``perf_layer.py``
models (GEMMs and grouped expert GEMMs against a shape factor, the token-mixer core,
elementwise traffic and kernel launches, and the exposed tensor-, context- and
expert-parallel communication), plus the FSDP2 all-gather/reduce-scatter beyond what prefetch
hides under the layer's compute.

The step is the 1F1B schedule: the slowest stage runs m
micro-batches, the others add their ramp-up/down (the bubble), plus exposed
data-parallel gradient sync and the optimizer step. TFLOPs/GPU are model FLOPs
(3x forward, no recompute, causal attention at half): the convention of the
published figures.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bumblebee.config import PrimitivesConfig
from bumblebee.plan.hardware import GPU, Efficiency
from bumblebee.plan.layout import Layout, Workload
from bumblebee.plan.memory import (
    BF16,
    FP32,
    kind_params,
    local_tokens,
    loss_costs,
    micro_batches,
    sharding_costs,
    stage_kinds,
    stage_layers,
)
from bumblebee.plan.perf_layer import P2P_LATENCY_S, Clock, gemm_s, layer_time, link_gbps
from bumblebee.plan.spec import ModelSpec


@dataclass
class PerfEstimate:
    step_s: float
    tokens_per_s_per_gpu: float
    tflops_per_gpu: float
    stage_s: list[float] = field(default_factory=list)  # one micro-batch fwd+bwd per stage
    parts_s: dict[str, float] = field(default_factory=dict)  # bottleneck stage, one micro-batch


def _fsdp_layer_comm(
    spec: ModelSpec, kind: tuple[str, str], lay: Layout, gpu: GPU, eff: Efficiency
) -> float:
    """FSDP2 traffic of one layer per micro-batch: all-gather (forward), all-gather
    (backward, covering the recompute), fp32 reduce-scatter of the gradients."""
    dense, expert = kind_params(spec, kind)
    g_d, g_e = lay.dp_shard * lay.cp, lay.edp
    t = 0.0
    for n, g, inner in (
        (dense / lay.tp, g_d, lay.tp),
        (expert / lay.ep, g_e, lay.tp * lay.cp * lay.dp_shard // g_e),
    ):
        if g > 1:
            bw = link_gbps(g, inner, gpu) * 1e9 * eff.collective
            t += n * (BF16 + BF16 + FP32) * (g - 1) / g / bw
    return t


def _loss_time(
    spec: ModelSpec, lay: Layout, prims: PrimitivesConfig, work: Workload, gpu: GPU, eff: Efficiency
) -> float:
    t = local_tokens(work, lay)
    vshard = spec.vocab / lay.tp
    gemm = gemm_s(3 * 2.0 * t * spec.hidden * vshard, spec.hidden, gpu, eff)
    ce = gemm + t * vshard * eff.ce_bytes_per_logit / (gpu.hbm_gbps * 1e9 * eff.hbm)
    return ce * eff.linear_ce_slowdown if loss_costs(prims).tiled_head else ce


def estimate(
    spec: ModelSpec,
    lay: Layout,
    prims: PrimitivesConfig,
    work: Workload,
    gpu: GPU,
    eff: Efficiency | None = None,
    skew: float = 1.0,
) -> PerfEstimate:
    eff = eff or Efficiency()
    m = micro_batches(work, lay)
    stages, clocks = [], []
    for s, layers in enumerate(stage_layers(spec, lay.pp)):
        clock = Clock()
        for kind, n in stage_kinds(spec, layers).items():
            one = Clock()
            compute = layer_time(spec, kind, lay, prims, work, gpu, eff, one, skew)
            if sharding_costs(prims).gathers_per_layer:
                one.add(
                    "fsdp_comm",
                    max(
                        0.0,
                        _fsdp_layer_comm(spec, kind, lay, gpu, eff) - eff.comm_overlap * compute,
                    ),
                )
            for name, sec in one.parts.items():
                clock.add(name, n * sec)
        if s == lay.pp - 1:
            clock.add("loss", _loss_time(spec, lay, prims, work, gpu, eff))
        if lay.pp > 1:
            act = local_tokens(work, lay) / lay.tp * spec.hidden * BF16
            clock.add("pp_comm", 2 * (act / (gpu.ib_gbps * 1e9 * eff.collective) + P2P_LATENCY_S))
        stages.append(clock.total)
        clocks.append(clock)
    slow = max(range(len(stages)), key=lambda s: stages[s])
    step = m * stages[slow] + (sum(stages) - stages[slow])  # 1F1B: bottleneck x m + ramp up/down
    step += _dp_sync(spec, lay, prims, gpu, eff, stages[slow]) + _optimizer(
        spec, lay, prims, gpu, eff
    )
    tokens = work.global_batch * work.seq
    world = lay.world
    tok_s = tokens / step / world
    tflops = spec.model_flops_per_token(work.seq) * tokens / step / world / 1e12
    parts = dict(clocks[slow].parts)
    parts["bubble"] = (sum(stages) - stages[slow]) / m
    return PerfEstimate(step, tok_s, tflops, stages, parts)


def _dp_sync(
    spec: ModelSpec, lay: Layout, prims: PrimitivesConfig, gpu: GPU, eff: Efficiency, micro_s: float
) -> float:
    """Once-per-step gradient sync for none/zero1 (reduce-scatter or all-reduce of fp32 grads,
    all-gather of bf16 params), overlapped with the last micro-batch's backward."""
    sync = sharding_costs(prims).sync_bytes_per_param
    if not sync:
        return 0.0
    n = spec.num_params()
    d = (n["dense"] / lay.pp) / lay.tp
    e = (n["expert"] / lay.pp) / lay.ep
    t = 0.0
    for params, g, inner in (
        (d, lay.dp_shard * lay.cp, lay.tp),
        (e, lay.edp, lay.tp * lay.cp * lay.dp_shard // lay.edp),
    ):
        if g > 1:
            bw = link_gbps(g, inner, gpu) * 1e9 * eff.collective
            vol = params * sync * (g - 1) / g
            t += vol / bw
    return max(0.0, t - eff.comm_overlap * 2 / 3 * micro_s)


def _optimizer(
    spec: ModelSpec, lay: Layout, prims: PrimitivesConfig, gpu: GPU, eff: Efficiency
) -> float:
    """Adam over this GPU's shard: read param/grad/m/v, write param/m/v and the bf16 copy."""
    n = spec.num_params()
    d, e = n["dense"] / lay.pp / lay.tp, n["expert"] / lay.pp / lay.ep
    if sharding_costs(prims).optim_sharded:
        d, e = d / (lay.dp_shard * lay.cp), e / lay.edp
    return (d + e) * (7 * FP32 + BF16) / (gpu.hbm_gbps * 1e9 * eff.hbm)
