"""Context parallelism for Gated DeltaNet: every rank runs its own tokens, and the recurrent
state crosses ranks as an affine map combined by a prefix scan. No rank ever holds the
whole sequence.

Why it works. Inside one document the gated delta rule (Yang, Kautz, Hatamizadeh, "Gated
Delta Networks", ICLR 2025, eq. 10), S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T,
is affine in S_{t-1}. So a segment of tokens maps its incoming state S_in [K, V] to

    S_out = M S_in + S_out|0,        o_t = o_t|0 + S_in^T e_t,   e_t = M_t^T q_t

where M_t [K, K] is the product of the per-token factors a (I - b k k^T) up to t (M = M_last),
and S_out|0, o|0 are the results from a zero state. Segments compose as affine maps,
(M2, b2) o (M1, b1) = (M2 M1, M2 b1 + b2), an associative operator: the affine-scan view of
linear recurrences (Blelloch 1990; Martin & Cundy 2018 for linear RNNs; Mamba2's state
passing). For the delta rule the "decay" of the pair is the matrix M, not a scalar.

One core call gives all four terms: the ``linear_attention`` slot runs on value columns
[v | 0_K] (W = V + K) from the initial state [0 | I_K]. The first V columns evolve from zero
(S|0, o|0); the last K start at the identity and receive no writes, so they become M_t, and
their outputs are e_t. A document start inside a segment resets both parts, so M = 0 and
e_t = 0 beyond it. Cost: the core runs with V + K value columns (about 1.5-2x the core's
FLOPs for K = V); the core is a few percent of a GDN layer, whose projections dominate.
Through FLA (CUDA) the two parts run as two calls instead, the values at width V and a width-K
probe over each row's first document (``cp_probe.py``): no widened copies around the kernel.

Layout. The residual stream stays zigzag (full attention's load-balanced layout,
``cp/zigzag.py``): rank r holds chunks r and 2C-1-r of the 2C chunks. The scan does not need
contiguous shards, only segments in a known global order, so by default the layer runs on
the two zigzag chunks as two segments and no hidden state moves. ``relayout=True`` instead
converts the layer input to contiguous shards (``cp/relayout.py``, chunks 2r and 2r+1, one
segment per rank) and the output back: the textbook layout, kept to measure and test the
alternative (``benchmarks/gdn_cp.py``).

Per GDN layer:
1. projections, per token, on the local shard;
2. conv halo: each segment receives the last P = kernel-1 pre-conv inputs of the segment
   before it (P2P; backward sends the gradient back), zeroed where they lie in another
   document than the segment's first token;
3. the extended core on the local segments (one call, rows = B x local segments);
4. all-gather of every segment's (S_out|0, M) [S, B, H, K, V+K]; each rank then scans
   S_in(s) = cont(s) * (M(s-1) S_in(s-1) + S_out|0(s-1)) up to its own segments (at most S-1
   small matmuls; a redundant, communication-free prefix). cont(s) = 0 when a document
   starts exactly at segment s (global document ids of the CP layout);
5. o = o|0 + e S_in; gated norm and output projection, local.
Backward: autograd through the scan; the all-gather's backward is a reduce-scatter, which
hands each rank the state gradients that later segments send back (the reverse carry), and
halo gradients return to the previous segment's owner.

Bytes per rank per GDN layer, forward (backward moves as much again; full recompute
repeats the forward), B rows, Tl = T / C local tokens, Ch = 2GK + HV conv channels:

    transitions (all-gather)  S x B x H x K x (K+V) x 4   received (S = 2C; C with relayout)
    conv halo                 2 x B x P x Ch x bytes      sent
    relayout only             2 x Tl x B x D x bytes      sent (at most; to contiguous and back)

Qwen3.5-35B-A3B (H=32, K=V=128, D=2048, Ch=8192, P=3), T=128K, C=4, bf16, B=1: transitions
32 MiB, halo 96 KiB; relayout adds up to 256 MiB (192 MiB on average, 3/4 of tokens move).
The gather grows with C and the relayout shrinks with it (as T/C); they cross near C^2 = T/1024
for these dims (C of about 11 at 128K). A sequential pass (each rank waits for the previous
rank's state) would move one [B, H, K, V] state per rank but serialize the core C-fold.

Legend: B batch, C cp ranks, S global segments, L local segments, m tokens per segment,
R = B*L segment rows, Tl local tokens, D hidden, G key heads, H value heads, K key dim,
V value dim, W = V + K, Ch conv channels, P conv window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from bumblebee.primitives import emulation
from bumblebee.primitives.collectives import reduce_scatter_single
from bumblebee.primitives.cp.relayout import (
    contiguous_to_zigzag,
    exchange,
    zigzag_place,
    zigzag_to_contiguous,
)
from bumblebee.primitives.cp.zigzag import CPShards
from bumblebee.primitives.linear_attention.cp_probe import split_terms, takes_probe
from bumblebee.primitives.linear_attention.cp_relay import relay_core
from bumblebee.primitives.packed import DocLayout

CARRIES = ("scan", "relay")


@dataclass(frozen=True)
class Segments:
    """The global order of segments and the ones this rank holds (in local order)."""

    count: int  # S
    length: int  # m
    local: tuple[int, ...]
    contiguous: bool

    def place(self, s: int, cp: int) -> tuple[int, int]:
        """(rank, local slot) holding segment s."""
        return (s, 0) if self.contiguous else zigzag_place(s, cp)


def segments(layout: CPShards, contiguous: bool = False) -> Segments:
    C, r, n = layout.size, layout.rank, layout.chunk
    if contiguous:
        return Segments(C, 2 * n, (r,), True)
    return Segments(2 * C, n, (r, 2 * C - 1 - r), False)


def segment_rows(layout: CPShards, starts: list[int], m: int) -> DocLayout:
    """DocLayout of the ``m``-token segments starting at global offsets ``starts`` of every row (row
    b * len(starts) + i), from the host document bounds (no device read), once per layout."""
    if layout.docs is None:  # a layout built without host bounds: read them off the device ids
        return rows_layout(
            torch.stack([layout.doc_BT[:, s : s + m] for s in starts], 1).reshape(-1, m)
        )

    def build():
        rows = [
            (0, *(x - lo for x in bounds if lo < x < lo + m), m)
            for bounds in layout.docs.bounds
            for lo in starts
        ]
        return DocLayout(tuple(rows), m)

    return layout.cached(("gdn_rows", tuple(starts), m), "host", build)


def rows_layout(doc_RM: torch.Tensor) -> DocLayout:
    """DocLayout of rows given their (global) document ids."""
    starts = torch.ones_like(doc_RM, dtype=torch.bool)
    starts[:, 1:] = doc_RM[:, 1:] != doc_RM[:, :-1]
    m = doc_RM.shape[1]
    return DocLayout(
        tuple(tuple(torch.nonzero(row).flatten().tolist()) + (m,) for row in starts.cpu()), m
    )


def _shift(x_L, segs: Segments, layout: CPShards, step: int) -> torch.Tensor:
    """out[i] = the x of segment local[i] + step, from whichever rank holds it (zeros if none)."""
    me, C = layout.rank, layout.size
    out: list[torch.Tensor | None] = [None] * len(segs.local)
    sends, recvs = {}, {}
    for i, s in enumerate(segs.local):
        dest, src = s - step, s + step  # the segment that wants my x[i]; the one I want
        if 0 <= dest < segs.count:
            rank, slot = segs.place(dest, C)
            if rank == me:
                out[slot] = x_L[i]
            else:
                assert rank not in sends, "one halo message per peer and direction"
                sends[rank] = x_L[i].contiguous()
        if not 0 <= src < segs.count:
            out[i] = torch.zeros_like(x_L[i])
        elif segs.place(src, C)[0] != me:
            rank = segs.place(src, C)[0]
            assert rank not in recvs, "one halo message per peer and direction"
            recvs[rank] = (i, torch.empty_like(x_L[i]))
    exchange(layout.group, sends, {p: buf for p, (_, buf) in recvs.items()})
    for i, buf in recvs.values():
        out[i] = buf
    return torch.stack(out)


class ShiftHalo(torch.autograd.Function):
    """[L, B, P, Ch] tails of the local segments -> the tails of the segments just before
    them (zeros before segment 0). Backward returns each gradient to the tail's owner."""

    @staticmethod
    def forward(ctx, tails_LBPC, segs: Segments, layout: CPShards):
        ctx.segs, ctx.layout = segs, layout
        return _shift(tails_LBPC, segs, layout, -1)

    @staticmethod
    def backward(ctx, grad_LBPC):
        return _shift(grad_LBPC.contiguous(), ctx.segs, ctx.layout, +1), None, None


