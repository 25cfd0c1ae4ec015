"""The gated delta rule over packed documents (slot ``linear_attention``).

Gated DeltaNet (Yang, Kautz, Hatamizadeh, "Gated Delta Networks: Improving
Mamba2 with Delta Rule", ICLR 2025, eq. 10) keeps a matrix state S [K, V] per
value head. With decay a_t = exp(g_t) (g_t <= 0) and write strength b_t:

    S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T,      o_t = S_t^T q_t

q and k are L2-normalized (eps 1e-6 inside the rsqrt) and q is scaled by K^-1/2,
all in fp32, as HF's Qwen3.5-MoE does (FLA's ``use_qk_l2norm_in_kernel``).
With fewer key heads G than value heads H, key head j serves value heads
[j*H/G, (j+1)*H/G).

- ``recurrent`` (reference): the recurrence above, token by token.
- ``chunked``: on CUDA with flash-linear-attention installed, FLA's chunk kernel
  (``fla.py``; ``primitives/kernel_choice.py`` decides); elsewhere chunks of C = 64 tokens. Inside a
  chunk (Gamma_i = prod_{s<=i} a_s,
  all products restricted to one document) the updates collapse into the WY / UT
  form (Yang et al., "Parallelizing Linear Transformers with the Delta Rule over
  Sequence Length", NeurIPS 2024, §3.2; gated in Gated DeltaNet §3.3):

      (I + A) D = V_b - diag(b Gamma) K S_0,  A_ij = b_i k_i.k_j Gamma_i/Gamma_j  (j < i)
      => D = U - W S_0 with U = (I+A)^-1 V_b, W = (I+A)^-1 diag(b Gamma) K
      o_i   = Gamma_i q_i^T S_0 + sum_{j<=i} Gamma_i/Gamma_j (q_i.k_j) D_j
      S_C   = Gamma_C S_0 + sum_j Gamma_C/Gamma_j k_j D_j^T

  so one triangular solve and a few matmuls per chunk replace C sequential
  steps; only the S_0 -> S_C pass runs in a Python loop over T/C chunks.

Packed documents: the state restarts from zero at every document start, except
the first document of each row, which starts from ``initial_state`` (zeros if
None). The returned final state is the state after the row's last token (its
last document). Calling on x[:s] and then on x[s:] with that state equals one
call on x: the contract context parallelism builds on.

Both compute in fp32 (fp64 when v is fp64, for ground-truth runs) and return
(o [B, T, H, V] in v's dtype, final state [B, H, K, V] in the compute dtype).

Legend: B batch, T tokens, G key heads, H value heads, K key dim, V value dim,
N chunks, C chunk size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bumblebee.primitives import emulation
from bumblebee.primitives.kernel_choice import Kernel, KernelQuery, select
from bumblebee.primitives.linear_attention.fla import fla_gated_delta_rule
from bumblebee.primitives.linear_attention.fla_kda import fla_kda
from bumblebee.primitives.packed import DocLayout
from bumblebee.primitives.recompute import lean
from bumblebee.registry import register

CHUNK_SIZE = 64
# per-channel gates (KDA): the chunk keeps a [C, C, K] pairwise decay, so a smaller chunk bounds
# that transient (C x K x H fp32 per token: 256 KiB at 16 x 128 x 32)
CHANNEL_CHUNK_SIZE = 16


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (the FLA / HF convention)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def _prepare(q_BTGK, k_BTGK, v_BTHV, g_BTH, beta_BTH, layout: DocLayout, initial_BHKV):
    """Validate shapes; return fp32 tensors in [B, H, T, *] layout with q/k normalized and expanded to H."""
    if q_BTGK.dim() != 4 or q_BTGK.shape != k_BTGK.shape or v_BTHV.dim() != 4:
        raise ValueError(
            f"gated delta rule: need q, k [B, T, G, K] (equal) and v [B, T, H, V], got "
            f"{tuple(q_BTGK.shape)}, {tuple(k_BTGK.shape)}, {tuple(v_BTHV.shape)}"
        )
    B, T, G, K = q_BTGK.shape
    H, V = v_BTHV.shape[2:]
    if v_BTHV.shape[:2] != (B, T) or H % G:
        raise ValueError(
            f"gated delta rule: v {tuple(v_BTHV.shape)} must share [B, T] with q "
            f"{tuple(q_BTGK.shape)} and have a multiple of {G} heads"
        )
    if tuple(beta_BTH.shape) != (B, T, H) or tuple(g_BTH.shape) not in ((B, T, H), (B, T, H, K)):
        raise ValueError(
            f"gated delta rule: beta must be [B, T, H] = {(B, T, H)} and g [B, T, H] or "
            f"[B, T, H, K] (per channel), got {tuple(beta_BTH.shape)}, {tuple(g_BTH.shape)}"
        )
    if T == 0 or layout.seq_len != T or len(layout.bounds) != B:
        raise ValueError(
            f"gated delta rule: layout is for {len(layout.bounds)} rows x {layout.seq_len} tokens, "
            f"input has {B} x {T} (need T >= 1)"
        )
    if initial_BHKV is not None and tuple(initial_BHKV.shape) != (B, H, K, V):
        raise ValueError(
            f"gated delta rule: initial_state must be [B, H, K, V] = {(B, H, K, V)}, "
            f"got {tuple(initial_BHKV.shape)}"
        )
    dt = (
        torch.float64 if v_BTHV.dtype == torch.float64 else torch.float32
    )  # fp64 for ground-truth runs
    q = l2norm(q_BTGK.to(dt)) * K**-0.5
    k = l2norm(k_BTGK.to(dt))
    if H != G:
        q, k = q.repeat_interleave(H // G, dim=2), k.repeat_interleave(H // G, dim=2)
    q_BHTK, k_BHTK, v_BHTV, g_BHT, beta_BHT = (
        t.to(dt).transpose(1, 2) for t in (q, k, v_BTHV, g_BTH, beta_BTH)
    )
    S0 = q.new_zeros(B, H, K, V) if initial_BHKV is None else initial_BHKV.to(dt)
    return q_BHTK, k_BHTK, v_BHTV, g_BHT, beta_BHT, S0


@register(
    "linear_attention", "recurrent", reference=True, summary="gated delta rule token by token"
)
def gated_delta_rule_recurrent(
    q_BTGK, k_BTGK, v_BTHV, g_BTH, beta_BTH, layout: DocLayout, initial_state=None
):
    q, k, v, g, beta, S_BHKV = _prepare(
        q_BTGK, k_BTGK, v_BTHV, g_BTH, beta_BTH, layout, initial_state
    )
    doc_BT = layout.doc_ids(q.device)
    keep_BT = torch.ones(doc_BT.shape, dtype=q.dtype, device=q.device)
    keep_BT[:, 1:] = (doc_BT[:, 1:] == doc_BT[:, :-1]).to(q.dtype)  # 0 at a document start: reset
    gate_BHTk = g if g.dim() == 4 else g[..., None]  # k = K per channel (KDA), 1 per head (GDN)
    decay_BHTk = gate_BHTk.exp() * keep_BT[:, None, :, None]
    # unbind (not x[:, :, t]): its backward stacks the T slice gradients once, where per-step
    # indexing would scatter each into a fresh [B, H, T, *] zero tensor (O(T^2) backward)
    steps = zip(
        q.unbind(2),
        k.unbind(2),
        v.unbind(2),
        decay_BHTk[..., None].unbind(2),
        beta[..., None].unbind(2),
    )
    outs = []
    for q_BHK, k_BHK, v_BHV, decay_BHk1, beta_BH1 in steps:
        S_BHKV = S_BHKV * decay_BHk1  # rows of S (key channels) decay: all alike for GDN
        pred_BHV = (k_BHK.unsqueeze(-2) @ S_BHKV).squeeze(-2)  # what the state recalls for k_t
        delta_BHV = (v_BHV - pred_BHV) * beta_BH1
        S_BHKV = S_BHKV + k_BHK.unsqueeze(-1) * delta_BHV.unsqueeze(-2)
        outs.append((q_BHK.unsqueeze(-2) @ S_BHKV).squeeze(-2))
    o_BHTV = torch.stack(outs, dim=2)
    return o_BHTV.transpose(1, 2).to(v_BTHV.dtype), S_BHKV


def chunked_kernel(q: KernelQuery) -> Kernel:
    """FLA's chunk kernel on CUDA when fla imports (``chunk_kda`` for per-channel gates), else
    the PyTorch chunk loop."""
    if q.cuda and q.fla:
        return Kernel("fla_chunk", "fla chunk_gated_delta_rule", True)
    return Kernel(
        "torch_chunked",
        "chunked PyTorch (64-token chunks; 16 with per-channel gates)",
        False,
        "fla not installed (pip install -e '.[gpu]')" if q.cuda else "",
    )


@register(
    "linear_attention",
    "chunked",
    summary="WY/UT-transform chunks of 64, one loop step per chunk",
    kernel=chunked_kernel,
    kernel_axes=("fla",),
)
def gated_delta_rule_chunked(
    q_BTGK,
    k_BTGK,
    v_BTHV,
    g_BTH,
    beta_BTH,
    layout: DocLayout,
    initial_state=None,
    chunk_size: int | None = None,
):
    per_channel = g_BTH.dim() == 4  # KDA's [B, T, H, K] gate
    chunk_size = chunk_size or (CHANNEL_CHUNK_SIZE if per_channel else CHUNK_SIZE)
    if chunk_size <= 0:
        raise ValueError(f"gated delta rule: chunk_size must be positive, got {chunk_size}")
    if (
        select("linear_attention", "chunked", emulation.kind(q_BTGK), q_BTGK.dtype).name
        == "fla_chunk"
    ):
        fla = fla_kda if per_channel else fla_gated_delta_rule
        return fla(q_BTGK, k_BTGK, v_BTHV, g_BTH, beta_BTH, layout, initial_state)
    if per_channel:  # same contract; its chunk pairs keep a [C, C, K] decay (see _chunked_channel)
        return lean(
            lambda *xs: _chunked_channel(*xs, layout, chunk_size),
            q_BTGK,
            k_BTGK,
            v_BTHV,
            g_BTH,
            beta_BTH,
            initial_state,
        )
    # autograd keeps the inputs only; the per-chunk fp32 tensors (~400 KiB per token at Qwen3.5's
    # 32 x 128 x 128 heads) are rebuilt in backward, one extra core forward
    return lean(
        lambda *xs: _chunked(*xs, layout, chunk_size),
        q_BTGK,
        k_BTGK,
        v_BTHV,
        g_BTH,
        beta_BTH,
        initial_state,
    )


def _chunked(
    q_BTGK, k_BTGK, v_BTHV, g_BTH, beta_BTH, initial_state, layout: DocLayout, chunk_size: int
):
    q, k, v, g, beta, S_BHKV = _prepare(
        q_BTGK, k_BTGK, v_BTHV, g_BTH, beta_BTH, layout, initial_state
    )
    B, H, T, K = q.shape
    V, C = v.shape[-1], chunk_size
    pad = (-T) % C
    doc_BT = layout.doc_ids(q.device)
    if pad:  # zero tokens (g = 0, beta = 0, k = 0) in the last document leave the state unchanged
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
        doc_BT = torch.cat([doc_BT, doc_BT[:, -1:].expand(B, pad)], dim=1)
    N = (T + pad) // C
    q, k, v = (t.reshape(B, H, N, C, t.shape[-1]) for t in (q, k, v))
    g, beta = g.reshape(B, H, N, C), beta.reshape(B, H, N, C)

    # Document masks, shared by all heads: `same` pairs tokens of one document inside a chunk;
    # `cont` marks tokens of the document that was live before the chunk (its state S_0 reaches them).
    doc_B1NC = doc_BT.reshape(B, 1, N, C)
    prev_B1N = torch.cat([doc_B1NC.new_zeros(B, 1, 1), doc_B1NC[..., :-1, -1]], dim=-1)
    cont_B1NC = (doc_B1NC == prev_B1N[..., None]).to(q.dtype)
    same_B1NCC = doc_B1NC[..., :, None] == doc_B1NC[..., None, :]
    live_B1NCC = same_B1NCC & torch.ones(C, C, dtype=torch.bool, device=q.device).tril()

    # log Gamma inside the chunk, summed in fp64: fast-decaying heads reach |log Gamma| ~ 1e3, where
    # fp32 differences log Gamma_i - log Gamma_j lose ~1e-3 relative on the A_log / dt_bias gradients
    # (measured against fp64; the tiny decays are what d/dg sees). The differences are cast back at
    # once, so autograd stores nothing in fp64.
    cum64_BHNC = g.double().cumsum(-1)
    cum_BHNC = cum64_BHNC.to(q.dtype)
    decay_BHNCC = (cum64_BHNC[..., :, None] - cum64_BHNC[..., None, :]).to(q.dtype)
    decay_BHNCC = decay_BHNCC.masked_fill(~live_B1NCC, float("-inf")).exp()
    kb_BHNCK = k * beta[..., None]
    A_BHNCC = ((kb_BHNCK @ k.transpose(-1, -2)) * decay_BHNCC).tril(-1)
    gamma0_BHNC = cum_BHNC.exp() * cont_B1NC  # Gamma_i where S_0 reaches token i, else 0
    rhs = torch.cat([v * beta[..., None], kb_BHNCK * gamma0_BHNC[..., None]], dim=-1)
    UW = torch.linalg.solve_triangular(
        A_BHNCC, rhs, upper=False, unitriangular=True
    )  # (I + A)^-1 rhs
    U_BHNCV, W_BHNCK = UW.split([V, K], dim=-1)
    attn_BHNCC = (q @ k.transpose(-1, -2)) * decay_BHNCC
    q0_BHNCK = q * gamma0_BHNC[..., None]
    to_end_BHNC = (cum64_BHNC[..., -1:] - cum64_BHNC).to(q.dtype).exp() * same_B1NCC[
        ..., -1, :
    ]  # Gamma_C/Gamma_j
    kend_BHNCK = k * to_end_BHNC[..., None]
    chunk_decay_BHN = gamma0_BHNC[..., -1]

    # unbind (not indexing) per chunk: its backward stacks the N slice gradients once instead of
    # scattering each into a fresh full-size zero tensor (O(N^2) memory traffic)
    per_chunk = zip(
        U_BHNCV.unbind(2),
        W_BHNCK.unbind(2),
        q0_BHNCK.unbind(2),
        attn_BHNCC.unbind(2),
        kend_BHNCK.transpose(-1, -2).unbind(2),
        chunk_decay_BHN[..., None, None].unbind(2),
    )
    outs = []
    for (
        U_BHCV,
        W_BHCK,
        q0_BHCK,
        attn_BHCC,
        kendT_BHKC,
        decay_BH11,
    ) in per_chunk:  # the sequential part
        D_BHCV = U_BHCV - W_BHCK @ S_BHKV
        outs.append(q0_BHCK @ S_BHKV + attn_BHCC @ D_BHCV)
        S_BHKV = S_BHKV * decay_BH11 + kendT_BHKC @ D_BHCV
    o_BHTV = torch.stack(outs, dim=2).reshape(B, H, N * C, V)[:, :, :T]
    return o_BHTV.transpose(1, 2).to(v_BTHV.dtype), S_BHKV


def _chunked_channel(
    q_BTGK, k_BTGK, v_BTHV, g_BTHK, beta_BTH, initial_state, layout: DocLayout, chunk_size: int
):
    """``_chunked`` with a per-channel decay (KDA): Gamma_i is a [K] vector, so every Gamma_i/Gamma_j
    factor becomes a diag(.) between the key vectors, and the pair terms
    A_ij = b_i sum_c k_ic k_jc Gamma_ic/Gamma_jc (and q_i.k_j likewise) need the [C, C, K] decays,
    formed from log differences (never exp(-log Gamma): that overflows for fast channels)."""
    q, k, v, g, beta, S_BHKV = _prepare(
        q_BTGK, k_BTGK, v_BTHV, g_BTHK, beta_BTH, layout, initial_state
    )
    B, H, T, K = q.shape
    V, C = v.shape[-1], chunk_size
    pad = (-T) % C
    doc_BT = layout.doc_ids(q.device)
    if pad:  # zero tokens (g = 0, beta = 0, k = 0) in the last document leave the state unchanged
        q, k, v, g = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v, g))
        beta = F.pad(beta, (0, pad))
        doc_BT = torch.cat([doc_BT, doc_BT[:, -1:].expand(B, pad)], dim=1)
    N = (T + pad) // C
    q, k, v, g = (t.reshape(B, H, N, C, t.shape[-1]) for t in (q, k, v, g))
    beta = beta.reshape(B, H, N, C)

    doc_B1NC = doc_BT.reshape(B, 1, N, C)
    prev_B1N = torch.cat([doc_B1NC.new_zeros(B, 1, 1), doc_B1NC[..., :-1, -1]], dim=-1)
    cont_B1NC1 = (doc_B1NC == prev_B1N[..., None]).to(q.dtype)[..., None]
    same_B1NCC = doc_B1NC[..., :, None] == doc_B1NC[..., None, :]
    live_B1NCC1 = (same_B1NCC & torch.ones(C, C, dtype=torch.bool, device=q.device).tril())[
        ..., None
    ]
    cum64_BHNCK = g.double().cumsum(-2)  # fp64 sums, as in _chunked
    decay_BHNCCK = (cum64_BHNCK[..., :, None, :] - cum64_BHNCK[..., None, :, :]).to(q.dtype)
    decay_BHNCCK = decay_BHNCCK.masked_fill(~live_B1NCC1, float("-inf")).exp()
    kb_BHNCK = k * beta[..., None]
    A_BHNCC = (kb_BHNCK[..., :, None, :] * k[..., None, :, :] * decay_BHNCCK).sum(-1).tril(-1)
    attn_BHNCC = (q[..., :, None, :] * k[..., None, :, :] * decay_BHNCCK).sum(-1)
    gamma0_BHNCK = cum64_BHNCK.to(q.dtype).exp() * cont_B1NC1  # Gamma_i where S_0 reaches token i
    rhs = torch.cat([v * beta[..., None], kb_BHNCK * gamma0_BHNCK], dim=-1)
    UW = torch.linalg.solve_triangular(A_BHNCC, rhs, upper=False, unitriangular=True)
    U_BHNCV, W_BHNCK = UW.split([V, K], dim=-1)
    q0_BHNCK = q * gamma0_BHNCK
    to_end_BHNCK = (cum64_BHNCK[..., -1:, :] - cum64_BHNCK).to(q.dtype).exp()
    kend_BHNCK = k * to_end_BHNCK * same_B1NCC[..., -1, :, None]  # Gamma_C/Gamma_j, last document
    chunk_decay_BHNK1 = gamma0_BHNCK[..., -1, :, None]

    per_chunk = zip(
        U_BHNCV.unbind(2),
        W_BHNCK.unbind(2),
        q0_BHNCK.unbind(2),
        attn_BHNCC.unbind(2),
        kend_BHNCK.transpose(-1, -2).unbind(2),
        chunk_decay_BHNK1.unbind(2),
    )
    outs = []
    for U_BHCV, W_BHCK, q0_BHCK, attn_BHCC, kendT_BHKC, decay_BHK1 in per_chunk:
        D_BHCV = U_BHCV - W_BHCK @ S_BHKV
        outs.append(q0_BHCK @ S_BHKV + attn_BHCC @ D_BHCV)
        S_BHKV = S_BHKV * decay_BHK1 + kendT_BHKC @ D_BHCV
    o_BHTV = torch.stack(outs, dim=2).reshape(B, H, N * C, V)[:, :, :T]
    return o_BHTV.transpose(1, 2).to(v_BTHV.dtype), S_BHKV
