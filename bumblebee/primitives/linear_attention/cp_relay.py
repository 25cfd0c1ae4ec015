"""Probe-free context parallelism for Gated DeltaNet: the carried state is relayed from rank
to rank through the core's ``initial_state`` / final-state output (``carry = "relay"``).

Why not the affine scan without the probe. A segment maps its incoming state affinely,
S_out = A S_in + B (``cp.py``). B is the final state of a zero-state run, but A is not a
decay product: for the delta rule A = prod_t a_t (I - b_t k_t k_t^T) is a full [K, K] matrix
per head (its scalar part, prod_t a_t, is all the kernel's decays give). Getting A costs
K state columns whichever way it is formed: the probe's K extra value columns; the product
of per-chunk WY transitions Gamma_C I - K_end^T W (C K^2 + K^3 per 64-token chunk, more
than the probe's 3 C K^2 + 1.5 C^2 K); or a state-only pass from the identity followed by a
second pass from the true S_in (about the probe's work again). So every parallel scheme does
about 1.75-2x the core's work at K = V (the probe also yields the output correction
e_t = M_t^T q_t in the same pass), and the only way to run the core exactly once per token
is to know S_in before starting: the relay.

The relay. Segments run in their global order s = 0 .. S-1; the owner of segment s waits
for S_out(s-1) from the owner of s-1 (a [B, H, K, V] fp32 message, zeroed where a document
starts exactly at s), runs the core once with ``initial_state = S_in`` (FLA's
``chunk_gated_delta_rule`` takes it as is: ``fla.py``), and sends its final state on. The
backward runs the chain in reverse: dS_out(s) arrives from the owner of s+1, the core's
backward gives the input gradients and dS_in(s), which goes to the owner of s-1. Outputs and
gradients are those of one process (the same core calls on the same states).

Trade-off (per rank, per layer, core work in units of one segment's core): the scan does
L x (1.75-2) at full parallelism plus an all-gather of S x [K, K + V] transitions; the relay
does L x 1 but its critical path is the whole chain, S segment cores (2C with zigzag
shards, C with relayout: the full sequence's core time either way), and it moves one
[K, V] state per rank boundary. It saves the most work and memory (no [v | 0_K] values, no
fp32 probe outputs) and is faster when the core is small against the rest of the layer or
C <= ~2; the scan wins on latency at larger C (``benchmarks/gdn_cp.py`` prints both).

Autograd: one Function for the chain. It saves the inputs and the [B, H, K, V] incoming
states (so full recompute frees them like any saved tensor) and its backward reruns each
segment's core under autograd in reverse chain order, keeping its intermediates for the
immediate backward (``recompute.eager``: the chunked core's own checkpoint is skipped there),
so the chunked core runs forward twice per step, as in the scan (at 1x instead of the probe's
width). FLA's op re-runs its forward inside its backward: three kernel forwards there. Every message
sits at a fixed point of every rank's forward and
backward (no engine-order dependence) and a rank only waits for a segment earlier
(forward) or later (backward) in the chain, which never waits on it: no deadlock.

Legend: B batch, L local segments, S global segments, m tokens per segment, R = B*L rows,
G key heads, H value heads, K key dim, V value dim.
"""

from __future__ import annotations

import torch

from bumblebee.primitives.cp.relayout import exchange
from bumblebee.primitives.cp.zigzag import CPShards
from bumblebee.primitives.recompute import eager


def _pass(state, to_rank: int | None, from_rank: int | None, layout: CPShards, like: torch.Tensor):
    """Send ``state`` to ``to_rank`` and/or receive one from ``from_rank`` (group ranks; None: none)."""
    recv = torch.empty_like(like) if from_rank is not None else None
    exchange(
        layout.group,
        {} if to_rank is None else {to_rank: state.contiguous()},
        {} if recv is None else {from_rank: recv},
    )
    return recv


