"""Throughput model of one decoder layer: per-op roofline + communication, what each primitive hides.

One micro-batch on one GPU costs, per decoder layer (``perf.py`` assembles the step):

- GEMMs (projections, router, shared expert, dense MLP) and grouped expert GEMMs:
  FLOPs / (peak x efficiency x shape factor), the shape factor d / (d + d_half)
  penalizing thin matrices (small experts, tp-split heads, few rows per expert);
- the token-mixer core: causal flash attention (half the square, load-balanced
  over cp) or the chunked gated delta rule;
- elementwise / norm / permute traffic at HBM bandwidth, and a fixed cost per
  kernel launch (what makes short local sequences and many EP chunks slow);
- exposed communication: tensor-parallel all-gather/reduce-scatter (sequence
  parallel), CP K/V exchange or DeltaNet state hand-off, EP all-to-all (fully
  exposed for ``alltoall``; ``chunked`` pipelines c chunks of dispatch/combine
  against the expert GEMMs: max(comm, gemm) + min(comm, gemm) / c; ``overlap_mb`` runs them
  under the other micro-batch of a pair: what the partner's layer pass does not cover; each
  exchange declares which: ``MoeCommCosts.overlap``, primitives/moe/costs.py).

Backward is 2x the forward GEMM work (attention 2.5x); ``full`` recompute adds a
forward (under chunked EP without the combine all-to-all), ``selective`` the
elementwise part.
"""

from __future__ import annotations

from bumblebee.config import PrimitivesConfig
from bumblebee.plan.dsa_terms import COLLECTIVES, dsa_cp_traffic
from bumblebee.plan.hardware import GPU, Efficiency
from bumblebee.plan.layout import Layout, Workload
from bumblebee.plan.memory import BF16, FP32, local_tokens, mixer_act, mlp_act, moe_costs
from bumblebee.plan.routed_bytes import routed_units
from bumblebee.plan.spec import ATTN, MOE, ModelSpec
from bumblebee.primitives.moe import chunk_plan
from bumblebee.primitives.moe.chunk_plan import PhaseTimes

KERNELS = {
    ATTN: 22,
    "gdn": 30,
    MOE: 28,
    "dense": 8,
    "chunk": 10,
}  # forward launches per sub-layer / per EP chunk
P2P_LATENCY_S = 20e-6  # one small NCCL send/recv hop


class Clock:
    """Accumulates named time components."""

    def __init__(self):
        self.parts: dict[str, float] = {}

    def add(self, name: str, seconds: float) -> None:
        self.parts[name] = self.parts.get(name, 0.0) + seconds

    @property
    def total(self) -> float:
        return sum(self.parts.values())


def _sat(d: float, eff: Efficiency) -> float:
    return d / (d + eff.gemm_half_dim)


def gemm_s(flops: float, min_dim: float, gpu: GPU, eff: Efficiency, grouped: bool = False) -> float:
    e = eff.gemm * _sat(min_dim, eff) * (eff.grouped if grouped else 1.0)
    return flops / (gpu.bf16_tflops * 1e12 * e)


def link_gbps(group: int, inner: int, gpu: GPU) -> float:
    """Bandwidth (GB/s) of a collective over ``group`` ranks spaced ``inner`` apart in rank
    order: NVLink if they share a node, else the inter-node fabric bounds the ring."""
    return gpu.nvlink_gbps if group * inner <= gpu.gpus_per_node else gpu.ib_gbps


def _a2a(nbytes: float, ep: int, gpu: GPU, eff: Efficiency) -> float:
    """All-to-all of ``nbytes`` per GPU over ep ranks (contiguous): on-node peers over
    NVLink, off-node peers over the fabric, concurrently."""
    remote = nbytes * (ep - 1) / ep
    on_node = min(ep, gpu.gpus_per_node)
    nv = remote * (on_node - 1) / max(ep - 1, 1)
    ib = remote - nv
    return (
        max(nv / (gpu.nvlink_gbps * 1e9), ib / (gpu.ib_gbps * 1e9)) / eff.all_to_all + P2P_LATENCY_S
    )


