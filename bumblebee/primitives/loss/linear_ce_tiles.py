"""The linear CE's tile loop on CUDA: fewer, larger tiles, each one compiled function.

The eager loop of ``linear_ce.py`` (the CPU reference) runs about ten small kernels per
[token_tile, vocab_tile] tile forward and twelve backward, each a full pass over an fp32 tile:
at 32K tokens and a 248K vocabulary, 496 tiles of 2048 x 8192, ~9,500 launches per micro-batch.
Here each tile is one ``torch.compile``d function (inductor: the logits GEMM, then one fused
kernel for the max / sum-exp / entropy / target pick and the online merge into the running
statistics; backward: the logits GEMM, one fused kernel for ``dz``, the two gradient GEMMs),
over tiles four times larger: 128 tiles of 4096 x 16384 at the running case. The fused kernels
keep their fp32 temporaries in registers, so a tile holds its bf16 logits and ``dz`` (2 x 128
MiB by construction; not measured on a GPU), within the planner's workspace of four fp32
2048 x 8192 tiles.

Same statistics as the eager loop, merged online per token tile instead of after the loop:
running max ``m``, ``s = sum exp(z - m)``, ``u = sum exp(z - m)(z - m)`` rebased to each new max,
the target logit picked in the label's tile. Backward forms ``dz`` whole in the tile,
``g (p - onehot) - e p (log p + entropy)``, casts it to the input dtype (as the eager loop),
accumulates ``dhidden`` over vocab tiles and each vocab tile's ``dW`` over token tiles in fp32.

Under the emulated-CUDA mode each tile runs eagerly inside a kernel region counted as the
compiled kernels (``kernel_region.py``); the accumulations outside the compiled functions are
eager ops and count as such.

Legend: T tokens, H hidden, V vocabulary (this rank's slice), t/v a tile of T/V.
"""

from __future__ import annotations

import torch

from bumblebee.primitives.fused import compiled_call

TILES = (4096, 16384)  # (token_tile, vocab_tile) of the compiled loop
# launches of one compiled tile (inductor): forward GEMM + fused statistics / merge (+ a spare
# for a split reduction); backward logits GEMM, fused dz, the dhidden and dW GEMMs
FWD = ("linear_ce fwd tile", 3)
BWD = ("linear_ce bwd tile", 4)
_FP32_MIN = torch.finfo(torch.float32).min


def fwd_tile(h_tH, w_vH, col_t, m_t, s_t, u_t, pick_t, temperature: float, entropy: bool):
    """The logits tile ``h w^T / temperature`` merged into the running (m, s, u, target logit) of
    its token tile; ``col_t``: the label's column in this vocab tile, -1 where it lies elsewhere."""
    z_tv = (h_tH @ w_vH.T).float()
    if temperature != 1.0:
        z_tv = z_tv / temperature
    new_m = torch.maximum(m_t, z_tv.amax(1))
    d_tv = z_tv - new_m[:, None]
    e_tv = torch.exp(d_tv)
    scale = torch.exp(m_t - new_m)
    s = s_t * scale + e_tv.sum(1)
    u = scale * (u_t + s_t * (m_t - new_m)) + (e_tv * d_tv).sum(1) if entropy else u_t
    hit = z_tv.gather(1, col_t.clamp(min=0)[:, None]).squeeze(1)
    return new_m, s, u, torch.where(col_t >= 0, hit, pick_t)


def bwd_tile(h_tH, w_vH, col_t, lse_t, gl_t, ge_t, ent_t, temperature: float, need: tuple):
    """(dz w [t, H], dz^T h [v, H]) in the input dtype (None where ``need`` says not wanted), with
    ``dz = gl (p - onehot) - ge p (log p + entropy)``; ``gl`` and ``ge`` carry 1/temperature."""
    logp_tv = (h_tH @ w_vH.T).float()
    if temperature != 1.0:
        logp_tv = logp_tv / temperature
    logp_tv = logp_tv - lse_t[:, None]
    p_tv = torch.exp(logp_tv)
    if ge_t is None:
        dz_tv = p_tv * gl_t[:, None]
    else:
        dz_tv = p_tv * (gl_t[:, None] - ge_t[:, None] * (logp_tv + ent_t[:, None]))
    cols = torch.arange(w_vH.shape[0], device=col_t.device)
    dz_tv = (dz_tv - torch.where(cols == col_t[:, None], gl_t[:, None], 0.0)).to(h_tH.dtype)
    return (dz_tv @ w_vH if need[0] else None, dz_tv.T @ h_tH if need[1] else None)


