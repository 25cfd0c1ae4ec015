"""DeepSeek Sparse Attention under context parallelism: fetch only the latents the queries selected.

Queries stay local (zigzag shards), keys are global. Per layer:

1. the indexer keys [Di] are all-gathered (``GatherSequence``: small, and every query scores every
   earlier key anyway);
2. every local query's top-k is taken over the global row (``dsa.select_keys``, no gradient);
3. the union of the selected key positions is fetched from their owners (``FetchRows``): an
   all-to-all of the per-owner counts, one of the requested local row ids (int32), one of the
   latent rows [C + R] themselves. A rank receives at most the rows an all-gather would bring
   (the union is bounded by the row), plus 4 B of request per row;
4. the main attention and the indexer KL run over the fetched rows in query blocks
   (``dsa.attend_selected``, checkpointed).

Backward sends each fetched row's gradient back to its owner (the reverse all-to-all), which adds
them into its latents' gradient; the indexer keys' gradients return by ``GatherSequence``'s
reduce-scatter. Kept for backward: the selection as int32 slots into the fetched rows
[B, Tl, K] (4 B per selected key), the fetched rows and the gathered indexer keys.

The planner's dry run has no values, so no selection: ``assume_every_key`` makes the union every
key the rank's queries may see (the most a rank fetches, an all-gather's volume).

Legend: B batch, Tl local queries, T = S global keys, K selected keys, U fetched rows, F = C + R.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from bumblebee.primitives.attention.dsa import _up, attend_selected, select_keys
from bumblebee.primitives.cp.zigzag import CPShards

_EVERY_KEY = contextvars.ContextVar("bumblebee_dsa_assume_every_key", default=False)


@contextlib.contextmanager
def assume_every_key():
    """Inside, the fetched union is every key up to the rank's last query (fake tensors hold no
    selection; the planner's dry run)."""
    token = _EVERY_KEY.set(True)
    try:
        yield
    finally:
        _EVERY_KEY.reset(token)


def owners(flat_U: torch.Tensor, layout: CPShards, rows_local: int):
    """Global flat key ids ``b * T + pos`` -> (owning rank, row in the owner's flattened
    [B x Tl] shard). Rank r holds chunks r and 2C - 1 - r of n = T / 2C tokens, in that order."""
    T, n, C = layout.seq_len, layout.chunk, layout.size
    b, pos = flat_U // T, flat_U % T
    c = pos // n
    late = c >= C
    rank = torch.where(late, 2 * C - 1 - c, c)
    return rank, b * rows_local + pos % n + late * n


def _a2a(out, inp, out_splits, in_splits, group):
    dist.all_to_all_single(out, inp, out_splits, in_splits, group=group)
    return out


class FetchRows(torch.autograd.Function):
    """Rows [U, F] of the global row's keys ``flat_U`` (ids ``b * T + pos``), each from the rank
    holding it; backward returns each row's gradient to its owner."""

    @staticmethod
    def forward(ctx, x_BLF, flat_U, layout: CPShards):
        B, L, F = x_BLF.shape
        rank, local = owners(flat_U, layout, L)
        order = torch.argsort(rank, stable=True)
        edges = torch.searchsorted(rank[order], torch.arange(layout.size + 1, device=rank.device))
        counts = edges[1:] - edges[:-1]
        got_counts = _a2a(torch.empty_like(counts), counts, None, None, layout.group)
        send, recv = counts.tolist(), got_counts.tolist()
        ids = local[order].to(torch.int32)
        requests = _a2a(ids.new_empty(sum(recv)), ids, recv, send, layout.group)
        rows = x_BLF.reshape(B * L, F)[requests]
        got = _a2a(rows.new_empty(len(flat_U), F), rows, send, recv, layout.group)
        ctx.save_for_backward(order, requests)
        ctx.layout, ctx.splits, ctx.shape = layout, (send, recv), x_BLF.shape
        return got.new_empty(got.shape).index_copy_(0, order, got)

    @staticmethod
    def backward(ctx, grad_UF):
        order, requests = ctx.saved_tensors
        send, recv = ctx.splits
        B, L, F = ctx.shape
        g = grad_UF[order].contiguous()
        back = _a2a(g.new_empty(len(requests), F), g, recv, send, ctx.layout.group)
        grad = g.new_zeros(B * L, F).index_add_(0, requests.long(), back)
        return grad.view(B, L, F), None, None


def _wanted(sel_BQK, layout: CPShards, qpos, B: int):
    """(global flat ids of the union of selected keys [U], slot of every selection in it
    [B, Tl, K] int32, -1 where none)."""
    T = layout.seq_len
    base = torch.arange(B, device=sel_BQK.device)[:, None, None] * T
    flat = torch.where(sel_BQK >= 0, sel_BQK + base, -1)
    if _EVERY_KEY.get():
        end = int(qpos.max()) + 1
        want = (torch.arange(B, device=flat.device)[:, None] * T + torch.arange(end)).reshape(-1)
    else:
        mask = torch.zeros(B * T + 1, dtype=torch.bool, device=flat.device)
        mask[flat.reshape(-1)] = True  # -1 lands on the spare last entry
        want = mask[:-1].nonzero()[:, 0]
    slot_of = torch.full((B * T + 1,), -1, dtype=torch.int32, device=flat.device)
    slot_of[want] = torch.arange(len(want), dtype=torch.int32, device=flat.device)
    return want, slot_of[flat]


def _block(q_abs, rows_UF, ki_UD, slot, qi, w, scale, index_scale, C):
    valid = slot >= 0
    B, Q, K = slot.shape
    s = slot.clamp(min=0).long().reshape(-1)
    lat_sel = rows_UF[s].view(B, Q, K, -1)
    ki_sel = ki_UD[s].view(B, Q, K, -1)
    return attend_selected(
        q_abs, lat_sel, ki_sel, qi, w, valid, scale=scale, index_scale=index_scale, C=C
    )


def dsa_fetched(
    q_abs, lat_local, qi, ki, w, layout: CPShards, *, topk, scale, index_scale, block, C
):
    """(o_lat [B, Tl, N, C], summed indexer KL of the local queries) with local queries and
    latents ``lat_local`` [B, Tl, C + R], the row's indexer keys ``ki`` [B, T, Di] (gathered)."""
    B = q_abs.shape[0]
    qpos, doc_k = layout.index_L, layout.doc_BT
    sel = select_keys(
        qi, ki, w, qpos, doc_k[:, qpos], doc_k, topk=topk, index_scale=index_scale, block=block
    )
    want, slot = _wanted(sel, layout, qpos, B)
    del sel
    rows = FetchRows.apply(lat_local, want, layout)  # [U, C + R]
    ki_u = ki.reshape(-1, ki.shape[-1])[want]  # the union's indexer keys (gradient to ki)
    outs, kl = [], _up(q_abs.new_zeros(()))
    for i in range(0, q_abs.shape[1], block):
        j = min(i + block, q_abs.shape[1])
        args = (q_abs[:, i:j], rows, ki_u, slot[:, i:j], qi[:, i:j], w[:, i:j])
        if torch.is_grad_enabled():
            o, k = checkpoint(_block, *args, scale, index_scale, C, use_reentrant=False)
        else:
            o, k = _block(*args, scale, index_scale, C)
        outs.append(o)
        kl = kl + k
    return torch.cat(outs, dim=1), kl
