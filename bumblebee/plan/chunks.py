"""Chunk count and weights for chunked EP from routing skew: ``bumblebee plan --skew F`` (the
busiest EP rank's experts receive F x the balanced rows) or ``--from-run DIR`` (per-layer skew
from a run's expert-load histograms, ``moe.load_histogram_every``).

Per MoE layer the phases of the chunked schedule on the busiest rank (perf.moe_times, scaled by
the layer's skew) go through the schedule's timeline (primitives/moe/chunk_plan.py) with a fixed
cost per chunk and phase (its launches and a collective's latency); the count and weights with
the shortest timeline are chosen and compared with even chunks of the configured count.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from bumblebee.config import ConfigError
from bumblebee.plan.hardware import GPU, Efficiency
from bumblebee.plan.layout import Layout, Workload
from bumblebee.plan.perf_layer import KERNELS, P2P_LATENCY_S, chunk_phases, moe_times
from bumblebee.plan.spec import MOE, ModelSpec
from bumblebee.primitives.moe import chunk_plan

LAST_RECORDS = 20  # histograms read from the end of a run's metrics


def run_skew(run_dir: str, spec: ModelSpec, ep: int, last: int = LAST_RECORDS) -> list[float]:
    """Per MoE layer: the busiest of ``ep`` ranks' routed rows over the mean, from the last
    ``last`` expert-load histograms of the run in ``run_dir`` (summed)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ConfigError(
            f"--from-run {run_dir}: no metrics.jsonl there (a training run's out_dir)"
        )
    hists = []
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a crash
            if isinstance(rec, dict) and rec.get("expert_load"):
                hists.append(rec["expert_load"])
    if not hists:
        raise ConfigError(
            f"--from-run {run_dir}: its metrics have no expert_load histograms (train with "
            "--set moe.load_histogram_every=N)"
        )
    hists = hists[-last:]
    layers, experts = len(hists[0]), len(hists[0][0])
    moe_layers = sum(m == MOE for m in spec.mlps)
    if experts != spec.experts or layers != moe_layers:
        raise ConfigError(
            f"--from-run {run_dir}: its histograms have {layers} MoE layers x {experts} experts; "
            f"{spec.name} has {moe_layers} x {spec.experts}"
        )
    out = []
    for j in range(layers):
        load = [sum(h[j][e] for h in hists) for e in range(experts)]
        per_rank = [sum(load[r * experts // ep : (r + 1) * experts // ep]) for r in range(ep)]
        mean = sum(per_rank) / ep
        out.append(max(per_rank) / mean if mean > 0 else 1.0)
    return out


@dataclass
class ChunkChoice:
    skews: list[float]  # per MoE layer (one entry: every layer)
    weights: list[tuple[float, ...]]  # chosen, per entry of skews
    even_k: int
    exposed_even_s: float  # all-to-all nothing hides, per micro-batch over the MoE layers
    exposed_s: float
    moe_s: float  # expert GEMMs + exposed all-to-all with even chunks, same span

    def config_weights(self) -> list:
        """``primitives.moe_chunk_weights``: one list when every layer shares it."""
        if len(set(self.weights)) == 1:
            return list(self.weights[0])
        return [list(w) for w in self.weights]

    def text(self) -> str:
        skew = (
            f"{self.skews[0]:.2f}"
            if len(self.skews) == 1
            else f"{min(self.skews):.2f}-{max(self.skews):.2f} over {len(self.skews)} layers"
        )
        shown = sorted(set(self.weights), key=self.weights.index)[:3]
        ws = "; ".join("[" + ", ".join(f"{v:.2f}" for v in w) + "]" for w in shown)
        more = "" if len(set(self.weights)) <= 3 else f" (+{len(set(self.weights)) - 3} more)"
        return (
            f"chunked EP under routing skew {skew} (busiest EP rank): even x{self.even_k} chunks "
            f"expose {self.exposed_even_s * 1e3:.1f} ms of all-to-all per micro-batch "
            f"({self.exposed_even_s / self.moe_s:.0%} of the MoE layers' time); chosen chunks "
            f"{ws}{more} expose {self.exposed_s * 1e3:.1f} ms "
            f"({self.exposed_s / self.moe_s:.0%}); primitives.moe_chunk_weights = "
            f"{json.dumps(self.config_weights())}"
        )


def choose(
    spec: ModelSpec,
    lay: Layout,
    recompute: str,
    k: int,
    work: Workload,
    gpu: GPU,
    skews: list[float],
    eff: Efficiency | None = None,
) -> ChunkChoice:
    """``skews``: one per MoE layer, or one for all."""
    eff = eff or Efficiency()
    per_chunk = KERNELS["chunk"] * eff.kernel_us * 1e-6 + P2P_LATENCY_S
    full = recompute in ("full", "offload")
    n_layers = sum(m == MOE for m in spec.mlps)
    each = n_layers if len(skews) == 1 else 1
    weights, ex_even = [], 0.0
    ex = moe = 0.0
    for s in skews:
        experts, a2a = moe_times(spec, lay, work, gpu, eff, s)
        phases = chunk_phases(experts, a2a, recompute=full)
        even = chunk_plan.evaluate(chunk_plan.even(k), phases, per_chunk)
        got = chunk_plan.best(phases, per_chunk)
        weights.append(got.weights)
        ex_even += each * even.exposed
        ex += each * got.exposed
        moe += each * (sum(p.gemm + p.after for _, p in phases) + even.exposed)
    return ChunkChoice(list(skews), weights, k, ex_even, ex, moe)
