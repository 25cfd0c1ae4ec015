"""Ring attention for context parallelism (slot ``cp``, ``ring``).

K/V blocks travel around the CP ring (rank r sends to r+1, receives from r-1)
while each rank attends its local queries to the block it holds; partial
results are merged with an online log-sum-exp (Liu et al., Ring Attention,
2023; the merge is the one of FlashAttention, Dao et al. 2022). The next block
is in flight while the current one is computed, so a rank holds at most two
remote K/V blocks. Block pairs that the causal or document mask excludes
entirely are skipped (no matmul at all).

Backward runs the same ring: the K/V blocks travel again, each carrying its
dK/dV accumulator, which every rank adds its queries' contribution to; one last
pass brings the accumulators home. Per block pair, with P = exp(S - lse) and
Delta = rowsum(dO * O): dV += P^T dO, dS = P * (dO V^T - Delta), dQ += dS K s,
dK += dS^T Q s.

Options (``attention/options.py``): a sliding ``window`` masks the tiles and skips every block
pair whose keys all lie before every query's window; a ring step none of whose pairs is needed
is skipped whole (``needed_steps``; with zigzag shards and a window shorter than a chunk only
the steps bringing the own, previous and next rank's blocks are needed). With a window the
blocks are not forwarded hop by hop: for each step s some rank needs (``ring_plan``), every
rank sends its own K/V block straight to rank + s (``ring_comm.exchange``), and in backward
sends the block's dK/dV contributions straight back to its owner; steps no rank needs move no
bytes at all (at 8 ranks and a window shorter than a chunk: 2 exchanges instead of 7 hops).
``sinks`` join each row's
softmax after the last step: ``lse' = logaddexp(lse, sink)``, ``o' = o exp(lse - lse')``;
backward is the usual one with (o', lse') and ``dsink = -sum_rows exp(sink - lse') Delta``.

Scores are computed per (query tile, key chunk) pair in fp32, so memory is
O(tile x chunk), never O(T^2). Forward and backward both run with autocast off, so
under bf16 autocast the forward's scores and LSE are the fp32 ones the backward
recomputes (they used to come out of bf16 matmuls in the forward only).

This is the CPU path and the reference of ``ring_flash.py``, which runs the same ring
with a varlen flash kernel per block pair on CUDA in bf16/fp16 (``primitives/kernel_choice.py``).

Legend: B batch, K kv heads, G query heads per kv head, L local tokens (Tl),
D head dim, q/k tile rows.
"""

from __future__ import annotations

import dataclasses

import torch

from bumblebee.primitives import emulation
from bumblebee.primitives.attention.options import merge_sinks, sink_grad
from bumblebee.primitives.cp.ring_comm import backward_hop, exchange
from bumblebee.primitives.cp.ring_comm import ring_pass as _ring_pass
from bumblebee.primitives.cp.ring_flash import ring_flash_attention
from bumblebee.primitives.cp.zigzag import CPShards
from bumblebee.primitives.kernel_choice import Kernel, KernelQuery, select
from bumblebee.primitives.packed import DeviceCache
from bumblebee.registry import register

Q_TILE = 512  # query rows per score tile


def _pairs(layout: CPShards, src: int, window: int = 0):
    """(query slice, key slice, mask [B, 1, 1, q, k]) for every block pair of local queries
    x the K/V block of rank ``src`` that the causal + document (+ window) mask does not fully
    exclude."""
    n, L = layout.chunk, 2 * layout.chunk
    q_idx, k_idx, doc = layout.index_L, layout.rank_index(src), layout.doc_BT
    for qs in range(0, L, min(Q_TILE, n)):
        q_sl = slice(qs, min(qs + min(Q_TILE, n), L))
        qg = q_idx[q_sl]
        for kc in range(2):
            k_sl = slice(kc * n, (kc + 1) * n)
            kg = k_idx[k_sl]
            if int(kg[0]) > int(qg[-1]):
                continue  # every key is in the future of every query
            if window and int(qg[0]) - int(kg[-1]) >= window:
                continue  # every key is before every query's window
            mask = (kg[None, :] <= qg[:, None]) & (doc[:, kg][:, None, :] == doc[:, qg][:, :, None])
            if window:
                mask &= (qg[:, None] - kg[None, :] < window)[None]
            if not bool(mask.any()):
                continue  # causal or document boundary excludes the whole pair
            yield q_sl, k_sl, mask[:, None, None]


def needed_steps(layout: CPShards, window: int = 0) -> tuple[bool, ...]:
    """Per ring step: whether this rank's queries need the K/V block it receives then (host bools,
    derived once per layout and window)."""
    return layout.cached(
        ("ring_steps", window),
        layout.index_L.device,
        lambda: tuple(
            any(True for _ in _pairs(layout, (layout.rank - s) % layout.size, window))
            for s in range(layout.size)
        ),
    )