def layer_time(
    spec: ModelSpec,
    kind: tuple[str, str],
    lay: Layout,
    prims: PrimitivesConfig,
    work: Workload,
    gpu: GPU,
    eff: Efficiency,
    clock: Clock,
    skew: float = 1.0,
) -> float:
    """One layer, one micro-batch, forward + backward (+ recompute). Returns its compute time
    (``skew``: the busiest EP rank's experts receive skew x the balanced rows)."""
    t = local_tokens(work, lay)
    ts = t / lay.tp  # sequence-parallel tokens
    h, tp = spec.hidden, lay.tp
    mixer, mlp = kind
    rc = "full" if prims.recompute == "offload" else prims.recompute  # offload: full + copies
    fwd_passes = 2.0 if rc == "full" else 1.0  # forward + recompute forward
    hbm = gpu.hbm_gbps * 1e9 * eff.hbm

    # token mixer: projections + core
    proj = gemm_s(
        t * spec.mixer_gemm_flops(mixer) / tp, min(h, spec.n_heads * spec.head_dim / tp), gpu, eff
    )
    if mixer == ATTN:
        core_f = t * spec.mean_attn_core_flops(work.seq) / tp
        core = core_f / (gpu.bf16_tflops * 1e12 * eff.attn_fwd)
        core_b = 2.5 * core_f / (gpu.bf16_tflops * 1e12 * eff.attn_bwd)
    else:
        core_f = t * spec.gdn_core_flops() / tp
        core = core_f / (gpu.bf16_tflops * 1e12 * eff.gdn)
        core_b = 2.0 * core
    clock.add("gemm", proj * (fwd_passes + 2))
    clock.add("attention" if mixer == ATTN else "gdn", core * fwd_passes + core_b)

    # MLP: dense GEMMs and routed experts
    dense_f, routed_f = spec.moe_gemm_flops(mlp)
    ffn = spec.expert_ffn if mlp == MOE else spec.dense_ffn
    dense = gemm_s(ts * dense_f, min(h, ffn if mlp != MOE else spec.shared_ffn or h), gpu, eff)
    clock.add("gemm", dense * (fwd_passes + 2))
    compute = (proj + dense) * (fwd_passes + 2) + core * fwd_passes + core_b
    if mlp == MOE:
        experts, a2a = moe_times(spec, lay, work, gpu, eff, skew)
        # passes: (expert GEMM share, number of all-to-alls) for forward, recompute, backward
        passes = [(1.0, 2), (2.0, 2)]
        comm = moe_costs(prims)
        if rc == "full":
            passes.append((1.0, comm.recompute_exchanges))
        if comm.overlap == "chunks" and a2a > 0:
            # even chunks: the calibrated per-pass estimate; uneven chunks scale it by what the
            # timeline of the schedule (chunk_plan.py) says they change
            weights = chunk_weight_lists(prims)
            phases = chunk_phases(experts, a2a, recompute=rc == "full")
            for w in weights:
                n = len(w)
                timeline = chunk_plan.evaluate(w, phases).exposed
                even = chunk_plan.evaluate(chunk_plan.even(n), phases).exposed
                scale = timeline / even if even > 0 else 1.0
                for gemm_mult, n_a2a in passes:
                    g, c = experts * gemm_mult, a2a * n_a2a
                    clock.add("experts", g / len(weights))
                    exposed = min(g, c) / n + max(0.0, c - g)
                    clock.add("ep_comm", exposed * scale / len(weights))
                    clock.add(
                        "launch", (n - 1) * KERNELS["chunk"] * eff.kernel_us * 1e-6 / len(weights)
                    )
        elif comm.overlap == "partner" and a2a > 0:
            # each exchange runs under the partner micro-batch's compute of the same pass: what
            # that whole layer pass (mixer, dense GEMMs, experts) cannot cover stays exposed
            others = {1.0: proj + dense + core, 2.0: 2 * (proj + dense) + core_b}
            for gemm_mult, n_a2a in passes:
                clock.add("experts", experts * gemm_mult)
                partner = others[gemm_mult] + experts * gemm_mult
                clock.add("ep_comm", max(0.0, a2a * n_a2a - partner))
        else:
            for gemm_mult, n_a2a in passes:
                clock.add("experts", experts * gemm_mult)
                clock.add("ep_comm", a2a * n_a2a)
        compute += experts * (fwd_passes + 2)

    # elementwise / norm / permute traffic: each activation written and read once per pass
    mk, mc = mixer_act(spec, mixer, tp)
    fk, fc = mlp_act(spec, mlp, tp)
    X, A = routed_units(spec, tp) if mlp == MOE else (0.0, 0.0)
    act = (
        mk + mc + fk + fc + 3 * X + 4 * A
    )  # routed rows moved 3x, expert fc1 out / SwiGLU (4 x [k*t, F])
    elem_passes = 1 + 2 + (1 if rc == "full" else 0)
    elem = 2 * t * act / hbm
    clock.add(
        "elementwise", elem * elem_passes + (2 * t * (mc + fc) / hbm if rc == "selective" else 0.0)
    )
    kernels = KERNELS[mixer if mixer == ATTN else "gdn"] + KERNELS[mlp]
    clock.add("launch", kernels * (elem_passes) * eff.kernel_us * 1e-6)

    # tensor parallel (sequence parallel): all-gather + reduce-scatter around both sub-layers
    if tp > 1:
        coll = t * h * BF16 * (tp - 1) / tp / (gpu.nvlink_gbps * 1e9 * eff.collective)
        clock.add("tp_comm", 4 * coll * (fwd_passes + 1))
    # context parallel
    if lay.cp > 1:
        bw = link_gbps(lay.cp, lay.tp, gpu) * 1e9 * eff.collective
        if mixer == ATTN and spec.dsa_topk:  # DSA fetches the selected latents (dsa_terms.py)
            moved = dsa_cp_traffic(spec, lay, t)
            comm = (moved["forward"] * fwd_passes + moved["backward"]) / bw
            clock.add("cp_comm", comm + (fwd_passes + 1) * COLLECTIVES * P2P_LATENCY_S)
        elif mixer == ATTN:
            if spec.mla:  # MLA's ring (ring_latent.py): latent + rope key per token and hop
                kv = (lay.cp - 1) * t * (spec.mla_kv_rank + spec.mla_rope_dim) * BF16 / bw
                # ... and kv_b_proj over the cp - 1 received blocks per forward pass; backward re-expands
                # all cp blocks and takes d latent and dW of each (3 GEMMs) where the local block took 2
                nope = spec.head_dim - spec.mla_rope_dim
                expand = gemm_s(
                    t * 2 * spec.mla_kv_rank * spec.n_heads * (nope + spec.mla_v_dim) / tp,
                    spec.mla_kv_rank,
                    gpu,
                    eff,
                )
                extra = expand * ((lay.cp - 1) * fwd_passes + 3 * lay.cp - 2)
                clock.add("gemm", extra)
                compute += extra
            else:
                kv = (
                    (lay.cp - 1)
                    * t
                    * 2
                    * max(1.0, spec.n_kv_heads / tp)
                    * spec.head_dim
                    * BF16
                    / bw
                )
            hidden = core * fwd_passes + core_b
            clock.add(
                "cp_comm",
                max(0.0, kv * (fwd_passes + 1) - hidden) + (fwd_passes + 1) * P2P_LATENCY_S,
            )
        else:
            state = spec.gdn_v_heads / tp * spec.gdn_k_dim * spec.gdn_v_dim * FP32
            hop = P2P_LATENCY_S + state / bw
            clock.add("cp_comm", (lay.cp - 1) * hop * (fwd_passes + 1))
    if prims.recompute == "offload":
        # the layer input out after the forward and back before the recompute, each on a side
        # stream under a layer's compute: only what a layer's compute does not cover is exposed
        copy = t * h / tp * BF16 / (gpu.pcie_gbps * 1e9)
        clock.add("offload", 2 * max(0.0, copy - compute / (fwd_passes + 2)))
    return compute