def _columns(local_T, V: int, vocab_tile: int) -> torch.Tensor:
    """[N, T]: each label's column in vocab tile n, -1 where it lies in another tile (or slice)."""
    v0_N = torch.arange(0, V, vocab_tile, device=local_T.device)
    idx_NT = local_T - v0_N[:, None]
    inside = (idx_NT >= 0) & (idx_NT < (V - v0_N).clamp(max=vocab_tile)[:, None])
    return torch.where(inside, idx_NT, -1)


def forward(hidden_TH, weight_VH, local_T, temperature, with_entropy, tiles):
    """(m, s, u or None, target logit) per token over this rank's vocabulary slice."""
    T, V = hidden_TH.shape[0], weight_VH.shape[0]
    token_tile, vocab_tile = tiles
    dev = hidden_TH.device
    col_NT = _columns(local_T, V, vocab_tile)
    stats = []
    for t0 in range(0, T, token_tile):
        h_tH = hidden_TH[t0 : t0 + token_tile]
        m = torch.full((h_tH.shape[0],), _FP32_MIN, dtype=torch.float32, device=dev)
        s, u, pick = (torch.zeros_like(m) for _ in "sup")
        for j, v0 in enumerate(range(0, V, vocab_tile)):
            w_vH, col = weight_VH[v0 : v0 + vocab_tile], col_NT[j, t0 : t0 + token_tile]
            args = (h_tH, w_vH, col, m, s, u, pick, temperature, with_entropy)
            m, s, u, pick = compiled_call(*FWD, fwd_tile, *args)
        stats.append(torch.stack([m, s, u, pick]))
    m_T, s_T, u_T, target_T = (
        torch.cat(stats, 1) if stats else torch.zeros(4, 0, dtype=torch.float32, device=dev)
    )
    return m_T, s_T, u_T if with_entropy else None, target_T


def backward(hidden_TH, weight_VH, local_T, lse_T, gl_T, ge_T, entropy_T, need, temperature, tiles):
    """(dhidden fp32 [T, H] or None, dW [V, H] or None) for ``need`` = (dhidden?, dW?); ``gl`` /
    ``ge``: the per-token loss and entropy gradients (``ge`` None: no entropy gradient),
    1/temperature folded in."""
    T, V = hidden_TH.shape[0], weight_VH.shape[0]
    token_tile, vocab_tile = tiles
    dev = hidden_TH.device
    col_NT = _columns(local_T, V, vocab_tile)
    gh_TH = torch.zeros(T, hidden_TH.shape[1], dtype=torch.float32, device=dev) if need[0] else None
    gw_VH = torch.empty_like(weight_VH) if need[1] else None
    for j, v0 in enumerate(range(0, V, vocab_tile)):
        w_vH = weight_VH[v0 : v0 + vocab_tile]
        acc_vH = None  # fp32 sum over token tiles of this vocab tile's dW
        for t0 in range(0, T, token_tile):
            t = slice(t0, t0 + token_tile)
            ge_t, ent_t = (None, None) if ge_T is None else (ge_T[t], entropy_T[t])
            args = (hidden_TH[t], w_vH, col_NT[j, t], lse_T[t], gl_T[t], ge_t, ent_t)
            dh_tH, dw_vH = compiled_call(*BWD, bwd_tile, *args, temperature, need)
            if need[0]:
                gh_TH[t].add_(dh_tH)  # (not +=: that copies the slice back onto itself)
            if need[1]:
                acc_vH = dw_vH.float() if acc_vH is None else acc_vH.add_(dw_vH)
        if need[1]:
            gw_VH[v0 : v0 + w_vH.shape[0]] = acc_vH
    return gh_TH, gw_VH


def launches(tokens: int, vocab: int, lowp: bool = True, tiles=TILES) -> tuple[int, int]:
    """(forward, backward) kernel launches of ``forward`` / ``backward`` above (both gradients) for
    ``tokens`` x ``vocab`` (this rank's slice): the compiled tiles and the eager glue between them
    (``tests/unit/test_linear_ce_tiles.py`` checks it against the launch counter); the planner
    prints it for the loss."""
    nt, nv = -(-tokens // tiles[0]), -(-vocab // tiles[1])
    cols = 9  # _columns
    fwd = cols + nt * (5 + FWD[1] * nv) + 1  # per token tile: 4 inits + stack; the final cat
    # per tile: the compiled tile, the dhidden add, the dW add (the first: a cast in bf16 only);
    # per vocab tile: the dW copy-out; the dhidden zeros
    bwd = cols + 1 + nv * (nt * (BWD[1] + 2) + 1 - (0 if lowp else 1))
    return fwd, bwd
