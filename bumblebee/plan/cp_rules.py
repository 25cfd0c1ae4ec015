"""Megatron Bridge's published rules of thumb for sizing context parallelism, checked beside the
recipe's own 16K-32K-tokens-per-GPU rule (``bumblebee plan --explain``).

The rules (NVIDIA Megatron Bridge, "MoE Long-Context Training", CP sizing rules of thumb,
docs.nvidia.com/nemo/megatron-bridge/.../skills/perf-techniques/moe-long-context): a first CP
of about ``seq / 4096`` rounded to a power of two; keep data parallelism alive; prefer selective
over full recompute; and, as CP grows at a fixed GPU count, data parallelism shrinks, so the
global batch should shrink with it. Where the recipe disagrees, the alternative the rule implies
is evaluated with the same memory and speed models, so the reason comes with numbers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from bumblebee.plan.hardware import GB, GPU, Efficiency
from bumblebee.plan.layout import Layout, Workload, fallback, prims_label, without_exchange
from bumblebee.plan.recipe import LOCAL_SEQ_MAX, Candidate, evaluate
from bumblebee.plan.spec import ModelSpec

SHARD_TARGET = 4096  # the published first guess: CP ~= seq / 4096


@dataclass(frozen=True)
class RuleCheck:
    rule: str
    holds: bool
    detail: str

    def as_json(self) -> dict:
        return dataclasses.asdict(self)


def _pow2_near(x: float) -> int:
    """The power of two nearest to ``x`` on a log scale (at least 1)."""
    v = 1
    while v * 2 <= x:
        v *= 2
    return v * 2 if x / v > (v * 2) / x else v


def _at_cp(spec: ModelSpec, cand: Candidate, cp: int, **prims) -> Layout | None:
    """The chosen layout with ``cp`` instead (same GPUs, tp, pp; ep kept or halved until it
    divides the ranks that hold experts), or None where the GPUs do not divide."""
    lay = cand.layout
    gpus = lay.world
    if gpus % (lay.tp * lay.pp * cp):
        return None
    dp = gpus // (lay.tp * lay.pp * cp)
    ep = lay.ep
    while ep > 1 and ((lay.tp * cp * dp) % ep or spec.experts % ep):
        ep //= 2
    return Layout(tp=lay.tp, pp=lay.pp, ep=ep, cp=cp, dp_shard=dp)


def _summary(c: Candidate) -> str:
    if not c.memory:
        return f"invalid ({c.reason})"
    fit = "fits" if c.feasible else c.reason
    return (
        f"{c.memory.total / GB:.1f} GB/GPU ({fit}), {c.tokens_per_s:.0f} tok/s/GPU predicted "
        f"[{c.layout.short()} | {prims_label(c.prims)}]"
    )


def check_cp_rules(
    spec: ModelSpec, cand: Candidate, work: Workload, gpu: GPU, eff: Efficiency | None = None
) -> list[RuleCheck]:
    lay, p = cand.layout, cand.prims
    out: list[RuleCheck] = []
    local = work.seq // lay.cp
    target = _pow2_near(work.seq / SHARD_TARGET)
    ours = f"{local} tokens per GPU at cp {lay.cp} (the recipe's rule: 16K-32K)"
    if target == lay.cp:
        out.append(RuleCheck("cp ~= seq/4096, power of two", True, f"cp {lay.cp}; {ours}"))
    else:
        alt_lay = _at_cp(spec, cand, target)
        if alt_lay is None:
            why = f"cp {target} does not divide {lay.world} GPUs at tp {lay.tp} x pp {lay.pp}"
        else:
            # the rule comes with selective recompute; the chunked EP overlap is validated
            # under full recompute only, so the comparison uses the plain all-to-all there
            at_ep = without_exchange(p) if alt_lay.ep == 1 else p
            sel = fallback(spec, alt_lay, dataclasses.replace(at_ep, recompute="selective"), work)
            same = at_ep
            a_sel = evaluate(spec, alt_lay, sel, work, gpu, eff)
            a_same = evaluate(spec, alt_lay, same, work, gpu, eff)
            why = (
                f"at cp {target}: with selective recompute {_summary(a_sel)}; with the recipe's "
                f"primitives {_summary(a_same)}; chosen: {_summary(cand)}. Full recompute and "
                f"linear CE keep activations independent of depth, so a {min(local, LOCAL_SEQ_MAX)}"
                f"-token shard fits and fewer CP ranks mean fewer ring steps and more data ranks"
            )
        out.append(
            RuleCheck(
                "cp ~= seq/4096, power of two",
                False,
                f"the rule gives cp {target} ({SHARD_TARGET} tokens per GPU); {ours}. {why}",
            )
        )
    pow2 = lay.cp & (lay.cp - 1) == 0
    out.append(
        RuleCheck(
            "cp a power of two",
            pow2,
            f"cp {lay.cp}" + ("" if pow2 else ": fixed by --layout, the recipe only doubles cp"),
        )
    )
    alive = lay.dp_shard > 1
    out.append(
        RuleCheck(
            "keep data parallelism alive",
            alive,
            f"dp {lay.dp_shard} = {lay.world} GPUs / (tp {lay.tp} x cp {lay.cp} x pp {lay.pp})"
            + (
                ""
                if alive
                else "; every GPU holds a slice of one sequence: add GPUs or shorten --seq to "
                "get data ranks back (FSDP2 still shards the static state over cp)"
            ),
        )
    )
    rows = work.global_batch // max(1, lay.dp_shard * work.micro_batch)
    out.append(
        RuleCheck(
            "shrink the global batch as cp grows",
            True,
            f"{work.global_batch} sequences over dp {lay.dp_shard}: {rows} micro-batches per rank "
            f"per step; doubling cp halves dp and doubles that (and the step time) unless the "
            f"global batch is halved",
        )
    )
    sel = p.recompute not in ("full", "offload")
    out.append(
        RuleCheck(
            "prefer selective recompute",
            sel,
            f"{p.recompute}"
            + (
                ""
                if sel
                else ": the recipe's choice (--explain's recompute line gives the selective "
                "alternative's memory and speed); chunked EP overlap is validated under full "
                "recompute"
            ),
        )
    )
    return out


def text(checks: list[RuleCheck]) -> str:
    lines = ["CP sizing: Megatron Bridge's rules of thumb beside the recipe's"]
    for c in checks:
        lines.append(f"  [{'agrees' if c.holds else 'differs'}] {c.rule}: {c.detail}")
    return "\n".join(lines)
