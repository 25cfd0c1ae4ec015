"""Generic attention options every attention core takes: a sliding window and per-head sinks.

- ``window`` (int, 0 = none): a query at position i sees keys j of its document with
  ``i - window < j <= i`` (``window`` keys, itself included: Hugging Face's ``sliding_window``,
  flash-attention's ``window_size=(window - 1, 0)``).
- ``sinks`` (fp32-able tensor [N] or None): one learnable logit per query head that joins the
  softmax denominator and carries no value (Xiao et al. 2023, "Efficient Streaming Language
  Models with Attention Sinks", in the learnable form gpt-oss trains):
  ``p_j = exp(s_j) / (exp(sink) + sum_k exp(s_k))``. It is a row-wise rescale of plain
  attention, ``o = o_plain * exp(lse - logaddexp(lse, sink))``, which is how the ring merges it.

``explicit_attention`` is the reference for both: fp32 scores, the mask written out, the sink as
an extra score column dropped after the softmax (O(q x k) memory: tests and CPU fallbacks).

Legend: B batch, N query heads, K kv heads, Q queries, S keys, D head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def window_allows(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """[Q, S] bool: key position within ``window`` of the query position (True everywhere at 0)."""
    if not window:
        return torch.ones(q_pos.shape[0], k_pos.shape[0], dtype=torch.bool, device=q_pos.device)
    return (q_pos[:, None] - k_pos[None, :]) < window


def explicit_attention(q_BNQD, k_BKSD, v_BKSD, mask, scale: float, sinks=None):
    """softmax(q k^T scale [+ sink column]) v under boolean ``mask`` (broadcast to [B, N, Q, S]);
    SDPA when there is no sink (the same maths), else fp32 scores written out. A row that sees
    no key gets zeros (plus, with a sink, nothing: its weight all goes to the sink)."""
    G = q_BNQD.shape[1] // k_BKSD.shape[1]
    if sinks is None:
        return F.scaled_dot_product_attention(
            q_BNQD, k_BKSD, v_BKSD, attn_mask=mask, scale=scale, enable_gqa=G > 1
        )
    dt = torch.promote_types(q_BNQD.dtype, torch.float32)  # fp32 scores at least
    k = k_BKSD.to(dt).repeat_interleave(G, 1)
    v = v_BKSD.to(dt).repeat_interleave(G, 1)
    s = torch.matmul(q_BNQD.to(dt), k.transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    B, N, Q, _ = s.shape
    sink = sinks.to(dt).view(1, N, 1, 1).expand(B, N, Q, 1)
    p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(p, v).to(q_BNQD.dtype)


def merge_sinks(o, lse, sinks_heads):
    """Fold per-head sink logits into a finished (o, lse) pair: returns (o', lse') with
    ``lse' = logaddexp(lse, sink)`` and ``o' = o exp(lse - lse')``. ``sinks_heads`` broadcasts
    against ``lse`` (heads on the right axis)."""
    new = torch.logaddexp(lse, sinks_heads)
    return o * torch.exp(lse - new)[..., None], new


def sink_grad(sinks_heads, lse, delta):
    """Gradient of the sink logits from a backward's fp32 (lse', Delta = rowsum(dO o')) of the same
    shape: the sink column's dS = P_sink (0 - Delta), summed over everything but the head axes
    of ``sinks_heads`` (its size-1 axes)."""
    g = -(torch.exp(sinks_heads - lse) * delta)
    dims = tuple(i for i, n in enumerate(sinks_heads.shape) if n == 1 and g.shape[i] != 1)
    return g.sum(dims, keepdim=True)
