"""Causal attention cores for packed documents (slot ``attention``).

Both implementations compute, for every query token, softmax attention over the
keys of the *same document* at positions <= its own, with GQA (KV heads shared
by groups of query heads).

- ``sdpa`` (reference): one ``scaled_dot_product_attention`` call with a dense
  [B, 1, T, T] boolean mask (causal AND same-document). Obviously correct; the
  mask costs T^2 bytes per row.
- ``varlen``: on CUDA in bf16/fp16, PyTorch's flash ``varlen_attn`` over all
  documents at once (``flash.py``; the kernel choice, ``primitives/kernel_choice.py``,
  decides). Elsewhere one causal SDPA call per document (or one call for the batch
  when every row is a single document): no mask is built, so it can use the fused
  causal kernels and skips all cross-document blocks; a Python loop over documents
  is its cost.

Both take the generic options of ``options.py``: a sliding ``window`` and per-head ``sinks``
(``varlen`` on CUDA merges the sinks through the flash kernel's LSE, ``flash_sinks.py``;
elsewhere it writes each document's scores out in fp32 with the sink column).

A shared-prefix ``TreeLayout`` (``primitives/prefix_tree.py``) lets a document also see the
keys of its parent chain: ``sdpa`` widens the mask (sinks apply; a window would have to count
positions along the chain, refused), ``varlen`` runs each document over its chain's keys
(``attention/tree.py``; without window or sinks so far).

Legend: B batch, N query heads, K kv heads, T tokens, D head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bumblebee.primitives import emulation
from bumblebee.primitives.attention.flash import flash_varlen
from bumblebee.primitives.attention.flash_sinks import flash_varlen_sinks
from bumblebee.primitives.attention.options import explicit_attention, window_allows
from bumblebee.primitives.attention.tree import refuse_options, tree_varlen
from bumblebee.primitives.kernel_choice import Kernel, KernelQuery, select
from bumblebee.primitives.packed import DocLayout
from bumblebee.primitives.prefix_tree import TreeLayout
from bumblebee.registry import register


@register("attention", "sdpa", reference=True, summary="dense causal+document mask, one SDPA call")
def sdpa_masked(q_BNTD, k_BKTD, v_BKTD, layout: DocLayout, scale: float, *, window=0, sinks=None):
    T = q_BNTD.shape[2]
    doc_BT = layout.doc_ids(q_BNTD.device)
    if isinstance(layout, TreeLayout):  # a document also sees its parent chain
        refuse_options(window, None)
        vis_BDD = layout.visible(q_BNTD.device)
        rows = torch.arange(doc_BT.shape[0], device=q_BNTD.device)[:, None, None]
        same_doc = vis_BDD[rows, doc_BT[:, :, None], doc_BT[:, None, :]]
    else:
        same_doc = doc_BT[:, :, None] == doc_BT[:, None, :]
    pos = torch.arange(T, device=q_BNTD.device)
    causal = torch.ones(T, T, dtype=torch.bool, device=q_BNTD.device).tril()
    mask = (same_doc & (causal & window_allows(pos, pos, window)))[:, None]
    return explicit_attention(q_BNTD, k_BKTD, v_BKTD, mask, scale, sinks)


def varlen_kernel(q: KernelQuery) -> Kernel:
    """Flash ``varlen_attn`` on CUDA in half precision (sinks merged through its LSE), else SDPA
    per document (fp32 scores per document with sinks)."""
    if q.sinks:
        if q.cuda and q.half:
            label = f"varlen_attn + sink merge through the LSE (flash, {q.flash()})"
            return Kernel("varlen_attn_sinks", label, True)
        return Kernel(
            "sink_per_doc",
            "fp32 scores per document (attention sinks)",
            False,
            "flash kernels take bf16/fp16 only" if q.cuda else "",
        )
    if q.cuda and q.half:
        return Kernel("varlen_attn", f"varlen_attn (flash, {q.flash()})", True)
    return Kernel(
        "sdpa_per_doc",
        "SDPA per document",
        q.cuda,
        "flash kernels take bf16/fp16 only" if q.cuda else "",
    )


@register(
    "attention",
    "varlen",
    summary="packed documents, no mask: varlen_attn (CUDA, half) or SDPA per document",
    kernel=varlen_kernel,
    kernel_axes=("fa3", "sinks"),
)
def sdpa_varlen(q_BNTD, k_BKTD, v_BKTD, layout: DocLayout, scale: float, *, window=0, sinks=None):
    if isinstance(layout, TreeLayout):
        refuse_options(window, sinks)
        return tree_varlen(q_BNTD, k_BKTD, v_BKTD, layout, scale)
    kernel = select(
        "attention", "varlen", emulation.kind(q_BNTD), q_BNTD.dtype, sinks=sinks is not None
    )
    if kernel.name == "varlen_attn":
        return flash_varlen(q_BNTD, k_BKTD, v_BKTD, layout, scale, window=window)
    if kernel.name == "varlen_attn_sinks":
        return flash_varlen_sinks(q_BNTD, k_BKTD, v_BKTD, layout, scale, sinks, window=window)
    gqa = q_BNTD.shape[1] != k_BKTD.shape[1]
    plain = not window and sinks is None
    if layout.single_doc and plain:
        return F.scaled_dot_product_attention(
            q_BNTD, k_BKTD, v_BKTD, is_causal=True, scale=scale, enable_gqa=gqa
        )
    rows = []
    for b, bounds in enumerate(layout.bounds):
        docs = []
        for s, e in zip(bounds[:-1], bounds[1:]):
            q, k, v = (x[b : b + 1, :, s:e] for x in (q_BNTD, k_BKTD, v_BKTD))
            if plain:
                docs.append(
                    F.scaled_dot_product_attention(
                        q, k, v, is_causal=True, scale=scale, enable_gqa=gqa
                    )
                )
                continue
            pos = torch.arange(e - s, device=q.device)
            band = (pos[None, :] <= pos[:, None]) & window_allows(pos, pos, window)
            docs.append(explicit_attention(q, k, v, band, scale, sinks))
        rows.append(torch.cat(docs, dim=2))
    return torch.cat(rows, dim=0)
