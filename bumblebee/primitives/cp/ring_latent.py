"""Ring attention over MLA latents: what ``cp_attention = "ring"`` runs for Multi-head Latent Attention.

What travels around the ring per token is MLA's latent, not its heads: the kv latent ``c``
[C] after ``kv_a_layernorm`` and the shared rope key [R] after RoPE, one tensor [B, L, C + R]
in the compute dtype (DeepSeek-V3: 576 values, 1.1 KiB in bf16), instead of every head's K
[N, Dn + R] and V [N, Dv] (96 KiB with V padded; ``benchmarks/mla_cp_bytes.py`` counts the
bytes at the P2P calls). Every rank re-expands each block it holds with ``kv_b_proj``'s W:

    [k_nope_n | v_n] = W c,   k_n = [k_nope_n | k_rope],   v_n as is (Dv wide)

and attends its queries to it exactly as ``ring.py`` (fp32 score tiles, CPU / fp32) or
``ring_flash.py`` (varlen flash steps, CUDA bf16; v zero-padded to Dn + R there) do: same
zigzag block pairs, same document masks, same online log-sum-exp merge.

Why after the norm and after RoPE: the bytes are the same either way (C + R values), but
the normalized latent is what ``kv_b_proj`` consumes (the norm runs once per token on its
owner, and its weight's gradient stays in ordinary autograd), and a roped key needs no
position tables of the sender's tokens on the receiver.

Backward runs the ring again: each latent block travels with an fp32 accumulator d[c | k_rope];
a rank re-expands the block (recomputed, not kept from the forward: keeping it would hold
all C blocks' expanded K/V, O(T) per rank, which is what a ring exists to avoid; the
benchmark measures both, ``save_expanded``), computes the block's dK / dV for its queries and
folds them in: d c += [dK_nope | dV] W, d k_rope += sum over heads of dK_rope, and a local
dW += [dK_nope | dV]^T c (W is replicated over the CP group, whose gradient reduction sums
the ranks' dW like any other weight's). One last hop brings each accumulator home.

Legend: B batch, N heads, L local tokens (2n), C kv latent, R rope dims, Dn nope dims,
D = Dn + R, Dv value dims, X = C + R.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bumblebee.primitives import emulation
from bumblebee.primitives.cp.ring import backward_block, forward_block
from bumblebee.primitives.cp.ring_comm import backward_hop, ring_pass
from bumblebee.primitives.cp.ring_flash import (
    BlockKernel,
    backward_step,
    cuda_block_kernel,
    forward_step,
)
from bumblebee.primitives.cp.zigzag import CPShards
from bumblebee.primitives.kernel_choice import select


def _expand(lat_BLX, w, n_heads: int, v_dim: int):
    """Latent block -> (k [B, L, N, D], v [B, L, N, Dv]) in the latent's dtype."""
    B, L, X = lat_BLX.shape
    C = w.shape[1]
    c, k_rope = lat_BLX.split([C, X - C], dim=-1)
    kv = F.linear(c, w).view(B, L, n_heads, -1)
    k_nope, v = kv.split([kv.shape[-1] - v_dim, v_dim], dim=-1)
    return torch.cat((k_nope, k_rope[:, :, None].expand(B, L, n_heads, X - C)), dim=-1), v


class LatentRingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        q_BNLD,
        lat_BLX,
        w,
        layout: CPShards,
        scale: float,
        v_dim: int,
        kernel: BlockKernel | None,
        save_expanded: bool,
    ):
        with torch.autocast(q_BNLD.device.type, enabled=False):  # fp32 scores, as in backward
            B, N, L, D = q_BNLD.shape
            w_dt = w.to(lat_BLX.dtype)
            if kernel is None:  # ring.py's tiles: q / o [B, N, 1, L, .] (one head per "kv head")
                q = q_BNLD.float().unsqueeze(2)
                o = q.new_zeros(B, N, 1, L, v_dim)
                lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
            else:  # ring_flash.py's packed rows: q / o [B*L, N, D], lse [N, B*L]
                q = q_BNLD.transpose(1, 2).reshape(B * L, N, D)
                o = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
                lse = torch.full((N, B * L), float("-inf"), dtype=torch.float32, device=q.device)
            lat, kept = lat_BLX.contiguous(), []
            for step in range(layout.size):
                src = (layout.rank - step) % layout.size
                if step + 1 < layout.size:
                    (lat_next,), wait = ring_pass([lat], layout)
                k, v = _expand(lat, w_dt, N, v_dim)
                if save_expanded:
                    kept.append((lat, k, v))
                if kernel is None:
                    forward_block(
                        q, o, lse, k.transpose(1, 2), v.transpose(1, 2), layout, src, scale
                    )
                else:
                    v = F.pad(v, (0, D - v_dim)).reshape(B * L, N, D)
                    forward_step(q, o, lse, k.reshape(B * L, N, D), v, layout, src, scale, kernel)
                if step + 1 < layout.size:
                    wait()
                    lat = lat_next
            ctx.layout, ctx.scale, ctx.v_dim, ctx.kernel, ctx.kept = (
                layout,
                scale,
                v_dim,
                kernel,
                kept,
            )
            if kernel is None:  # the fp32 o is kept (Delta = rowsum(dO * O) in fp32, as ring.py)
                ctx.save_for_backward(q_BNLD, lat_BLX, w, o, lse)
                return o.squeeze(2).to(q_BNLD.dtype)
            out = o.to(q_BNLD.dtype)  # the flash backward takes the output in the inputs' dtype
            ctx.save_for_backward(q_BNLD, lat_BLX, w, out, lse)
            return out.view(B, L, N, D)[..., :v_dim].transpose(1, 2)

    @staticmethod
    def backward(ctx, grad_BNLV):
        with torch.autocast(grad_BNLV.device.type, enabled=False):
            return LatentRingAttention._backward(ctx, grad_BNLV)

    @staticmethod
    def _backward(ctx, grad_BNLV):
        q_BNLD, lat_BLX, w, out, lse = ctx.saved_tensors
        layout, scale, Dv, kernel, kept = ctx.layout, ctx.scale, ctx.v_dim, ctx.kernel, ctx.kept
        ctx.kept = None
        B, N, L, D = q_BNLD.shape
        C, dt = w.shape[1], lat_BLX.dtype
        Dn = D - (lat_BLX.shape[-1] - C)
        w_dt = w.to(dt)
        if kernel is None:
            q = q_BNLD.float().unsqueeze(2)
            do = grad_BNLV.float().unsqueeze(2)
            delta = (do * out).sum(-1)  # [B, N, 1, L]; out is the fp32 o here
        else:
            q = q_BNLD.transpose(1, 2).reshape(B * L, N, D)
            do = F.pad(grad_BNLV.to(q.dtype), (0, D - Dv)).transpose(1, 2).reshape(B * L, N, D)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        d_lat = torch.zeros(lat_BLX.shape, dtype=torch.float32, device=lat_BLX.device)
        dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        lat = lat_BLX.contiguous()
        for step in range(layout.size):
            src = (layout.rank - step) % layout.size
            if kept:
                lat, k, v = kept[step]
            else:
                k, v = _expand(lat, w_dt, N, Dv)
            dk = torch.zeros(B, L, N, D, dtype=torch.float32, device=q.device)
            if kernel is None:
                dv = torch.zeros(B, L, N, Dv, dtype=torch.float32, device=q.device)
                backward_block(
                    q,
                    do,
                    delta,
                    lse,
                    dq,
                    k.transpose(1, 2).float(),
                    v.transpose(1, 2).float(),
                    dk.transpose(1, 2),
                    dv.transpose(1, 2),
                    layout,
                    src,
                    scale,
                )
            else:
                dv = torch.zeros_like(dk)
                backward_step(
                    do,
                    q,
                    out,
                    lse,
                    dq,
                    k.reshape(B * L, N, D),
                    F.pad(v, (0, D - Dv)).reshape(B * L, N, D),
                    dk.view(B * L, N, D),
                    dv.view(B * L, N, D),
                    layout,
                    src,
                    scale,
                    kernel,
                )
            dkv = (
                torch.cat((dk[..., :Dn], dv[..., :Dv]), dim=-1).reshape(B * L, -1).to(dt)
            )  # [B*L, N (Dn+Dv)]
            d_lat += torch.cat(((dkv @ w_dt).float().view(B, L, C), dk[..., Dn:].sum(2)), dim=-1)
            dw += (dkv.T @ lat[..., :C].reshape(B * L, C)).float()
            # with the blocks kept, only the accumulator travels
            lat_list, (d_lat,) = backward_hop(step, layout, [] if kept else [lat], [d_lat])
            lat = lat_list[0] if lat_list else lat
        if kernel is None:
            dq_BNLD = dq.squeeze(2)
        else:
            dq_BNLD = dq.view(B, L, N, D).transpose(1, 2)
        return dq_BNLD.to(q_BNLD.dtype), d_lat.to(dt), dw.to(w.dtype), None, None, None, None, None


def latent_ring_attention(
    q_BNLD,
    lat_BLX,
    w,
    layout: CPShards,
    scale: float,
    v_dim: int,
    *,
    kernel: BlockKernel | None = None,
    save_expanded: bool = False,
):
    """MLA's CP ring: queries [B, N, L, Dn + R] (roped), latents [B, L, C + R] (normalized c, roped
    shared rope key), ``w`` = ``kv_b_proj.weight`` [N (Dn + Dv), C] -> output [B, N, L, Dv]. The
    block kernel follows ``primitives/kernel_choice.py`` (CUDA bf16/fp16: varlen flash steps) unless
    given; ``save_expanded`` keeps every hop's expansion for backward (measurement only)."""
    if (
        kernel is None
        and select("cp_attention", "ring", emulation.kind(q_BNLD), q_BNLD.dtype).name
        == "ring_varlen_attn"
    ):
        kernel = cuda_block_kernel()
    return LatentRingAttention.apply(
        q_BNLD, lat_BLX, w, layout, scale, v_dim, kernel, save_expanded
    )