class RelayCore(torch.autograd.Function):
    """Rows [R, m, ...] of this rank's segments (row b*L + i = local segment i of row b) ->
    o [R, m, H, V]; the state crosses ranks in the chain's order (see the module docstring).
    Saves the inputs and the incoming states only (full recompute can free them as any
    saved tensor); backward reruns each segment's core under autograd."""

    @staticmethod
    def forward(
        ctx, q_RMGK, k_RMGK, v_RMHV, g_RMH, beta_RMH, run, segs, layout: CPShards, cont_BS, B: int
    ):
        L, me, C = len(segs.local), layout.rank, layout.size
        H, K, V = v_RMHV.shape[2], q_RMGK.shape[-1], v_RMHV.shape[-1]
        dt = (
            torch.float64 if v_RMHV.dtype == torch.float64 else torch.float32
        )  # the core's state dtype
        like = torch.zeros(B, H, K, V, dtype=dt, device=v_RMHV.device)
        outs, s_ins, carried = (
            {},
            {},
            None,
        )  # carried: my last S_out, when my next segment follows it
        for i in sorted(range(L), key=lambda i: segs.local[i]):
            s = segs.local[i]
            if s == 0:
                s_in = like
            elif segs.place(s - 1, C)[0] == me:
                s_in = carried
            else:
                s_in = _pass(None, None, segs.place(s - 1, C)[0], layout, like)
            s_ins[i] = s_in * cont_BS[:, s, None, None, None].to(dt)
            outs[i], s_out = run(
                i, *(_seg(x, i, B, L) for x in (q_RMGK, k_RMGK, v_RMHV, g_RMH, beta_RMH)), s_ins[i]
            )
            carried = s_out.to(dt)
            if s + 1 < segs.count and segs.place(s + 1, C)[0] != me:
                _pass(carried, segs.place(s + 1, C)[0], None, layout, like)
        ctx.save_for_backward(
            q_RMGK, k_RMGK, v_RMHV, g_RMH, beta_RMH, torch.stack([s_ins[i] for i in range(L)])
        )
        ctx.run, ctx.segs, ctx.layout, ctx.cont_BS, ctx.B = run, segs, layout, cont_BS, B
        return torch.stack([outs[i] for i in range(L)], 1).flatten(0, 1)

    @staticmethod
    def backward(ctx, do_RMHV):
        *inputs, s_in_LBHKV = ctx.saved_tensors
        segs, layout, B = ctx.segs, ctx.layout, ctx.B
        L, me, C = len(segs.local), layout.rank, layout.size
        like = torch.zeros_like(s_in_LBHKV[0])
        grads, carried = (
            {},
            None,
        )  # carried: dS_in of my later segment, when it directly follows this one
        for i in sorted(range(L), key=lambda i: -segs.local[i]):
            s = segs.local[i]
            if s + 1 == segs.count:
                d_out = None
            elif segs.place(s + 1, C)[0] == me:
                d_out = carried
            else:
                d_out = _pass(None, None, segs.place(s + 1, C)[0], layout, like)
            with (
                torch.enable_grad(),
                eager(),
            ):  # differentiated at once: no checkpoint inside the core
                leaves = [
                    _seg(x, i, B, L).detach().requires_grad_(need)
                    for x, need in zip(inputs, ctx.needs_input_grad[:5])
                ]
                h0 = s_in_LBHKV[i].detach().requires_grad_(s > 0)
                o, s_out = ctx.run(i, *leaves, h0, recompute=False)
            wanted = [x for x in leaves + [h0] if x.requires_grad]
            outputs, seeds = [o], [_seg(do_RMHV, i, B, L)]
            if d_out is not None:
                outputs.append(s_out)
                seeds.append(d_out.to(s_out.dtype))
            got = iter(torch.autograd.grad(outputs, wanted, seeds, allow_unused=True))
            g = [next(got) if x.requires_grad else None for x in leaves + [h0]]
            grads[i] = [
                torch.zeros_like(x) if d is None and x.requires_grad else d
                for x, d in zip(leaves, g[:5])
            ]
            if s > 0:
                d_in = g[5] if g[5] is not None else like
                carried = d_in.to(like.dtype) * ctx.cont_BS[:, s, None, None, None].to(like.dtype)
                if segs.place(s - 1, C)[0] != me:
                    _pass(carried, segs.place(s - 1, C)[0], None, layout, like)
        out = [
            None
            if grads[0][j] is None
            else torch.stack([grads[i][j] for i in range(L)], 1).flatten(0, 1)
            for j in range(5)
        ]
        return (*out, None, None, None, None, None)


def _seg(x, i: int, B: int, L: int) -> torch.Tensor:
    """Local segment i's rows [B, m, ...] of rows [R, m, ...] (row b*L + i)."""
    return x.reshape((B, L) + tuple(x.shape[1:]))[:, i]


def relay_core(
    layer,
    q_RMGK,
    k_RMGK,
    v_RMHV,
    g_RMH,
    beta_RMH,
    seg_layouts,
    segs,
    layout: CPShards,
    cont_BS,
    B: int,
) -> torch.Tensor:
    """The ``linear_attention`` core of ``layer`` over this rank's segments with the state relayed
    (``seg_layouts[i]``: the DocLayout of local segment i's B rows) -> o [R, m, H, V]."""

    def run(i, q, k, v, g, beta, h0, recompute=True):
        if not recompute:
            return layer.core(q, k, v, g, beta, seg_layouts[i], h0)
        return layer.recompute.module(
            "linear_attn_core", layer.core, q, k, v, g, beta, seg_layouts[i], h0
        )

    return RelayCore.apply(q_RMGK, k_RMGK, v_RMHV, g_RMH, beta_RMH, run, segs, layout, cont_BS, B)