class GatherTransitions(torch.autograd.Function):
    """[L, ...] this rank's segment transitions -> [C, L, ...] every rank's, in rank order.
    Backward: each rank gets the sum over ranks of the gradients of its own transitions, a
    reduce-scatter (on gloo, which has none, an all-reduce and a slice)."""

    @staticmethod
    def forward(ctx, x_L, layout: CPShards):
        ctx.layout = layout
        parts = [torch.empty_like(x_L) for _ in range(layout.size)]
        dist.all_gather(parts, x_L.contiguous(), group=layout.group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad_CL):
        lay = ctx.layout
        grad_CL = grad_CL.contiguous()
        if emulation.nccl_branch(lay.group):
            mine = grad_CL.new_empty(grad_CL.shape[1:])
            reduce_scatter_single(mine, grad_CL.flatten(0, 1), group=lay.group)
            return mine, None
        dist.all_reduce(grad_CL, group=lay.group)
        return grad_CL[lay.rank], None


def incoming_states(trans_CLBHKW, segs: Segments, cont_BS, cp: int, V: int) -> torch.Tensor:
    """S_in [L, B, H, K, V] of the local segments: the prefix scan over segments 0 .. max(local)
    of the affine maps (M, S_out|0) = (trans[..., V:], trans[..., :V])."""
    state, found = None, {}
    for s in range(1, max(segs.local) + 1):
        rank, slot = segs.place(s - 1, cp)
        b_BHKV, M_BHKK = trans_CLBHKW[rank, slot].split([V, trans_CLBHKW.shape[-1] - V], dim=-1)
        out = b_BHKV if state is None else M_BHKK @ state + b_BHKV
        state = out * cont_BS[:, s, None, None, None].to(out.dtype)
        found[s] = state
    # Segment 0 starts from zero. Taken from the gathered tensor (times 0) so that the gather sits in
    # every rank's graph and every rank joins its backward collective (contiguous rank 0 needs nothing).
    zero = trans_CLBHKW[0, 0, ..., :V] * 0
    return torch.stack([found.get(s, zero) for s in segs.local])


