"""The GDN CP scan's four segment terms on CUDA without the doubled value width.

The scan (``cp.py``) needs, per segment row, the zero-state results (o|0, S_out|0) and the
state map (e_t, M): ``o = o|0 + S_in^T e``, ``S_out = M S_in + S_out|0``. The CPU path gets
all four from one core call on values ``[v | 0_K]`` from the state ``[0 | I_K]`` (fp32, V + K
value columns). Through FLA that call is a kernel of width V + K fed an fp32 copy of v: the
input cast, the ``[v | 0]`` and ``[0 | I]`` concatenations and a fp32 [R, m, H, V + K] output.
Here the two parts run as two calls of the same core:

- the values alone, from zero: o|0 and S_out|0 (width V, v in its own dtype, no copy);
- the probe: zero values of width K from the state I_K, over the tokens of each row's *first
  document* only (its state map is zero past the first document start: e_t = 0 there and M = 0
  for a row with a document start inside). Rows are cut to the longest first document, m1
  tokens, and run as one document each (one kernel call, whatever the packing); e past a row's
  first document and M of a row with a document start inside are then set to zero (masks).

The work is V + K columns over m tokens when one document spans the segments (as before, in two
calls), V over m plus K over m1 with packed shorter documents. Only the FLA path takes it: the
CPU path keeps its one extended call (its loss traces stay bit for bit).

Legend: R segment rows, m tokens per segment, m1 probe tokens, G key heads, H value heads, K key
dim, V value dim.
"""

from __future__ import annotations

import torch

from bumblebee.primitives.packed import DocLayout, to_device


def _probe_rows(rows: DocLayout) -> DocLayout:
    """Each row as one document of m1 tokens, m1 = the longest first document: one kernel call
    (no edge / middle split); what lies past a row's first document is masked off after."""
    m1 = max(b[1] for b in rows.bounds)
    return DocLayout(tuple((0, m1) for _ in rows.bounds), m1)


def _masks(rows: DocLayout, dev):
    """(first-document tokens [R, m1], rows whose first document spans the segment [R]) as floats:
    e is zero past a row's first document start, M is zero for a row with one inside."""
    m, first = rows.seq_len, [b[1] for b in rows.bounds]
    m1 = max(first)
    e_RM = to_device([[float(t < f) for t in range(m1)] for f in first], dev, torch.float32)
    return e_RM, to_device([float(f == m) for f in first], dev, torch.float32)


def split_terms(layer, q_RMGK, k_RMGK, v_RMHV, g_RMH, beta_RMH, rows: DocLayout):
    """(o|0 [R, m, H, V], e [R, m1, H, K], S_out|0 [R, H, K, V] fp32, M [R, H, K, K] fp32) by two
    core calls (``layer.core`` under the layer's recompute policy, as the extended call)."""
    R, m, H = v_RMHV.shape[:3]
    K, dev = q_RMGK.shape[-1], q_RMGK.device
    core = lambda *xs: layer.recompute.module("linear_attn_core", layer.core, *xs)  # noqa: E731
    o0_RMHV, S0_RHKV = core(q_RMGK, k_RMGK, v_RMHV, g_RMH, beta_RMH, rows, None)
    probe = rows.cached("gdn_cp_probe", "host", lambda: _probe_rows(rows))
    m1 = probe.seq_len
    e_mask_RM, keep_R = rows.cached("gdn_cp_masks", dev, lambda: _masks(rows, dev))
    cut = lambda x: x[:, :m1]  # noqa: E731
    zeros_RMHK = q_RMGK.new_zeros(R, m1, H, K)  # the probe writes nothing
    eye_RHKK = torch.eye(K, dtype=torch.float32, device=dev).expand(R, H, K, K)
    e_RMHK, M_RHKK = core(
        cut(q_RMGK), cut(k_RMGK), zeros_RMHK, cut(g_RMH), cut(beta_RMH), probe, eye_RHKK
    )
    e_RMHK = e_RMHK * e_mask_RM[:, :, None, None].to(e_RMHK.dtype)
    return o0_RMHV, e_RMHK, S0_RHKV.float(), M_RHKK.float() * keep_R[:, None, None, None]
