"""Causal attention over a shared-prefix ``TreeLayout``: each document's queries see the keys of
its parent chain (all of them: they precede it) and its own keys up to their position.

- CUDA, half precision: one ``varlen_attn`` call (``flash.py``'s kernel) with the chain's keys
  gathered back to back per document (``cu_seq_k`` differs from ``cu_seq_q``; the kernel's
  bottom-right causal alignment is exactly "the whole chain, then causal"). The gather copies
  each shared K/V once per branch, but no projection or MLP runs twice. Written from the
  kernel's documented contract; tested on CPU through ``reference_varlen_attn``.
- elsewhere: one SDPA call per document over [chain K/V ; own K/V] with that mask (a document
  without a parent: the plain causal call).

Legend: B batch, N query heads, K kv heads, T tokens, D head dim, S packed tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bumblebee.primitives import emulation
from bumblebee.primitives.attention.flash import cuda_varlen_attn
from bumblebee.primitives.dispatch import select
from bumblebee.primitives.prefix_tree import TreeLayout, gather_index


def tree_varlen(q_BNTD, k_BKTD, v_BKTD, layout: TreeLayout, scale: float, kernel=None):
    if (
        kernel is None
        and select("attention", "varlen", emulation.kind(q_BNTD), q_BNTD.dtype).name
        == "varlen_attn"
    ):
        kernel = cuda_varlen_attn()
    if kernel is not None:
        return gathered_varlen(q_BNTD, k_BKTD, v_BKTD, layout, scale, kernel)
    gqa = q_BNTD.shape[1] != k_BKTD.shape[1]
    rows = []
    for b, bounds in enumerate(layout.bounds):
        docs = []
        for d, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
            ranges = layout.key_ranges(b, d)
            k, v = (
                torch.cat([x[b : b + 1, :, r0:r1] for r0, r1 in ranges], 2)
                for x in (k_BKTD, v_BKTD)
            )
            Lq, Lk = e - s, k.shape[2]
            mask = None
            if Lk > Lq:  # bottom-right causal: query j sees the chain and its own keys <= j
                i_k, i_q = (torch.arange(n, device=q_BNTD.device) for n in (Lk, Lq))
                mask = i_k[None, :] <= i_q[:, None] + (Lk - Lq)
            docs.append(
                F.scaled_dot_product_attention(
                    q_BNTD[b : b + 1, :, s:e],
                    k,
                    v,
                    attn_mask=mask,
                    is_causal=mask is None,
                    scale=scale,
                    enable_gqa=gqa,
                )
            )
        rows.append(torch.cat(docs, dim=2))
    return torch.cat(rows, dim=0)


def gathered_varlen(q_BNTD, k_BKTD, v_BKTD, layout: TreeLayout, scale: float, kernel):
    """One varlen call: queries packed as they lie, keys gathered per document's chain."""
    B, N, T, D = q_BNTD.shape
    K = k_BKTD.shape[1]
    idx, cu_q, cu_k, max_q, max_k = gather_index(layout, q_BNTD.device)
    q_SND = q_BNTD.transpose(1, 2).reshape(B * T, N, D)
    k_SKD, v_SKD = (x.transpose(1, 2).reshape(B * T, K, D)[idx] for x in (k_BKTD, v_BKTD))
    o_SND = kernel(
        q_SND,
        k_SKD,
        v_SKD,
        cu_q,
        cu_k,
        max_q,
        max_k,
        scale=scale,
        window_size=(-1, 0),
        enable_gqa=N != K,
    )
    return o_SND.view(B, T, N, D).transpose(1, 2)