def gated_delta_net_cp(
    layer, x_BLD: torch.Tensor, layout: CPShards, relayout: bool = False, carry: str = "scan"
) -> torch.Tensor:
    """A ``gdn.GatedDeltaNet`` layer on this rank's zigzag shard [B, Tl, D] -> y [B, Tl, D] (zigzag).
    ``carry``: "scan" (the affine scan with the state probe, below) or "relay" (the state passed
    rank to rank through the core's initial state, ``cp_relay.py``)."""
    if carry not in CARRIES:
        raise ValueError(
            f"Gated DeltaNet CP: carry must be one of {', '.join(CARRIES)}, got {carry!r}"
        )
    if relayout:
        x_BLD = zigzag_to_contiguous(x_BLD, layout)
    segs = segments(layout, contiguous=relayout)
    B, Tl, _ = x_BLD.shape
    L, m, P, S = len(segs.local), segs.length, layer.conv1d.window, segs.count
    H, K, V = layer.H, layer.K, layer.V
    if Tl != L * m or layout.doc_BT.shape[0] != B:
        raise ValueError(
            f"Gated DeltaNet CP: input {tuple(x_BLD.shape)} does not match the CP layout "
            f"({layout.doc_BT.shape[0]} rows, {L} segments of {m} tokens)"
        )
    if m < P:
        raise ValueError(
            f"Gated DeltaNet CP: segments of {m} tokens are shorter than the conv window ({P}); "
            f"use a longer sequence or fewer CP ranks"
        )

    # Documents (global ids): rows of local segments, whether segment s continues the document
    # open before it, and which halo tokens share the document of their segment's first token.
    doc_BT = layout.doc_BT
    rows = segment_rows(layout, [s * m for s in segs.local], m)
    cont_BS = torch.zeros(B, S, dtype=torch.bool, device=doc_BT.device)
    cont_BS[:, 1:] = doc_BT[:, m::m] == doc_BT[:, m - 1 : -1 : m]

    def as_rows(t):  # [B, L*m, ...] -> [B*L, m, ...], row b*L + i = segment i of row b
        return t.reshape((B * L, m) + tuple(t.shape[2:]))

    qkv_pre_BLC, z_BLHV, beta_BLH, g_BLH = layer.project(x_BLD)
    Ch = qkv_pre_BLC.shape[-1]
    init_RPC = None
    if P > 0:
        tails_LBPC = qkv_pre_BLC.reshape(B, L, m, Ch)[:, :, m - P :].transpose(0, 1)
        heads_BLPC = ShiftHalo.apply(tails_LBPC, segs, layout).transpose(0, 1)
        keep_BLP = torch.stack(
            [
                doc_BT[:, s * m - P : s * m] == doc_BT[:, s * m : s * m + 1]
                if s > 0
                else torch.zeros(B, P, dtype=torch.bool, device=doc_BT.device)
                for s in segs.local
            ],
            1,
        )
        init_RPC = (heads_BLPC * keep_BLP[..., None].to(heads_BLPC.dtype)).reshape(B * L, P, Ch)
    qkv_RMC, _ = layer.conv1d(as_rows(qkv_pre_BLC), rows, init_RPC, F.silu)
    q_RMGK, k_RMGK, v_RMHV = layer.split_heads(qkv_RMC, activated=True)

    R = B * L
    if carry == "relay":
        seg_layouts = [segment_rows(layout, [s * m], m) for s in segs.local]
        o_RMHV = relay_core(
            layer,
            q_RMGK,
            k_RMGK,
            v_RMHV,
            as_rows(g_BLH),
            as_rows(beta_BLH),
            seg_layouts,
            segs,
            layout,
            cont_BS,
            B,
        )
        y_BLD = layer.finish(o_RMHV.reshape(B, L * m, H, V), z_BLHV)
        return contiguous_to_zigzag(y_BLD, layout) if relayout else y_BLD

    if takes_probe(q_RMGK):  # FLA: values and state probe as two calls, no [v | 0_K] (cp_probe.py)
        o_RMHV = _probe_scan(
            layer, q_RMGK, k_RMGK, v_RMHV, as_rows(g_BLH), as_rows(beta_BLH), rows, layout, segs,
            cont_BS, B,
        )  # fmt: skip
        y_BLD = layer.finish(o_RMHV.reshape(B, L * m, H, V), z_BLHV)
        return contiguous_to_zigzag(y_BLD, layout) if relayout else y_BLD

    # The extended core: values [v | 0_K] from the state [0 | I_K] (see the module docstring).
    dt = torch.float64 if v_RMHV.dtype == torch.float64 else torch.float32
    v_ext = torch.cat([v_RMHV.to(dt), v_RMHV.new_zeros((R, m, H, K), dtype=dt)], dim=-1)
    eye_KK = torch.eye(K, dtype=dt, device=v_ext.device)
    init_RHKW = torch.cat([v_ext.new_zeros(R, H, K, V), eye_KK.expand(R, H, K, K)], dim=-1)
    o_ext, final_RHKW = layer.recompute.module(
        "linear_attn_core",
        layer.core,
        q_RMGK,
        k_RMGK,
        v_ext,
        as_rows(g_BLH),
        as_rows(beta_BLH),
        rows,
        init_RHKW,
    )
    o0_RMHV, e_RMHK = o_ext.to(dt).split([V, K], dim=-1)

    with torch.autocast(x_BLD.device.type, enabled=False):  # the carried state stays in fp32
        trans_CLBHKW = GatherTransitions.apply(
            final_RHKW.reshape(B, L, H, K, V + K).transpose(0, 1), layout
        )
        S_in_LBHKV = incoming_states(trans_CLBHKW, segs, cont_BS, layout.size, V)
        S_in_RHKV = S_in_LBHKV.transpose(0, 1).reshape(R, H, K, V)
        o_RMHV = o0_RMHV + torch.einsum("rmhk,rhkv->rmhv", e_RMHK, S_in_RHKV)
    y_BLD = layer.finish(o_RMHV.to(v_RMHV.dtype).reshape(B, L * m, H, V), z_BLHV)
    return contiguous_to_zigzag(y_BLD, layout) if relayout else y_BLD


