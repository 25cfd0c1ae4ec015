"""The default recipe (published long-context MoE practice, see README) applied and explained, and the ranked search.

``recipe`` follows the published rules in order -- EP by model size, CP from a
16K-32K per-GPU sequence, TP = 1, PP = 1 unless memory needs more, full
recompute, linear CE, FSDP2, chunked EP overlap (2 chunks, 4 past a 32K local
sequence) -- and records a one-line reason per choice. When the defaults do not
fit it escalates (PP = 2, then a shorter local sequence, then deeper PP) and
says why. ``search`` evaluates every valid layout x primitive combination with
the same memory and throughput models and ranks the ones that fit by predicted
throughput; the report says when the search beats the recipe.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from bumblebee import registry
from bumblebee.config import ConfigError, PrimitivesConfig
from bumblebee.plan.hardware import GB, GPU, MEMORY_MARGIN, Efficiency
from bumblebee.plan.layout import (
    Layout,
    Workload,
    check,
    fallback,
    prims_json,
    without_exchange,
)
from bumblebee.plan.memory import local_tokens
from bumblebee.plan.perf import PerfEstimate, estimate
from bumblebee.plan.spec import ModelSpec
from bumblebee.plan.timeline import MemoryBreakdown, StageMemory, stage_timeline

LARGE_MODEL = 100e9  # published recipe: EP 8 for models <= 100B parameters, 32 above
LOCAL_SEQ_MAX = 32768  # published recipe: per-GPU sequence about 16K-32K
# the recipe's primitives, set explicitly: PrimitivesConfig's default moe_comm is alltoall
# (moe_chunks: 4 past a 32K local sequence)
RECIPE = dict(
    sharding="fsdp2", loss="linear_ce", recompute="full", moe_comm="chunked", moe_chunks=2
)


def recipe_primitives() -> PrimitivesConfig:
    """The primitives the recipe starts from (``--set`` fixes some of them)."""
    return PrimitivesConfig(**RECIPE)


@dataclass
class Candidate:
    layout: Layout
    prims: PrimitivesConfig
    feasible: bool
    reason: str
    memory: MemoryBreakdown | None = None  # the stage that needs the most memory
    stage_totals_gb: list[float] = field(default_factory=list)
    perf: PerfEstimate | None = None
    stages: list[StageMemory] = field(default_factory=list)  # every stage's moments (timeline.py)

    @property
    def tokens_per_s(self) -> float:
        return self.perf.tokens_per_s_per_gpu if self.perf else 0.0

    def as_json(self) -> dict:
        lay = self.layout
        return {
            "layout": {
                "tp": lay.tp,
                "pp": lay.pp,
                "ep": lay.ep,
                "cp": lay.cp,
                "dp_shard": lay.dp_shard,
            },
            "primitives": prims_json(self.prims),
            "memory_gb": self.memory.as_gb() if self.memory else None,
            "peak_stage": self.memory.stage if self.memory else None,
            "peak_moment": self.memory.moment if self.memory else None,
            "stages": [st.as_json() for st in self.stages],
            "tflops_per_gpu": round(self.perf.tflops_per_gpu, 1) if self.perf else None,
            "tokens_per_s_per_gpu": round(self.perf.tokens_per_s_per_gpu, 1) if self.perf else None,
            "feasible": self.feasible,
            "reason": self.reason,
        }


def evaluate(
    spec: ModelSpec,
    lay: Layout,
    prims: PrimitivesConfig,
    work: Workload,
    gpu: GPU,
    eff: Efficiency | None = None,
    skew: float = 1.0,
) -> Candidate:
    """``skew``: routing skew on the busiest EP rank (memory and time; 1: balanced)."""
    why = check(spec, lay, prims, work, lay.world)
    if why:
        return Candidate(lay, prims, False, why)
    timeline = stage_timeline(spec, lay, prims, work, skew)
    stages = [st.peak for st in timeline]
    peak = max(range(len(stages)), key=lambda s: stages[s].total)
    mem = stages[peak]
    perf = estimate(spec, lay, prims, work, gpu, eff, skew)
    cand = Candidate(
        lay, prims, True, "", mem, [round(m.total / GB, 2) for m in stages], perf, timeline
    )
    limit = gpu.hbm_gb * (1 - MEMORY_MARGIN)
    if mem.total > limit * GB:
        top = max(mem.as_gb().items(), key=lambda kv: kv[1] if kv[0] != "total" else -1)
        where = (f"stage {peak}" if lay.pp > 1 else "each GPU") + f" at the {mem.moment} moment"
        cand.feasible = False
        cand.reason = (
            f"needs {mem.total / GB:.1f} GB > {limit:.0f} GB usable of {gpu.hbm_gb:.0f} on {where} "
            f"(largest: {top[0]} {top[1]:.1f} GB)"
        )
    else:
        cand.reason = (
            f"fits: {mem.total / GB:.1f} of {limit:.0f} GB usable ({gpu.hbm_gb:.0f} GB HBM)"
        )
    return cand


def _pow2_upto(n: int) -> list[int]:
    out, v = [], 1
    while v <= n:
        out.append(v)
        v *= 2
    return out


def layouts(spec: ModelSpec, gpus: int, gpu: GPU) -> list[Layout]:
    out = []
    for tp in _pow2_upto(min(gpu.gpus_per_node, gpus)):
        for pp in _pow2_upto(min(spec.layers, gpus // tp)):
            for cp in _pow2_upto(gpus // (tp * pp)):
                if gpus % (tp * pp * cp):
                    continue
                dp = gpus // (tp * pp * cp)
                for ep in _pow2_upto(gpus // pp):
                    if spec.experts % ep == 0 and (tp * cp * dp) % ep == 0:
                        out.append(Layout(tp=tp, pp=pp, ep=ep, cp=cp, dp_shard=dp))
    return out


def primitive_choices(ep: int, base: PrimitivesConfig, fixed: set[str]) -> list[PrimitivesConfig]:
    def opts(name, values):
        return [getattr(base, name)] if name in fixed else values

    # each exchange's declared variants (MoeCommCosts.searched): at ep = 1 the ones that move no
    # tokens, at ep > 1 the ones that do; ``check`` then applies the rest of their needs
    searched = [
        impl
        for impl in registry.implementations("moe_comm").values()
        if impl.costs is not None and impl.costs.exchanges == (ep > 1)
    ]
    comms = [
        (impl.name, variant.get("moe_chunks", base.moe_chunks))
        for impl in sorted(searched, key=lambda i: -i.costs.preference)
        for variant in impl.costs.searched
    ]
    if "moe_comm" in fixed or "moe_chunks" in fixed:
        comms = [(base.moe_comm, base.moe_chunks)]
    return [
        PrimitivesConfig(sharding=sh, loss=lo, recompute=rc, moe_comm=mc, moe_chunks=ch)
        for sh in opts("sharding", ["fsdp2", "zero1"])
        for lo in opts("loss", ["linear_ce", "ce"])
        for rc in opts("recompute", ["full", "selective", "none"])
        for mc, ch in comms
    ]


def search(
    spec: ModelSpec,
    gpus: int,
    gpu: GPU,
    work: Workload,
    base: PrimitivesConfig,
    fixed: set[str],
    eff: Efficiency | None = None,
    progress=None,
    skew: float = 1.0,
) -> list[Candidate]:
    """Every valid combination: feasible ones by predicted throughput, then the rest by memory.
    ``progress`` (a ``console.Progress``) counts the layouts evaluated."""
    cands = []
    lays = list(layouts(spec, gpus, gpu))
    if progress is not None:
        progress.total = len(lays)
    for lay in lays:
        for prims in primitive_choices(lay.ep, base, fixed):
            if check(spec, lay, prims, work, gpus):
                continue
            cands.append(evaluate(spec, lay, prims, work, gpu, eff, skew))
        if progress is not None:
            progress.update()
    # feasible: fastest first; infeasible: nearest to fitting first
    cands.sort(
        key=lambda c: (
            (0, -c.tokens_per_s) if c.feasible else (1, c.memory.total if c.memory else 1e30)
        )
    )
    return cands


# ---------------------------------------------------------------------------------------------


@dataclass
class Recommendation:
    candidate: Candidate
    reasons: dict[str, str]  # choice -> one-line reason
    notes: list[str] = field(default_factory=list)


def _largest_divisor_pow2(limit: int, *must_divide: int) -> int:
    v = 1
    for c in _pow2_upto(limit):
        if all(m % c == 0 for m in must_divide):
            v = c
    return v


def recipe(
    spec: ModelSpec,
    gpus: int,
    gpu: GPU,
    work: Workload,
    base: PrimitivesConfig,
    fixed: set[str],
    eff: Efficiency | None = None,
    skew: float = 1.0,
) -> Recommendation:
    n = spec.num_params()["total"]
    ep_rule = 32 if n > LARGE_MODEL else 8
    cp0 = 1
    while work.seq // cp0 > LOCAL_SEQ_MAX and cp0 * 2 <= gpus:
        cp0 *= 2
    local = work.seq // cp0
    chunks = 2 if local <= LOCAL_SEQ_MAX else 4
    prims = dataclasses.replace(
        base,
        **{k: v for k, v in dict(RECIPE, moe_chunks=chunks).items() if k not in fixed},
    )
    tried: list[Candidate] = []
    # escalation: (pp, cp multiplier) in the order the recipe prefers
    for pp, cp_mult in ((1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (4, 2), (8, 1), (8, 2)):
        cp = cp0 * cp_mult
        if gpus % (pp * cp) or pp > spec.layers:
            continue
        dp = gpus // (pp * cp)
        ep = _largest_divisor_pow2(min(ep_rule, gpus // pp), spec.experts, cp * dp)
        p = prims if ep > 1 else without_exchange(prims)
        lay = Layout(tp=1, pp=pp, ep=ep, cp=cp, dp_shard=dp)
        if "moe_comm" not in fixed:  # e.g. selective recompute fixed: chunked's baseline
            p = fallback(spec, lay, p, work)
        cand = evaluate(spec, lay, p, work, gpu, eff, skew)
        tried.append(cand)
        if cand.feasible:
            break
    valid = [c for c in tried if c.memory is not None]
    if tried and not valid:  # --set fixed a primitive that none of the recipe's layouts can run
        raise ConfigError(
            f"the recipe's layouts cannot run the fixed primitives: {tried[0].reason}; fix the "
            "others it needs too (--set) or pass --layout"
        )
    best = next((c for c in tried if c.feasible), valid[0] if valid else None)
    if best is None:  # no (pp, cp) the recipe tries divides the GPU count
        raise ConfigError(
            f"--gpus {gpus}: the recipe needs a GPU count divisible by its context-parallel "
            f"degree ({cp0} for --seq {work.seq}) times pp in 1, 2, 4, 8; use e.g. --gpus "
            f"{cp0 * -(-gpus // cp0)} or pass --layout"
        )
    return Recommendation(best, explain(spec, best, tried, ep_rule, n, work, gpu, eff))


def explain(
    spec: ModelSpec,
    cand: Candidate,
    tried: list[Candidate],
    ep_rule: int,
    n_params: float,
    work: Workload,
    gpu: GPU,
    eff: Efficiency | None,
) -> dict[str, str]:
    lay, p = cand.layout, cand.prims
    local = local_tokens(work, lay)
    r: dict[str, str] = {}
    size = f"{n_params / 1e9:.1f}B parameters"
    r["ep"] = (
        f"{size} {'<=' if ep_rule == 8 else '>'} 100B -> EP {ep_rule} (the recipe's default)"
        + ("" if lay.ep == ep_rule else f"; capped to {lay.ep} by experts/GPUs")
    )
    r["cp"] = f"{work.seq} tokens / cp {lay.cp} = {local} per GPU (target 16K-32K)"
    r["tp"] = "off by default: no model or hardware reason to split matrices"
    fails = [c for c in tried if not c.feasible and c is not cand]
    r["pp"] = (
        f"{lay.pp}: no depth the recipe tries (pp 1-8, local sequence down to half) fits"
        if not cand.feasible
        else "1: fits without pipelining (no bubble)"
        if lay.pp == 1
        else f"{lay.pp}: smaller layouts do not fit ({fails[-1].layout.short()}: {fails[-1].reason})"
        if fails
        else f"{lay.pp}"
    )
    r["dp"] = f"{lay.dp_shard} = GPUs / (tp*cp*pp); experts replicated over edp={lay.edp}"

    def alt(**kw) -> Candidate:
        return evaluate(spec, lay, dataclasses.replace(p, **kw), work, gpu, eff)

    m = cand.memory
    if p.sharding == "fsdp2":
        z = alt(sharding="zero1")
        r["sharding"] = (
            f"fsdp2: params+grads+optimizer {(m.parameters + m.gradients + m.optimizer) / GB:.1f} GB/GPU "
            f"(zero1: {z.memory.parameters / GB + z.memory.gradients / GB + z.memory.optimizer / GB:.1f} GB)"
            if z.memory
            else "fsdp2: shards all static state over every GPU"
        )
    else:
        r["sharding"] = f"{p.sharding}: set by --set"
    if p.loss == "linear_ce":
        c = alt(loss="ce")
        r["loss"] = (
            f"linear_ce: no [{local} x {spec.vocab // lay.tp}] logits "
            f"(ce peak {c.memory.total / GB:.1f} GB vs {m.total / GB:.1f} GB)"
            if c.memory
            else "linear_ce"
        )
    else:
        r["loss"] = f"{p.loss}: set by --set"
    if p.recompute == "full":
        sel = fallback(spec, lay, dataclasses.replace(p, recompute="selective"), work)
        s = evaluate(spec, lay, sel, work, gpu, eff)
        tail = (
            f"; selective would fit ({s.memory.total / GB:.1f} GB, {s.tokens_per_s / cand.tokens_per_s - 1:+.0%} tok/s)"
            if s.feasible
            else "; selective does not fit"
            if s.memory
            else ""
        )
        r["recompute"] = "full: activations independent of depth, ~30% extra compute" + tail
    else:
        r["recompute"] = f"{p.recompute}: set by --set"
    comm = registry.get("moe_comm", p.moe_comm).costs
    gain = 0.0
    if comm.baseline:
        a = alt(moe_comm=comm.baseline)
        gain = cand.tokens_per_s / a.tokens_per_s - 1 if a.perf else 0.0
    if comm.explain:
        r["moe_comm"] = comm.explain.format(prims=p, gain=gain)
    else:
        r["moe_comm"] = f"{p.moe_comm}: set by --set"
    return r