def moe_times(
    spec: ModelSpec, lay: Layout, work: Workload, gpu: GPU, eff: Efficiency, skew: float = 1.0
) -> tuple[float, float]:
    """Seconds of one MoE layer's routed expert GEMMs (forward) and of one all-to-all of its
    routed rows, per micro-batch, on the busiest EP rank: its experts receive (and send back)
    ``skew`` x the balanced rows."""
    ts = local_tokens(work, lay) / lay.tp
    rows = spec.top_k * ts  # routed rows this GPU computes (balanced routing)
    per_expert = rows * lay.ep / spec.experts
    routed_f = spec.moe_gemm_flops(MOE)[1]
    experts = gemm_s(
        ts * routed_f, min(per_expert, spec.expert_ffn, spec.hidden), gpu, eff, grouped=True
    )
    if lay.ep == 1:
        return experts, 0.0
    return skew * experts, skew * _a2a(rows * spec.hidden * BF16, lay.ep, gpu, eff)


def chunk_phases(experts: float, a2a: float, recompute: bool) -> list:
    """One MoE layer's phases as chunked.py runs them (chunk_plan.py): forward (dispatch, fc1 +
    fc2, combine), backward (combine-backward, dgrad, dispatch-backward, then the weight
    gradients) and, under full recompute, the recompute forward (dispatch and fc1 only)."""
    out = [
        ("forward", PhaseTimes(dispatch=a2a, gemm=experts, combine=a2a)),
        ("backward", PhaseTimes(dispatch=a2a, gemm=experts, combine=a2a, after=experts)),
    ]
    if recompute:
        out.append(("forward", PhaseTimes(dispatch=a2a, gemm=experts, combine=0.0)))
    return out


def chunk_weight_lists(prims: PrimitivesConfig) -> list[tuple]:
    """The chunk weights of every MoE layer (one entry when all layers share them)."""
    w = prims.moe_chunk_weights
    if w and all(isinstance(x, list | tuple) for x in w):
        return [tuple(x) for x in w]
    return [tuple(w) if w else chunk_plan.even(max(1, prims.moe_chunks))]