class StateCorrection(torch.autograd.Function):
    """o = o|0 + e S_in [R, m, H, V] in o|0's dtype: the product in fp32 over the probe's p tokens
    (e is zero past them), the sum rounded once. Keeps e as the core returned it (no fp32 copy)
    and S_in; the gradient of o|0 is the output's (o|0 + c rounded from fp32: the identity)."""

    @staticmethod
    def forward(ctx, o0_RMHV, e_RPHK, S_in_RHKV):
        ctx.save_for_backward(e_RPHK, S_in_RHKV)
        m, p, dt = o0_RMHV.shape[1], e_RPHK.shape[1], S_in_RHKV.dtype
        # [R, H, p, K] @ [R, H, K, V]: one batched GEMM; o|0 added in place, in the GEMM's layout
        o_RHMV = e_RPHK.transpose(1, 2).to(dt, memory_format=torch.contiguous_format) @ S_in_RHKV
        if p < m:
            o_RHMV = F.pad(o_RHMV, (0, 0, 0, m - p))
        o_RHMV.add_(o0_RMHV.transpose(1, 2))
        return o_RHMV.transpose(1, 2).to(o0_RMHV.dtype, memory_format=torch.contiguous_format)

    @staticmethod
    def backward(ctx, do_RMHV):
        e_RPHK, S_in_RHKV = ctx.saved_tensors
        p, dt = e_RPHK.shape[1], S_in_RHKV.dtype
        do_RHPV = do_RMHV[:, :p].transpose(1, 2).to(dt, memory_format=torch.contiguous_format)
        de_RHPK = do_RHPV @ S_in_RHKV.transpose(-1, -2)
        de_RPHK = de_RHPK.transpose(1, 2).to(e_RPHK.dtype, memory_format=torch.contiguous_format)
        del de_RHPK
        e_RHKP = e_RPHK.permute(0, 2, 3, 1).to(dt, memory_format=torch.contiguous_format)
        return do_RMHV, de_RPHK, e_RHKP @ do_RHPV


