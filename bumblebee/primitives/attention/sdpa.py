"""Causal attention cores for packed documents (slot ``attention``).

Both implementations compute, for every query token, softmax attention over the
keys of the *same document* at positions <= its own, with GQA (KV heads shared
by groups of query heads).

- ``sdpa`` (reference): one ``scaled_dot_product_attention`` call with a dense
  [B, 1, T, T] boolean mask (causal AND same-document). Obviously correct; the
  mask costs T^2 bytes per row.
- ``varlen``: on CUDA in bf16/fp16, PyTorch's flash ``varlen_attn`` over all
  documents at once (``flash.py``; the kernel dispatch, ``primitives/dispatch.py``,
  decides). Elsewhere one causal SDPA call per document (or one call for the batch
  when every row is a single document): no mask is built, so it can use the fused
  causal kernels and skips all cross-document blocks; a Python loop over documents
  is its cost.

A shared-prefix ``TreeLayout`` (``primitives/prefix_tree.py``) lets a document also see the
keys of its parent chain: ``sdpa`` widens the mask, ``varlen`` runs each document over its
chain's keys (``attention/tree.py``).

Legend: B batch, N query heads, K kv heads, T tokens, D head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bumblebee.primitives import emulation
from bumblebee.primitives.attention.flash import flash_varlen
from bumblebee.primitives.attention.tree import tree_varlen
from bumblebee.primitives.dispatch import select
from bumblebee.primitives.packed import DocLayout
from bumblebee.primitives.prefix_tree import TreeLayout
from bumblebee.registry import register


@register("attention", "sdpa", reference=True, summary="dense causal+document mask, one SDPA call")
def sdpa_masked(q_BNTD, k_BKTD, v_BKTD, layout: DocLayout, scale: float):
    T = q_BNTD.shape[2]
    doc_BT = layout.doc_ids(q_BNTD.device)
    if isinstance(layout, TreeLayout):  # a document also sees its parent chain
        vis_BDD = layout.visible(q_BNTD.device)
        rows = torch.arange(doc_BT.shape[0], device=q_BNTD.device)[:, None, None]
        same_doc = vis_BDD[rows, doc_BT[:, :, None], doc_BT[:, None, :]]
    else:
        same_doc = doc_BT[:, :, None] == doc_BT[:, None, :]
    causal = torch.ones(T, T, dtype=torch.bool, device=q_BNTD.device).tril()
    mask = (same_doc & causal)[:, None]
    return F.scaled_dot_product_attention(
        q_BNTD,
        k_BKTD,
        v_BKTD,
        attn_mask=mask,
        scale=scale,
        enable_gqa=q_BNTD.shape[1] != k_BKTD.shape[1],
    )


@register(
    "attention",
    "varlen",
    summary="packed documents, no mask: varlen_attn (CUDA, half) or SDPA per document",
)
def sdpa_varlen(q_BNTD, k_BKTD, v_BKTD, layout: DocLayout, scale: float):
    if isinstance(layout, TreeLayout):
        return tree_varlen(q_BNTD, k_BKTD, v_BKTD, layout, scale)
    if select("attention", "varlen", emulation.kind(q_BNTD), q_BNTD.dtype).name == "varlen_attn":
        return flash_varlen(q_BNTD, k_BKTD, v_BKTD, layout, scale)
    gqa = q_BNTD.shape[1] != k_BKTD.shape[1]
    if layout.single_doc:
        return F.scaled_dot_product_attention(
            q_BNTD, k_BKTD, v_BKTD, is_causal=True, scale=scale, enable_gqa=gqa
        )
    rows = []
    for b, bounds in enumerate(layout.bounds):
        docs = []
        for s, e in zip(bounds[:-1], bounds[1:]):
            docs.append(
                F.scaled_dot_product_attention(
                    q_BNTD[b : b + 1, :, s:e],
                    k_BKTD[b : b + 1, :, s:e],
                    v_BKTD[b : b + 1, :, s:e],
                    is_causal=True,
                    scale=scale,
                    enable_gqa=gqa,
                )
            )
        rows.append(torch.cat(docs, dim=2))
    return torch.cat(rows, dim=0)
