"""Gated DeltaNet over a shared-prefix ``TreeLayout``: a branch continues its parent's state.

The recurrence's state after a document's last token (the delta-rule matrix and the conv's last
``kernel - 1`` pre-conv inputs) is exactly what a continuation needs, the contract the chunked
scan and the conv already keep for carried states (``gdn.GDNState``; context parallelism builds
on it too). So each document runs as one segment, parents before children, starting from its
parent's final state (zeros for a root); the projections, gate and output projection run once
over all tokens. A state that several branches read gets their gradients summed by autograd.

Legend: B batch, T tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bumblebee.primitives.packed import DocLayout
from bumblebee.primitives.prefix_tree import TreeLayout


def gated_delta_net_tree(layer, x_BTD: torch.Tensor, layout: TreeLayout) -> torch.Tensor:
    """``GatedDeltaNet`` forward (y [B, T, D]) on a tree layout, one segment per document."""
    qkv_pre_BTC, z_BTHV, beta_BTH, g_BTH = layer.project(x_BTD)
    rows = []
    for b, bounds in enumerate(layout.bounds):
        final, parts = {}, []  # document -> (conv window, recurrent state) after its last token
        for d, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
            parent = layout.parents[b][d]
            conv0, S0 = final[parent] if parent >= 0 else (None, None)
            one = DocLayout(((0, e - s),), e - s)
            qkv_BTC, conv_BPC = layer.conv1d(qkv_pre_BTC[b : b + 1, s:e], one, conv0, F.silu)
            q_BTGK, k_BTGK, v_BTHV = layer.split_heads(qkv_BTC, activated=True)
            o_BTHV, S_BHKV = layer.recompute.module(
                "linear_attn_core",
                layer.core,
                q_BTGK,
                k_BTGK,
                v_BTHV,
                g_BTH[b : b + 1, s:e],
                beta_BTH[b : b + 1, s:e],
                one,
                S0,
            )
            if d in layout.parents[b]:  # only parents' states are read again
                final[d] = (conv_BPC, S_BHKV)
            parts.append(o_BTHV)
        rows.append(torch.cat(parts, dim=1))
    return layer.finish(torch.cat(rows, dim=0), z_BTHV)