def _probe_scan(layer, q_RMGK, k_RMGK, v_RMHV, g_RMH, beta_RMH, rows, layout, segs, cont_BS, B):
    """The scan's output o [R, m, H, V] in v's dtype from the two-call terms (``cp_probe.py``). Its
    fp32 temporaries are locals here or inside ``StateCorrection``: none is alive while the gated
    norm runs."""
    R, m, H, V = v_RMHV.shape
    K, L = q_RMGK.shape[-1], R // B
    o0_RMHV, e_RPHK, S0_RHKV, M_RHKK = split_terms(
        layer, q_RMGK, k_RMGK, v_RMHV, g_RMH, beta_RMH, rows
    )
    dt = torch.float64 if v_RMHV.dtype == torch.float64 else torch.float32
    with torch.autocast(q_RMGK.device.type, enabled=False):  # the carried state stays in fp32
        # (S_out|0, M) laid out in the gather's [L, B] order by the cat itself (no copy to gather)
        parts = [x.reshape(B, L, H, K, -1).transpose(0, 1) for x in (S0_RHKV, M_RHKK)]
        del S0_RHKV, M_RHKK
        trans_CLBHKW = GatherTransitions.apply(torch.cat(parts, -1), layout)
        del parts
        S_in_RHKV = (
            incoming_states(trans_CLBHKW, segs, cont_BS, layout.size, V)
            .transpose(0, 1)
            .reshape(R, H, K, V)
            .to(dt)
        )
        del trans_CLBHKW
        return StateCorrection.apply(o0_RMHV, e_RPHK, S_in_RHKV)