def ring_plan(layout: CPShards, window: int) -> tuple[int, ...]:
    """The ring steps (offsets) some rank of the group needs: the same on every rank (derived from
    the global layout), so every rank takes part in the same exchanges."""

    def build():
        needed = set()
        for r in range(layout.size):
            other = dataclasses.replace(
                layout, rank=r, index_L=layout.rank_index(r), _cache=DeviceCache()
            )
            needed.update(s for s, need in enumerate(needed_steps(other, window)) if need)
        return tuple(sorted(needed | {0}))

    return layout.cached(("ring_plan", window), layout.index_L.device, build)


def _scores(q_BKGqD, k_BKkD, mask, scale):
    s = torch.matmul(q_BKGqD, k_BKkD.unsqueeze(2).transpose(-1, -2)).mul_(scale)
    return s.masked_fill_(~mask, float("-inf"))


def forward_block(
    q, o, lse, k, v, layout: CPShards, src: int, scale: float, window: int = 0
) -> None:
    """Merge local queries x rank ``src``'s K/V block into the running (o, lse), in place.
    q, o fp32 [B, K, G, L, D] (o's last dim may be v's Dv), lse fp32 [B, K, G, L], k / v [B, K, L, D]."""
    for q_sl, k_sl, mask in _pairs(layout, src, window):
        s = _scores(q[:, :, :, q_sl], k[:, :, k_sl].float(), mask, scale)
        lse_p = torch.logsumexp(s, dim=-1)
        safe = torch.where(torch.isinf(lse_p), torch.zeros_like(lse_p), lse_p)
        o_p = torch.matmul(s.sub_(safe[..., None]).exp_(), v[:, :, k_sl].float().unsqueeze(2))
        old = lse[:, :, :, q_sl]
        new = torch.logaddexp(old, lse_p)
        new_safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
        o[:, :, :, q_sl] = (
            o[:, :, :, q_sl] * torch.exp(old - new_safe)[..., None]
            + o_p * torch.exp(lse_p - new_safe)[..., None]
        )
        lse[:, :, :, q_sl] = new


def backward_block(
    q, do, delta, lse, dq, k, v, dk, dv, layout: CPShards, src: int, scale: float, window: int = 0
) -> None:
    """Add local queries x rank ``src``'s block to dq and to the block's dk / dv (all fp32, in place).
    Shapes as ``forward_block``; do / dq like q, delta = rowsum(dO * O) like lse, dk / dv like k / v."""
    for q_sl, k_sl, mask in _pairs(layout, src, window):
        kc, vc = k[:, :, k_sl].unsqueeze(2), v[:, :, k_sl].unsqueeze(2)
        s = _scores(q[:, :, :, q_sl], k[:, :, k_sl], mask, scale)
        p = s.sub_(lse[:, :, :, q_sl, None]).exp_()  # 0 where masked
        dv[:, :, k_sl] += torch.matmul(p.transpose(-1, -2), do[:, :, :, q_sl]).sum(2)
        dp = torch.matmul(do[:, :, :, q_sl], vc.transpose(-1, -2))
        ds = dp.sub_(delta[:, :, :, q_sl, None]).mul_(p)
        dq[:, :, :, q_sl] += torch.matmul(ds, kc) * scale
        dk[:, :, k_sl] += torch.matmul(ds.transpose(-1, -2), q[:, :, :, q_sl]).sum(2) * scale


