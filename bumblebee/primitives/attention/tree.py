"""Causal attention over a shared-prefix ``TreeLayout``: each document's queries see the keys of
its parent chain (all of them: they precede it) and its own keys up to their position.

- CUDA, half precision: one ``varlen_attn`` call (``flash.py``'s kernel) with the chain's keys
  gathered back to back per document (``cu_seq_k`` differs from ``cu_seq_q``; the kernel's
  bottom-right causal alignment is exactly "the whole chain, then causal"). The gather copies
  each shared K/V once per branch, but no projection or MLP runs twice. Written from the
  kernel's documented contract; tested on CPU through ``reference_varlen_attn``.
- elsewhere: one SDPA call per document over [chain K/V ; own K/V] with that mask (a document
  without a parent: the plain causal call), under ``lean`` (the mask and the K/V copy are not
  kept for backward: measured, they held most of a 16K-prefix step's peak).

Legend: B batch, N query heads, K kv heads, T tokens, D head dim, S packed tokens.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from bumblebee.primitives import emulation
from bumblebee.primitives.attention.flash import cuda_varlen_attn
from bumblebee.primitives.attention.varlen_api import gqa_keyword
from bumblebee.primitives.external_calls import VARLEN_ATTN
from bumblebee.primitives.kernel_choice import select
from bumblebee.primitives.prefix_tree import TreeLayout, gather_index
from bumblebee.primitives.recompute import lean


def refuse_options(window, sinks) -> None:
    """Sliding windows and sinks are not combined with tree layouts yet: a window would count
    positions along the parent chain, not columns of the row."""
    if window or sinks is not None:
        raise NotImplementedError(
            "attention on a shared-prefix (tree) layout supports neither a sliding window nor "
            "sinks yet"
        )


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
            q = q_BNTD[b : b + 1, :, s:e]
            if layout.parents[b][d] < 0:
                k, v = k_BKTD[b : b + 1, :, s:e], v_BKTD[b : b + 1, :, s:e]
                docs.append(
                    F.scaled_dot_product_attention(
                        q, k, v, is_causal=True, scale=scale, enable_gqa=gqa
                    )
                )
                continue
            # the chain's K/V copy and the [own, chain + own] mask (fp32 inside SDPA: 4 bytes per
            # query-key pair) are rebuilt in backward rather than kept per branch
            ranges = tuple(layout.key_ranges(b, d))
            branch = functools.partial(_branch, row=b, ranges=ranges, scale=scale, gqa=gqa)
            docs.append(lean(branch, q, k_BKTD, v_BKTD))
        rows.append(torch.cat(docs, dim=2))
    return torch.cat(rows, dim=0)


def _branch(q_1NLD, k_BKTD, v_BKTD, *, row: int, ranges, scale: float, gqa: bool):
    """A branch's queries over its chain's keys and its own, causal aligned to the bottom right."""
    k, v = (
        torch.cat([x[row : row + 1, :, r0:r1] for r0, r1 in ranges], 2) for x in (k_BKTD, v_BKTD)
    )
    Lq, Lk = q_1NLD.shape[2], k.shape[2]
    i_k, i_q = (torch.arange(n, device=q_1NLD.device) for n in (Lk, Lq))
    mask = i_k[None, :] <= i_q[:, None] + (Lk - Lq)
    return F.scaled_dot_product_attention(q_1NLD, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


def gathered_varlen(q_BNTD, k_BKTD, v_BKTD, layout: TreeLayout, scale: float, kernel):
    """One varlen call: queries packed as they lie, keys gathered per document's chain."""
    B, N, T, D = q_BNTD.shape
    K = k_BKTD.shape[1]
    idx, cu_q, cu_k, max_q, max_k = gather_index(layout, q_BNTD.device)
    q_SND = q_BNTD.transpose(1, 2).reshape(B * T, N, D)
    k_SKD, v_SKD = (x.transpose(1, 2).reshape(B * T, K, D)[idx] for x in (k_BKTD, v_BKTD))
    o_SND = VARLEN_ATTN.call(
        kernel,
        q_SND,
        k_SKD,
        v_SKD,
        cu_q,
        cu_k,
        max_q,
        max_k,
        scale=scale,
        window_size=(-1, 0),
        **gqa_keyword(N, K),
    )
    return o_SND.view(B, T, N, D).transpose(1, 2)
