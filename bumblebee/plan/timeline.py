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
from bumblebee.plan.dsa_terms import dsa_bytes
from bumblebee.plan.hardware import FIXED_OVERHEAD_GB, FRAGMENTATION, GB
from bumblebee.plan.layer_bytes import (
    attn_core_bytes,
    gdn_cp_bytes,
    norm_bytes,
    router_bytes,
    stream_tensors,
)
from bumblebee.plan.layout import Layout, Workload
from bumblebee.plan.memory import (
    ADAM_TEMP_B,
    BF16,
    BWD_GRAD_FRACTION,
    FP32,
    GDN_CP_BWD_FACTOR,
    allgather_bytes,
    cp_extra,
    expert_grad_bytes,
    gdn_state_bytes,
    in_flight,
    local_tokens,
    loss_bytes,
    loss_costs,
    loss_kept,
    mixer_act,
    mlp_act,
    pair_factor,
    routed_buffers,
    routed_saved,
    sharding_costs,
    stage_kinds,
    stage_layers,
    static_bytes,
)
from bumblebee.plan.spec import ATTN, MOE, ModelSpec

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


def _layer_moments(
    spec: ModelSpec,
    kind: tuple[str, str],
    lay: Layout,
    prims: PrimitivesConfig,
    t: int,
    skew: float = 1.0,
    mb: int = 1,
):
    """Bytes per micro-batch saved by one layer of ``kind``, and its candidate moments:
    (moment, live_layer, moe_buffers, workspace, why) in bytes for t local tokens."""
    mixer, mlp = kind
    tp, h = lay.tp, spec.hidden
    h2 = h / tp * BF16  # one bf16 [t, H] tensor per token
    mk, mc = mixer_act(spec, mixer, tp)
    fk, fc = mlp_act(spec, mlp, tp)
    cpk, cpm, cp_why = cp_extra(spec, mixer, lay)
    routed = routed_buffers(spec, prims, tp, skew) if mlp == MOE else {}
    ws = t * gdn_state_bytes(spec, tp) if mixer != ATTN else 0.0
    dsa_kept, dsa_ws, dsa_why = dsa_bytes(spec, lay, t, prims.dsa_block)
    # (DSA's kept set is not added to cpk: at the MoE backward the layer's saved tensors,
    # mix_saved, already hold what its core keeps, q and latents alike: the dry run's count)
    cp_why = "; ".join(w for w in (cp_why, dsa_why) if w)
    f = BWD_GRAD_FRACTION
    rc = "full" if prims.recompute == "offload" else prims.recompute  # the device side is full's
    rsaved = routed_saved(spec, prims, tp) if mlp == MOE else 0.0
    saved = {"full": h2, "selective": mk + fk + rsaved, "none": mk + mc + fk + fc + rsaved}[rc]
    # the mixer's saved tensors with its input norm counted from the code (mixer_act's count of it is
    # the throughput model's elementwise bytes: 6H, 8H for attention)
    mix_saved = (
        mk + mc + norm_bytes(spec, tp) - (BF16 + FP32 + (BF16 if mixer == ATTN else 0)) * h / tp
    )
    # the MLP block's side of a recomputed layer at its backward: its input norm, the router, the
    # gradients in flight (the layer output's; with a shared expert, its input gradient waiting for
    # the routed one); the shared expert's own tensors are gone (its backward runs first)
    in_flight = 2 if spec.shared_ffn else 1
    moe_side = norm_bytes(spec, tp) + router_bytes(spec, tp) + in_flight * h2
    # live bytes beside the MoE's routed peak (the whole layer's saved tensors under full recompute)
    moe_live = (
        t
        * {"full": mix_saved + cpk + moe_side, "selective": mc + fc + cpk, "none": f * (fk + fc)}[
            rc
        ]
    )
    name = f"a {mixer}/{mlp} layer"
    cp_note = f" + {cp_why}" if cp_why else ""
    gdn_cp = mixer != ATTN and lay.cp > 1 and rc == "full"
    if gdn_cp:  # Gated DeltaNet's CP scan, counted from its code (gdn_cp_bytes)
        gb = gdn_cp_bytes(spec, lay, mb, tokens=t)
        moe_live = t * (gb["saved"][0] + norm_bytes(spec, tp) + moe_side) + gb["saved"][1]
        fwd_b = t * (h2 + gb["fwd"][0]) + gb["fwd"][1]
        bwd_b = t * (norm_bytes(spec, tp) + h2 + gb["recompute"][0]) + gb["recompute"][1]
        out = [
            (
                "forward:mixer",
                fwd_b,
                0.0,
                0.0,
                f"{name}'s mixer forward: {h2 + gb['fwd'][0]:.0f} B/token + {gb['fwd'][1] / GB:.3f} GB states "
                f"(GDN CP scan, full recompute)",
            ),
            (
                "backward:mixer",
                bwd_b,
                0.0,
                ws,
                f"{name}'s mixer backward (its recompute at the gated norm): "
                f"{norm_bytes(spec, tp) + h2 + gb['recompute'][0]:.0f} B/token + {gb['recompute'][1] / GB:.3f} GB "
                f"states",
            ),
        ]
    elif mixer == ATTN and spec.dsa_topk:
        # DSA's blockwise core (plan/dsa_terms.py): its kept tensors per token and, forward, the
        # block outputs beside their concatenation ([N x C] bf16 twice); one query block's
        # transients (fixed; real tensors, so live, not a kernel workspace); backward: the saved
        # tensors, their gradients, the block twice (recompute + gradients)
        cat = spec.n_heads / tp * spec.mla_kv_rank * BF16
        fwd_live = {"full": h2 + dsa_kept + cat}.get(rc, mk + mc + dsa_kept + cat)
        mix_live = {"full": mix_saved, "selective": mc}.get(rc, 0.0) + h2 + dsa_kept
        out = [
            (
                "forward:mixer",
                t * fwd_live + dsa_ws / 2,
                0.0,
                0.0,
                f"{name}'s mixer forward: {fwd_live:.0f} B/token ({rc}) + {dsa_why}",
            ),
            (
                "backward:mixer",
                t * mix_live + dsa_ws,
                0.0,
                0.0,
                f"{name}'s mixer backward: {mix_live:.0f} B/token ({rc}; saved + core gradients) "
                f"+ {dsa_why}",
            ),
        ]
    elif mixer == ATTN:
        # attention: inputs of the core + its transients (attn_core_bytes); backward: the saved tensors,
        # the layer output's gradient, the core output's (+ the gate's) and the core's backward buffers
        afwd, abwd, awhy = attn_core_bytes(spec, lay)
        g = 1 if spec.attn_gate else 0
        nd = spec.n_heads * spec.head_dim / tp
        kvd = max(1.0, spec.n_kv_heads / tp) * spec.head_dim
        core_in = (
            nd * BF16 * (1 + 2 * g) + 2 * kvd * BF16
        )  # roped q (+ q_proj's [q | gate]), roped k, v
        fwd_live = {"full": h2 + core_in + afwd}.get(rc, mk + mc + afwd)
        mix_live = (
            {"full": mix_saved, "selective": mc}.get(rc, 0.0) + h2 + nd * BF16 * (1 + g) + abwd
        )
        out = [
            (
                "forward:mixer",
                t * fwd_live,
                0.0,
                0.0,
                f"{name}'s mixer forward: {fwd_live:.0f} B/token ({rc}; core inputs + {awhy})",
            ),
            (
                "backward:mixer",
                t * mix_live,
                0.0,
                0.0,
                f"{name}'s mixer backward: {mix_live:.0f} B/token ({rc}; saved + gradients + {awhy})",
            ),
        ]
    else:
        # mixer backward: its saved tensors, their gradients, the CP scan's fp32 gradients, and the bf16
        # gradients of the mixer's weights before accumulation
        cp_bwd = cpk * (1 + GDN_CP_BWD_FACTOR)
        wgrad = spec.mixer_params(mixer) / tp * BF16
        mix_live = {"full": (mk + mc) * (1 + f), "selective": mc + mk * f, "none": (mk + mc) * f}[
            rc
        ] + cp_bwd
        out = [
            (
                "forward:mixer",
                t * (mk + mc + cpm),
                0.0,
                0.0,
                f"{name}'s mixer forward: {mk + mc + cpm:.0f} B/token",
            ),
            (
                "backward:mixer",
                t * mix_live + wgrad,
                0.0,
                ws,
                f"{name}'s mixer backward: {mix_live:.0f} B/token ({rc}; grads {f} x saved){cp_note}; weight "
                f"gradients {wgrad / GB:.2f} GB",
            ),
        ]
    if routed:
        # forward: the layer's bf16 stream tensors and the router beside the routed buffers (full
        # recompute keeps nothing else); the block's output [t, H]
        fwd_live = {"full": stream_tensors(spec) * h2 + router_bytes(spec, tp)}.get(rc, fk + fc)
        out.append(
            (
                "forward:moe",
                t * fwd_live,
                t * (routed["fwd"][0] + h2),
                0.0,
                f"{name}'s MoE forward: {fwd_live:.0f} B/token + routed {routed['fwd'][1]} + output",
            )
        )
        cands = [
            (
                moe_live,
                t * routed[ph][0] + expert_grad_bytes(spec, lay, prims, ph),
                routed[ph][1]
                + f" + expert grads {expert_grad_bytes(spec, lay, prims, ph) / GB:.2f} GB",
            )
            for ph in ("bwd", "bwd_wgrad")
            if ph in routed
        ]
        if (
            rc == "full"
        ):  # the recompute forward: the layer's residual h is still a local of its forward
            cands.append(
                (
                    moe_live + t * h2,
                    t * routed["recompute"][0],
                    routed["recompute"][1] + " (recompute forward)",
                )
            )
        live, rb, rwhy = max(cands, key=lambda v: v[0] + v[1])
        out.append(
            (
                "backward:moe",
                live,
                rb,
                0.0,
                f"{name}'s MoE backward: {live / t:.0f} B/token of the layer's saved tensors; routed {rwhy}",
            )
        )
    else:
        out.append(("forward:mlp", t * (fk + fc), 0.0, 0.0, f"{name}'s MLP forward"))
    return saved, out


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
        per_kind = {
            k: _layer_moments(spec, k, lay, prims, t, skew, work.micro_batch) for k in kinds
        }
        saved_mb = sum(n * per_kind[k][0] for k, n in kinds.items())
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
                    live_layer=pair * live,
                    moe_buffers=pair * routed,
                    workspace=ws,
                    allgather=ag,
                    loss=others_loss,
                )
                mem.why["live_layer"] = why + (
                    " (x2: two micro-batches in a layer)" if pair > 1 else ""
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