def _wait(started):
    bufs, wait = started
    wait()
    return bufs


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_BNLD, k_BKLD, v_BKLD, layout: CPShards, scale: float, window=0, sinks=None):
        with torch.autocast(q_BNLD.device.type, enabled=False):  # fp32 scores, as in backward
            return RingAttention._forward(ctx, q_BNLD, k_BKLD, v_BKLD, layout, scale, window, sinks)

    @staticmethod
    def _forward(ctx, q_BNLD, k_BKLD, v_BKLD, layout: CPShards, scale, window, sinks):
        B, N, L, D = q_BNLD.shape
        K = k_BKLD.shape[1]
        q = q_BNLD.float().view(B, K, N // K, L, D)
        o = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        k, v = k_BKLD.contiguous(), v_BKLD.contiguous()
        needed = needed_steps(layout, window)
        if window:  # direct exchanges of the steps some rank needs, all posted at once
            steps = ring_plan(layout, window)
            pending = {s: exchange([k, v], layout, s) for s in steps if s}
            for step in steps:
                kb, vb = (k, v) if step == 0 else _wait(pending[step])
                if needed[step]:
                    src = (layout.rank - step) % layout.size
                    forward_block(q, o, lse, kb, vb, layout, src, scale, window)
        for step in range(0 if window else layout.size):
            src = (layout.rank - step) % layout.size
            if step + 1 < layout.size:
                (k_next, v_next), wait = _ring_pass([k, v], layout)
            if needed[step]:
                forward_block(q, o, lse, k, v, layout, src, scale, window)
            if step + 1 < layout.size:
                wait()
                k, v = k_next, v_next
        if sinks is not None:
            o, lse = merge_sinks(o, lse, sinks.float().view(1, K, N // K, 1))
        ctx.save_for_backward(q_BNLD, k_BKLD, v_BKLD, o, lse, sinks)
        ctx.layout, ctx.scale, ctx.window = layout, scale, window
        return o.view(B, N, L, D).to(q_BNLD.dtype)

    @staticmethod
    def backward(ctx, grad_BNLD):
        with torch.autocast(grad_BNLD.device.type, enabled=False):
            return RingAttention._backward(ctx, grad_BNLD)

    @staticmethod
    def _backward(ctx, grad_BNLD):
        q_BNLD, k_BKLD, v_BKLD, o, lse, sinks = ctx.saved_tensors
        layout, scale, window = ctx.layout, ctx.scale, ctx.window
        B, N, L, D = q_BNLD.shape
        K = k_BKLD.shape[1]
        q = q_BNLD.float().view(B, K, N // K, L, D)
        do = grad_BNLD.float().reshape(B, K, N // K, L, D)
        delta = (do * o).sum(-1)  # [B, K, G, L]
        dq = torch.zeros_like(q)
        k, v = k_BKLD.float().contiguous(), v_BKLD.float().contiguous()
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        needed = needed_steps(layout, window)
        for step in ring_plan(layout, window) if window else ():  # blocks fetched again
            kb, vb = (k, v) if step == 0 else _wait(exchange([k, v], layout, step))
            dkb, dvb = (dk, dv) if step == 0 else (torch.zeros_like(k), torch.zeros_like(v))
            src = (layout.rank - step) % layout.size
            if needed[step]:
                backward_block(q, do, delta, lse, dq, kb, vb, dkb, dvb, layout, src, scale, window)
            if step:  # the block's gradient home to its owner; ours from rank + step
                gk, gv = _wait(exchange([dkb, dvb], layout, -step))
                dk, dv = dk + gk, dv + gv
        for step in range(0 if window else layout.size):
            src = (layout.rank - step) % layout.size
            if needed[step]:
                backward_block(q, do, delta, lse, dq, k, v, dk, dv, layout, src, scale, window)
            (k, v), (dk, dv) = backward_hop(step, layout, [k, v], [dk, dv])
        dsinks = None
        if sinks is not None:
            heads = sinks.float().view(1, K, N // K, 1)
            dsinks = sink_grad(heads, lse, delta).reshape(N).to(sinks.dtype)
        return (
            dq.view(B, N, L, D).to(q_BNLD.dtype),
            dk.to(k_BKLD.dtype),
            dv.to(v_BKLD.dtype),
            None,
            None,
            None,
            dsinks,
        )


def ring_kernel(q: KernelQuery) -> Kernel:
    """A ring of flash ``varlen_attn`` steps on CUDA in half precision, else fp32 score tiles
    (always with sinks or a sliding window: ring_flash.py takes causal pairs only)."""
    if q.sinks or q.window:
        why = "sink logits" if q.sinks else "a sliding window"
        return Kernel(
            "ring_tiles",
            f"ring, fp32 score tiles ({'attention sinks' if q.sinks else 'sliding window'})",
            False,
            f"the flash ring takes no {why}" if q.cuda else "",
        )
    if q.cuda and q.half:
        return Kernel("ring_varlen_attn", f"ring of varlen_attn steps (flash, {q.flash()})", True)
    return Kernel(
        "ring_tiles",
        "ring, fp32 score tiles",
        False,
        "flash kernels take bf16/fp16 only" if q.cuda else "",
    )


@register(
    "cp_attention",
    "ring",
    summary="K/V blocks around the CP ring, online log-sum-exp merge",
    kernel=ring_kernel,
    kernel_axes=("fa3", "sinks"),
)
def ring_attention(q_BNLD, k_BKLD, v_BKLD, layout: CPShards, scale: float, *, window=0, sinks=None):
    kernel = select(
        "cp_attention", "ring", emulation.kind(q_BNLD), q_BNLD.dtype, sinks=sinks is not None,
        window=bool(window),
    )  # fmt: skip
    if kernel.name == "ring_varlen_attn":
        return ring_flash_attention(q_BNLD, k_BKLD, v_BKLD, layout, scale)
    return RingAttention.apply(q_BNLD, k_BKLD, v_BKLD, layout, scale, window, sinks)
