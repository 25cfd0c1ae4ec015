"""The GDN CP scan's segment terms through FLA without the doubled value width.

The scan (``cp.py``) needs, per segment row, the zero-state results (o|0, S_out|0) and the
state map (e_t, M) of ``o = o|0 + S_in^T e`` and ``S_out = M S_in + S_out|0``. The CPU path gets
all four from one core call on values ``[v | 0_K]`` from the state ``[0 | I_K]``. Through FLA
that call needs an fp32 copy of v widened to V + K, an fp32 ``[0 | I_K]`` per row, a kernel of
width V + K and its widened output cast back to fp32. Here the two parts are two calls of the
same core instead:

- the values alone from zero state: o|0 and S_out|0 (width V, v as the conv left it, no copy);
- the probe: zero values of width K from the state I_K over each row's first document. Past a
  row's first document the extended call's K columns restart from zero and stay zero, so the
  probe rows are ``(0, f, p)``: the first document (f tokens), then the rest of the row as a
  document of its own, which starts from zero and yields e = 0 and, as the row's last document,
  M = 0. No masks, one kernel call (every document is a row's first or last).

p, the probe's length: all m tokens, or, when every row's first document ends early, one token
past the longest first document (so that every row still has a document start inside, hence
M = 0), if cutting the rows there keeps fewer bytes than the whole rows would (the cut inputs are
copies; ``probe_rows``). e and M then equal the extended call's: e over the first p tokens (zero
past them), M exactly.

Work against the extended call: V columns over m tokens plus K over p, not V + K over m; with one
document spanning each segment (p = m) the FLA work is the same (plus the key-side work done
twice), and what goes is the widening around the kernel. The constants (a zero, viewed as the
probe's values with stride 0; I_K) are built once per micro-batch, shared by every layer and pass.

Legend: R segment rows, m tokens per segment, p probe tokens, f a row's first document's
tokens, G key heads, H value heads, K key dim, V value dim.
"""

from __future__ import annotations

import torch

from bumblebee.primitives import emulation
from bumblebee.primitives.kernel_choice import select
from bumblebee.primitives.packed import DocLayout


def takes_probe(q_RMGK: torch.Tensor) -> bool:
    """Whether the scan's core runs through FLA (CUDA, or its emulation): the two-call form."""
    kernel = select("linear_attention", "chunked", emulation.kind(q_RMGK), q_RMGK.dtype)
    return kernel.name == "fla_chunk"


def probe_rows(rows: DocLayout, cut_bytes: int, full_bytes: int) -> DocLayout:
    """The probe's rows ``(0, f, p)`` (``(0, p)`` where the first document fills them). p = m
    unless every first document ends before m and the cut rows keep fewer bytes: ``cut_bytes``
    per probe token when cut (copied inputs and e) against ``full_bytes`` per token uncut (e)."""
    m, first = rows.seq_len, [b[1] for b in rows.bounds]
    p = max(first) + 1 if max(first) < m else m
    if p * cut_bytes >= m * full_bytes:
        p = m
    return DocLayout(tuple((0, f, p) if f < p else (0, p) for f in first), p)


def split_terms(layer, q_RMGK, k_RMGK, v_RMHV, g_RMH, beta_RMH, rows: DocLayout):
    """(o|0 [R, m, H, V], e [R, p, H, K], S_out|0 [R, H, K, V], M [R, H, K, K]) by two core calls
    (``layer.core`` under the layer's recompute policy, as the extended call)."""
    R, m, H, _ = v_RMHV.shape
    K, dev, dt = q_RMGK.shape[-1], q_RMGK.device, q_RMGK.dtype

    def core(*xs):
        return layer.recompute.module("linear_attn_core", layer.core, *xs)

    o0_RMHV, S0_RHKV = core(q_RMGK, k_RMGK, v_RMHV, g_RMH, beta_RMH, rows, None)
    # bytes kept per probe token: e (as the core returns it, in q's dtype: StateCorrection keeps
    # it), and when cut the copies of q, k and the gates
    e_bytes = H * K * q_RMGK.element_size()
    cut_bytes = e_bytes + 2 * q_RMGK[0, 0].numel() * q_RMGK.element_size()
    cut_bytes += g_RMH[0, 0].numel() * g_RMH.element_size() + H * beta_RMH.element_size()
    probe = rows.cached(
        ("gdn_cp_probe", cut_bytes, e_bytes), "host", lambda: probe_rows(rows, cut_bytes, e_bytes)
    )
    p = probe.seq_len
    zero = rows.cached(("gdn_cp_zero", dt), dev, lambda: torch.zeros((), dtype=dt, device=dev))
    # I_K per row: the FLA glue copies it into its states (its fp32 [R, H, K, K] lives with the
    # layer, as the values' states do, not with the micro-batch)
    eye_KK = rows.cached(("gdn_cp_eye", K), dev, lambda: torch.eye(K, device=dev))
    xs = (q_RMGK, k_RMGK, g_RMH, beta_RMH)
    q_RPGK, k_RPGK, g_RPH, beta_RPH = xs if p == m else (x[:, :p] for x in xs)
    e_RPHK, M_RHKK = core(
        q_RPGK, k_RPGK, zero.expand(R, p, H, K), g_RPH, beta_RPH, probe, eye_KK.expand(R, H, K, K)
    )
    return o0_RMHV, e_RPHK, S0_RHKV, M_RHKK
