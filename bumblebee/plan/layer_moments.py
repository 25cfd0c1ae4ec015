"""One layer's memory moments for the stage timeline (``timeline.py``): what a layer of each kind
keeps for backward and the working sets of its forward and backward passes, each with the formula
``--explain`` prints."""

from __future__ import annotations

from bumblebee.config import PrimitivesConfig
from bumblebee.plan.dsa_terms import dsa_bytes
from bumblebee.plan.hardware import GB
from bumblebee.plan.layer_bytes import (
    attn_core_bytes,
    gdn_cp_backward,
    gdn_cp_bytes,
    gdn_state_bytes,
    norm_bytes,
    router_bytes,
    stream_tensors,
)
from bumblebee.plan.layout import Layout
from bumblebee.plan.memory import (
    BF16,
    BWD_GRAD_FRACTION,
    FP32,
    cp_extra,
    mixer_act,
    mlp_act,
)
from bumblebee.plan.routed_bytes import expert_grad_bytes, routed_buffers, routed_saved
from bumblebee.plan.spec import ATTN, MOE, ModelSpec


def layer_moments(
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
    dsa = dsa_bytes(spec, lay, t, prims.dsa_block, dense=prims.dsa_stage == "dense_warmup")
    dsa_kept, dsa_why = dsa.kept, dsa.why
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
    gate_nd = spec.n_heads * spec.head_dim / tp if mixer == ATTN and spec.attn_gate else 0.0
    # gated attention (models/blocks.py): q_proj's [q | gate] output is kept by no op (q_norm keeps
    # its fp32 input, sigmoid its output); mixer_act counts it for selective recompute
    mix_saved -= 2 * gate_nd * BF16
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
        fla_b = t * (norm_bytes(spec, tp) + h2 + gb["fla_bwd"][0]) + gb["fla_bwd"][1]
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
                0.0,
                f"{name}'s mixer backward (its gated norm's or state correction's, after the "
                f"recompute): {norm_bytes(spec, tp) + h2 + gb['recompute'][0]:.0f} B/token + "
                f"{gb['recompute'][1] / GB:.3f} GB states",
            ),
            (  # the one moment FLA's chunk-state workspace is alive
                "backward:mixer",
                fla_b,
                0.0,
                ws,
                f"{name}'s mixer backward (FLA's backward, its chunk states): "
                f"{norm_bytes(spec, tp) + h2 + gb['fla_bwd'][0]:.0f} B/token + "
                f"{gb['fla_bwd'][1] / GB:.3f} GB states",
            ),
        ]
    elif mixer == ATTN and spec.dsa_topk:
        # DSA's blockwise core (plan/dsa_terms.py): its kept tensors per token and, forward, the
        # block outputs beside their concatenation ([N x C] bf16 twice); one query block's
        # transients (fixed; real tensors, so live, not a kernel workspace); backward: the tensors
        # its core reads (recomputed under full, with the layer's input norm), its input
        # gradients, the layer output's gradient and one block's backward transients
        cat = spec.n_heads / tp * spec.mla_kv_rank * BF16
        fwd_live = {"full": h2 + dsa_kept + cat}.get(rc, mk + mc + dsa_kept + cat)
        read = {"full": norm_bytes(spec, tp) + dsa.bwd_saved, "selective": mc}.get(rc, 0.0)
        mix_live = read + h2 + dsa.bwd_grads
        out = [
            (
                "forward:mixer",
                t * fwd_live + dsa.fwd_block,
                0.0,
                0.0,
                f"{name}'s mixer forward: {fwd_live:.0f} B/token ({rc}) + {dsa_why}",
            ),
            (
                "backward:mixer",
                t * mix_live + max(dsa.bwd_block, dsa.fwd_block),
                0.0,
                0.0,
                f"{name}'s mixer backward: {mix_live:.0f} B/token ({rc}; read + core gradients) "
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
        # partial RoPE: the ring's flat [t, N, D] q and k are copies of the head-major roped ones
        # (both alive through the ring; measured by the dry run, skills/plan/memory.md)
        ring = lay.cp > 1 and not spec.mla  # MLA's CP is the latent ring (cp_extra), no flat q/k
        flat = (nd + kvd) * BF16 if ring and getattr(spec, "partial_rope", False) else 0.0
        fwd_live = {"full": h2 + core_in + afwd + flat}.get(rc, mk + mc + afwd + flat)
        # full: by the core's backward the output gate's product has run its own, releasing
        # sigmoid(gate) and the core's output it kept (mixer_act's 2nd x g)
        mix_live = (
            {"full": mix_saved - 2 * gate_nd * BF16, "selective": mc}.get(rc, 0.0)
            + h2
            + nd * BF16 * (1 + g)
            + abwd
        )
        out = [
            (
                "forward:mixer",
                t * fwd_live,
                0.0,
                0.0,
                f"{name}'s mixer forward: {fwd_live:.0f} B/token ({rc}; core inputs + {awhy}"
                + (" + flat q/k copies (partial RoPE)" if flat else "")
                + ")",
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
        cp_bwd = gdn_cp_backward(spec, lay)
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
