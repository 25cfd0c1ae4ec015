"""Context-parallel attention by all-gathering K and V (slot ``cp``, ``allgather``, the reference).

Every CP rank gathers the keys and values of the whole sequence (restoring the
global token order from the zigzag shards), then attends its local queries to
them under the causal-and-same-document mask written out in full. Backward
returns each rank the sum, over all ranks' queries, of the gradient for its own
K/V tokens: a reduce-scatter (on gloo, which has none, an all-reduce and a
slice). Obviously correct; it holds the whole sequence's K/V on every rank.

To keep the mask small, each of the two local chunks only looks at keys up to
its own end (causality makes later keys irrelevant).

Legend: B batch, N query heads, K kv heads, Tl local tokens, T global tokens,
D head dim, C cp ranks, n chunk length T / 2C.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from bumblebee.primitives import emulation
from bumblebee.primitives.attention.options import explicit_attention, window_allows
from bumblebee.primitives.collectives import reduce_scatter_single
from bumblebee.primitives.cp.zigzag import CPShards
from bumblebee.registry import register


def _supports_reduce_scatter(group) -> bool:
    return emulation.nccl_branch(group)


class GatherSequence(torch.autograd.Function):
    """[B, K, Tl, D] zigzag shards -> [B, K, T, D] in global order, on every rank."""

    @staticmethod
    def forward(ctx, x_BKLD, layout: CPShards):
        ctx.layout = layout
        x_BKLD = x_BKLD.contiguous()  # and so are the outputs (empty_like keeps a view's strides)
        parts = [torch.empty_like(x_BKLD) for _ in range(layout.size)]
        dist.all_gather(parts, x_BKLD, group=layout.group)
        out = x_BKLD.new_empty(x_BKLD.shape[:2] + (layout.seq_len,) + x_BKLD.shape[3:])
        for r, p in enumerate(parts):
            out[:, :, layout.rank_index(r)] = p
        return out

    @staticmethod
    def backward(ctx, grad_BKTD):
        L = ctx.layout
        per_rank = torch.stack(
            [grad_BKTD[:, :, L.rank_index(r)] for r in range(L.size)]
        ).contiguous()
        if _supports_reduce_scatter(L.group):
            mine = torch.empty_like(per_rank[0])
            # the ranks' parts one after another along dim 0: the input shape gloo checks
            # against the output's ([C x B, ...] for [B, ...]); NCCL reads the same bytes
            reduce_scatter_single(mine, per_rank.flatten(0, 1), group=L.group)
        else:
            dist.all_reduce(per_rank, group=L.group)
            mine = per_rank[L.rank]
        return mine, None


@register(
    "cp_attention",
    "allgather",
    reference=True,
    summary="all-gather K/V over the CP group, full mask",
)
def allgather_attention(
    q_BNLD, k_BKLD, v_BKLD, layout: CPShards, scale: float, *, window=0, sinks=None
):
    return attend_gathered(
        q_BNLD,
        GatherSequence.apply(k_BKLD, layout),
        GatherSequence.apply(v_BKLD, layout),
        layout,
        scale,
        window=window,
        sinks=sinks,
    )


def attend_gathered(
    q_BNLD, k_BKTD, v_BKTD, layout: CPShards, scale: float, *, window=0, sinks=None
):
    """Local queries (zigzag shards) against the whole row's keys / values in global order
    (``window`` / ``sinks``: attention/options.py)."""
    n = layout.chunk
    outs = []
    for part in range(2):  # the early chunk, then the late chunk
        idx_n = layout.index_L[part * n : (part + 1) * n]
        end = int(idx_n[-1]) + 1
        doc_q = layout.doc_BT[:, idx_n]  # [B, n]
        doc_k = layout.doc_BT[:, :end]  # [B, end]
        k_pos = torch.arange(end, device=idx_n.device)
        causal = (k_pos[None, :] <= idx_n[:, None]) & window_allows(idx_n, k_pos, window)
        mask = (doc_q[:, :, None] == doc_k[:, None, :]) & causal
        outs.append(
            explicit_attention(
                q_BNLD[:, :, part * n : (part + 1) * n],
                k_BKTD[:, :, :end],
                v_BKTD[:, :, :end],
                mask[:, None],
                scale,
                sinks,
            )
        )
    return torch.cat(outs, dim=2)
