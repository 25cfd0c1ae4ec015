"""Peak-moment model: per-GPU memory of each pipeline stage as a timeline of one training step.

The terms (``memory.py``) are placed on five moments of a steady-state 1F1B step on stage s,
whose peak is the largest:

- ``forward``: static state + the saved inputs of the micro-batches in flight
  (``min(pp - s, m)``; 1F1B keeps that many between their forward and backward) + the
  largest forward working set of one layer (its MoE routed buffers in the pass that
  autograd does not keep under full recompute) + FSDP2's two bf16 units;
- ``backward``: static + the same saved inputs + the live layer of a recomputed backward
  (its saved tensors and their gradients in flight) + the MoE routed buffers of the larger
  of its recompute forward and its backward + FSDP2's units and one fp32 unit gradient;
- ``loss`` (last stage): static + saved inputs + the loss temporaries (the head's
  all-gather under FSDP2);
- ``optimizer``: static + the optimizer's temporaries;
- ``eval`` (held-out evaluation, ``runtime/eval.py``; forward only, no gradient): static + the
  residual stream one layer reads + the largest forward working set of one layer (nothing is
  saved for a backward), or on the last stage the head: the loss primitive's forward (linear CE:
  its tiles; ``ce``: logits of every local token, the plain held-out path). It never exceeds the
  training moments: ``forward`` holds the same layer beside saved inputs, ``loss`` the same loss
  beside the head gradient; counted so that ``--explain`` shows it.

Every moment adds ``overhead``: ``FIXED_OVERHEAD_GB`` (CUDA context, cuBLAS workspaces,
NCCL buffers) + ``FRAGMENTATION`` x the moment's transient bytes (activations, MoE and
all-gather buffers; the few huge loss blocks fragment little). Those two are the only
constants fitted to published peaks (``hardware.py``, ``tests/unit/test_plan_calibration.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from bumblebee.config import PrimitivesConfig
from bumblebee.plan.hardware import FIXED_OVERHEAD_GB, FRAGMENTATION, GB
from bumblebee.plan.layer_moments import layer_moments
from bumblebee.plan.layout import Layout, Workload
from bumblebee.plan.memory import (
    ADAM_TEMP_B,
    BF16,
    allgather_bytes,
    in_flight,
    local_tokens,
    loss_bytes,
    loss_costs,
    loss_kept,
    pair_factor,
    sharding_costs,
    stage_kinds,
    stage_layers,
    static_bytes,
)
from bumblebee.plan.spec import ModelSpec

MOMENTS = ("forward", "backward", "loss", "optimizer", "eval")
STATIC = ("parameters", "gradients", "optimizer")


@dataclass
class MemoryBreakdown:
    """Per-GPU bytes of one moment of one pipeline stage (the peak moment when reported alone)."""

    parameters: float = 0.0
    gradients: float = 0.0
    optimizer: float = 0.0
    saved_inputs: float = 0.0  # what the in-flight micro-batches keep for their backward
    live_layer: float = 0.0  # the (re)computed layer's saved tensors and gradients, CP buffers
    moe_buffers: float = 0.0  # routed [k*t, .] tensors of dispatch / experts / combine
    loss: float = 0.0  # logits or linear-CE accumulators, final hidden
    allgather: float = 0.0  # FSDP2 unsharded units
    workspace: float = 0.0  # kernel-internal buffers (not seen by a fake-tensor dry run)
    optim_temp: float = 0.0  # optimizer step temporaries
    overhead: float = 0.0
    moment: str = field(default="", compare=False)
    stage: int = field(default=0, compare=False)
    why: dict = field(
        default_factory=dict, compare=False, repr=False
    )  # term -> formula with numbers

    @staticmethod
    def terms() -> tuple[str, ...]:
        return tuple(f.name for f in fields(MemoryBreakdown) if f.type == "float")

    @property
    def total(self) -> float:
        return sum(getattr(self, k) for k in self.terms())

    def as_gb(self) -> dict[str, float]:
        out = {"total": round(self.total / GB, 2)}
        out.update({k: round(getattr(self, k) / GB, 2) for k in self.terms()})
        return out


@dataclass
class StageMemory:
    stage: int
    layers: range
    moments: dict[str, MemoryBreakdown]
    parts: dict[str, MemoryBreakdown] = field(
        default_factory=dict
    )  # "backward:moe", ... (dry-run checks)

    @property
    def peak(self) -> MemoryBreakdown:
        return max(self.moments.values(), key=lambda m: m.total)

    def as_json(self) -> dict:
        p = self.peak
        return {
            "stage": self.stage,
            "layers": [self.layers.start, self.layers.stop - 1] if len(self.layers) else [],
            "peak_moment": p.moment,
            "peak_gb": round(p.total / GB, 2),
            "terms_gb": p.as_gb(),
            "moments_gb": {k: round(m.total / GB, 2) for k, m in self.moments.items()},
        }


def _offloaded(host: float, device: float) -> str:
    return (
        f"offload recompute: {host / GB:.2f} GB of layer inputs in host memory; on the device "
        f"{device / GB:.2f} GB (the input being recomputed and the one prefetched)"
    )


def stage_timeline(
    spec: ModelSpec, lay: Layout, prims: PrimitivesConfig, work: Workload, skew: float = 1.0
) -> list[StageMemory]:
    """Every stage's moments; ``skew``: this rank's experts receive ``skew`` x the balanced rows."""
    t = local_tokens(work, lay)
    out = []
    for s, layers in enumerate(stage_layers(spec, lay.pp)):
        first, last = s == 0, s == lay.pp - 1
        params, grads, optim, updated, static_why = static_bytes(
            spec, lay, prims, layers, first, last
        )
        inflight, pair = in_flight(work, lay, s, prims), pair_factor(prims)
        kinds = stage_kinds(spec, layers)
        per_kind = {k: layer_moments(spec, k, lay, prims, t, skew, work.micro_batch) for k in kinds}
        saved_mb = sum(n * per_kind[k][0] for k, n in kinds.items())
        # MTP beside the embedding (pp = 1): the MTP modules embed their shifted tokens with the one
        # embedding, so its bf16 [V/tp, H] weight gradient, made as the backward leaves the MTP part
        # (first), stays alive through every decoder layer's backward until the embedding's own
        # (models/mtp.py); under pp, stage 0 embeds them and runs both backwards at its end
        mtp_grad = (
            spec.embed_params / lay.tp * BF16
            if first and last and getattr(spec, "mtp_layers", 0)
            else 0.0
        )
        # offload: every layer input waits in host memory; the device holds the one being
        # recomputed and the one prefetched
        host = inflight * t * saved_mb if prims.recompute == "offload" else 0.0
        on_device = 2 * t * spec.hidden / lay.tp * BF16 if host else float("inf")
        ag_fwd, ag_bwd = (
            allgather_bytes(spec, lay, layers, first, last)
            if sharding_costs(prims).gathers_per_layer
            else (0, 0)
        )

        def moment(name: str, **terms) -> MemoryBreakdown:
            mem = MemoryBreakdown(
                parameters=params, gradients=grads, optimizer=optim, moment=name, stage=s, **terms
            )
            transient = (
                mem.saved_inputs
                + mem.live_layer
                + mem.moe_buffers
                + mem.allgather
                + mem.optim_temp
                + mem.workspace
            )
            mem.overhead = FIXED_OVERHEAD_GB * GB + FRAGMENTATION * transient
            mem.why.update(dict.fromkeys(STATIC, static_why))
            if mem.saved_inputs:
                mem.why["saved_inputs"] = (
                    f"{inflight} micro-batch(es) in flight x {t} tokens x {saved_mb:.0f} "
                    f"B/token ({prims.recompute} recompute, {len(layers)} layers)"
                )
            if host and mem.saved_inputs:
                mem.why["saved_inputs"] = _offloaded(host, mem.saved_inputs)
            mem.why["overhead"] = (
                f"{FIXED_OVERHEAD_GB} GB fixed + {FRAGMENTATION} x {transient / GB:.2f} GB transient"
            )
            return mem

        moments: dict[str, MemoryBreakdown] = {}
        saved = min(inflight * t * saved_mb, on_device)
        # the step balance loss runs every micro-batch's forward, loss included, before the backwards
        others_loss = (
            (inflight - 1) * t * loss_kept(spec, lay, prims) if last and lay.pp == 1 else 0.0
        )
        parts: dict[str, MemoryBreakdown] = {}
        # while layer j of the last micro-batch in flight runs (or is recomputed and runs backward), the
        # inputs saved by layers 0..j of it are alive (a checkpoint holds a layer's input until its
        # backward is done), beside the other micro-batches' whole sets: a kind peaks at its last layer
        kind_of = [(spec.mixers[i], spec.mlps[i]) for i in layers]
        last_of = {k: j + 1 for j, k in enumerate(kind_of)}  # layers 0..j, j the kind's last layer
        upto = {k: (n, t * sum(per_kind[kk][0] for kk in kind_of[:n])) for k, n in last_of.items()}
        for name, ag in (("forward", ag_fwd), ("backward", ag_bwd)):
            for part in sorted(
                {c[0] for k in kinds for c in per_kind[k][1] if c[0].startswith(name)}
            ):
                cands = [(upto[k], c) for k in kinds for c in per_kind[k][1] if c[0] == part]
                (n_in, own), (_, live, routed, ws, why) = max(
                    cands, key=lambda v: v[0][1] + sum(v[1][1:4])
                )
                kept = min((inflight - 1) * t * saved_mb + own, on_device)
                mem = moment(  # overlap_mb: the partner micro-batch is inside a layer too
                    name,
                    saved_inputs=kept,
                    live_layer=pair * live + (mtp_grad if name == "backward" else 0.0),
                    moe_buffers=pair * routed,
                    workspace=ws,
                    allgather=ag,
                    loss=others_loss,
                )
                mem.why["live_layer"] = (
                    why
                    + (" (x2: two micro-batches in a layer)" if pair > 1 else "")
                    + (
                        f" + the MTP embeddings' weight gradient {mtp_grad / GB:.2f} GB"
                        if mtp_grad and name == "backward"
                        else ""
                    )
                )
                mem.why["saved_inputs"] = (
                    _offloaded(host, kept)
                    if host
                    else f"{inflight - 1} other micro-batch(es) in flight x {t} tokens x "
                    f"{saved_mb:.0f} B/token + layers 0..{n_in - 1} of this one "
                    f"({prims.recompute} recompute)"
                )
                if routed:
                    mem.why["moe_buffers"] = why.split("routed ")[-1]
                if ws:
                    mem.why["workspace"] = (
                        "FLA chunk states [t/64, Hv, Dk, Dv] and their gradient, bf16 (kernel-internal)"
                    )
                parts[part] = mem
            best = [m for p, m in parts.items() if p.startswith(name)]
            if best:
                moments[name] = max(best, key=lambda m: m.total)
        if last:
            lb, lwhy = loss_bytes(spec, lay, prims, work)
            head = (
                allgather_bytes(spec, lay, range(0), False, True)[1]
                if sharding_costs(prims).gathers_per_layer
                else 0.0
            )
            mem = moment("loss", saved_inputs=saved, loss=lb + others_loss, allgather=head)
            mem.why["loss"] = lwhy + (
                f" + {inflight - 1} other micro-batch(es)' loss saved tensors"
                if others_loss
                else ""
            )
            moments["loss"] = mem
        mem = moment("optimizer", saved_inputs=0.0, optim_temp=ADAM_TEMP_B * updated)
        mem.why["optim_temp"] = (
            f"foreach AdamW sqrt(v): 4 B x {updated / 1e9:.3f}B updated parameters"
        )
        moments["optimizer"] = mem
        stream = t * spec.hidden * BF16  # the residual stream entering the layer (or the head)
        evals = [
            moment(
                "eval",
                saved_inputs=stream,
                live_layer=p.live_layer,
                moe_buffers=p.moe_buffers,
                workspace=p.workspace,
                allgather=ag_fwd,
            )
            for name, p in parts.items()
            if name.startswith("forward")
        ]
        if last:
            c = loss_costs(prims)  # a forward only: no gradients, only the logits or tiles
            ev_loss = t * spec.vocab / lay.tp * c.work_per_logit + c.workspace
            evals.append(moment("eval", saved_inputs=stream, loss=ev_loss, allgather=head))
            evals[-1].why["loss"] = f"{prims.loss} forward: {c.explain_eval}"
        if evals:
            moments["eval"] = max(evals, key=lambda m: m.total)
            moments["eval"].why["saved_inputs"] = (
                f"no backward: the {t} x {spec.hidden} bf16 stream a layer reads"
            )
        out.append(StageMemory(s, layers, moments, parts))
    return out


def stage_memory(
    spec: ModelSpec, lay: Layout, prims: PrimitivesConfig, work: Workload
) -> list[MemoryBreakdown]:
    """The peak moment of every pipeline stage."""
    return [st.peak for st in stage_timeline(spec, lay, prims, work)]


def peak_memory(
    spec: ModelSpec, lay: Layout, prims: PrimitivesConfig, work: Workload
) -> tuple[MemoryBreakdown, int]:
    """The stage whose GPUs need the most memory (the one that OOMs first), and its index."""
    stages = stage_memory(spec, lay, prims, work)
    idx = max(range(len(stages)), key=lambda s: stages[s].total)
    return stages[idx], idx
