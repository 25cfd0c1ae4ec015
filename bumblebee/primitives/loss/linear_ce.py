"""Fused linear cross-entropy (slot ``loss``, implementation ``linear_ce``).

Computes the same quantities as the ``ce`` reference -- per-token
``-log p(label)``, optionally the per-token entropy, from ``logits = hidden @
weight^T / temperature`` -- without ever materializing ``[tokens, vocab]``: the
logits exist one ``[token_tile, vocab_tile]`` tile at a time (REFERENCE.md:
65,536 x 124,160 fp32 logits are 32.55 GB, the tiles a few tens of MB).

Forward keeps three fp32 statistics per token, merged tile by tile as in the
online softmax (Milakov & Gimelshein 2018, "Online normalizer calculation for
softmax"): the running max ``m``, ``s = sum_j exp(z_j - m)`` and, for the
entropy, ``u = sum_j exp(z_j - m) (z_j - m)``; then ``lse = m + log s`` and
``entropy = log s - u / s`` (no cancellation of large logits). Without entropy a
tile contributes one fused ``logsumexp`` instead. Backward recomputes each
logits tile and applies, with ``p = softmax(z)``, ``g`` the incoming per-token
loss gradient and ``e`` the incoming entropy gradient,

    dL/dz_j = g (p_j - [j = label]) - e p_j (log p_j + entropy),

then accumulates ``dhidden += dz @ W_tile`` and ``dW_tile += dz^T @ h_tile``
in fp32 (GEMMs run in the input dtype, as in ``ce``). Reductions (mean/sum) are
ordinary autograd ops on the per-token output, so per-token losses and entropy
carry gradients (RL) and all reductions share one kernel.

Vocabulary parallel (``vocab_group``): each rank holds a contiguous row slice of
``weight`` (rank order, sizes may differ); labels are global ids. The max is
all-reduced (MAX), the rebased ``s``, ``u`` and target logit are all-reduced
(SUM); in backward each rank's partial ``dhidden`` is all-reduced (SUM) and
``dW`` stays local to its slice.

Legend: T tokens, H hidden, V vocabulary (this rank's slice), t/v a tile of T/V.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from bumblebee.primitives.loss.ce import check_loss_args, reduce_loss
from bumblebee.registry import register

# (token_tile, vocab_tile) defaults: a tile's fp32 temporaries stay ~16 MB on CPU
# (cache-friendly, GEMMs of 1024 x 4096 x H already run at full speed) and ~64 MB
# on GPU (fewer launches per tile); both are small next to a [T, V] fp32 tensor.
DEFAULT_TILES = {"cpu": (1024, 4096), "cuda": (2048, 8192)}
_FP32_MIN = torch.finfo(torch.float32).min  # "no logit seen yet": exp(_FP32_MIN - m) == 0


def default_tiles(device: torch.device) -> tuple[int, int]:
    return DEFAULT_TILES.get(device.type, DEFAULT_TILES["cuda"])


def _rebase(m_T, s_T, u_T, new_m_T):
    """Re-express (s, u) relative to a larger max ``new_m``."""
    scale_T = torch.exp(m_T - new_m_T)
    return s_T * scale_T, scale_T * (u_T + s_T * (m_T - new_m_T))


def _vocab_offset(v_local: int, group, device) -> tuple[int, int]:
    """(first global row of this rank's slice, global vocabulary size)."""
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, torch.tensor([v_local], dtype=torch.int64, device=device), group=group)
    sizes = [int(x) for x in sizes]
    return sum(sizes[:dist.get_rank(group)]), sum(sizes)


def _logits(h_tH, w_vH, temperature):
    """fp32 logits tile z = h w^T / temperature (GEMM in the input dtype, like ``ce``)."""
    z_tv = (h_tH @ w_vH.T).float()
    return z_tv.div_(temperature) if temperature != 1.0 else z_tv


class _LinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_TH, weight_VH, labels_T, valid_T, offset, temperature, with_entropy, group,
                token_tile, vocab_tile):
        T, V = hidden_TH.shape[0], weight_VH.shape[0]
        dev = hidden_TH.device
        local_T = torch.where(valid_T, labels_T - offset, -1)  # label's row in this slice, or out of range
        target_T = torch.zeros(T, dtype=torch.float32, device=dev)  # target logit (0 off this slice)
        m_T = torch.full((T,), _FP32_MIN, dtype=torch.float32, device=dev)
        s_T = torch.zeros(T, dtype=torch.float32, device=dev)
        u_T = torch.zeros(T, dtype=torch.float32, device=dev) if with_entropy else None
        lse_T = torch.full((T,), float("-inf"), dtype=torch.float32, device=dev)
        for v0 in range(0, V, vocab_tile):
            w_vH = weight_VH[v0:v0 + vocab_tile]
            nv = w_vH.shape[0]
            for t0 in range(0, T, token_tile):
                t = slice(t0, t0 + token_tile)
                z_tv = _logits(hidden_TH[t], w_vH, temperature)
                idx_t = local_T[t] - v0
                here_t = (idx_t >= 0) & (idx_t < nv)
                picked_t = z_tv.gather(1, idx_t.clamp(0, nv - 1)[:, None]).squeeze(1)
                target_T[t] += torch.where(here_t, picked_t, 0.0)
                if not with_entropy:  # one fused pass per tile
                    lse_T[t] = torch.logaddexp(lse_T[t], torch.logsumexp(z_tv, dim=1))
                    continue
                mt_t = z_tv.amax(dim=1)
                d_tv = z_tv.sub_(mt_t[:, None])  # z - tile max, in place
                e_tv = torch.exp(d_tv)
                st_t = e_tv.sum(dim=1)
                ut_t = torch.einsum("tv,tv->t", e_tv, d_tv)
                new_m_t = torch.maximum(m_T[t], mt_t)
                s_a, u_a = _rebase(m_T[t], s_T[t], u_T[t], new_m_t)
                s_b, u_b = _rebase(mt_t, st_t, ut_t, new_m_t)
                m_T[t], s_T[t], u_T[t] = new_m_t, s_a + s_b, u_a + u_b
        if not with_entropy:  # express as (m, s) so one code path combines ranks
            m_T = torch.where(torch.isfinite(lse_T), lse_T, _FP32_MIN)
            s_T = torch.isfinite(lse_T).float()
        if group is not None and dist.get_world_size(group) > 1:
            global_m_T = m_T.clone()
            dist.all_reduce(global_m_T, op=dist.ReduceOp.MAX, group=group)
            s_T, u_T = _rebase(m_T, s_T, u_T if with_entropy else torch.zeros_like(s_T), global_m_T)
            stats_3T = torch.stack([s_T, u_T, target_T])
            dist.all_reduce(stats_3T, group=group)
            m_T, (s_T, u_T, target_T) = global_m_T, stats_3T.unbind(0)
        lse_T = m_T + torch.log(s_T)
        loss_T = torch.where(valid_T, lse_T - target_T, 0.0)
        entropy_T = torch.log(s_T) - u_T / s_T if with_entropy else None
        ctx.save_for_backward(hidden_TH, weight_VH, local_T, valid_T, lse_T, entropy_T if with_entropy else lse_T)
        ctx.cfg = (temperature, with_entropy, group, token_tile, vocab_tile)
        ctx.set_materialize_grads(False)
        return (loss_T, entropy_T) if with_entropy else loss_T

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss_T, grad_entropy_T=None):
        hidden_TH, weight_VH, local_T, valid_T, lse_T, entropy_T = ctx.saved_tensors
        temperature, with_entropy, group, token_tile, vocab_tile = ctx.cfg
        need_h, need_w = ctx.needs_input_grad[:2]
        if (grad_loss_T is None and grad_entropy_T is None) or not (need_h or need_w):
            return (None,) * 10
        T, V = hidden_TH.shape[0], weight_VH.shape[0]
        zeros_T = torch.zeros_like(lse_T)
        # fold 1/temperature (dz/dlogits) into the per-token coefficients
        gl_T = (grad_loss_T.float() if grad_loss_T is not None else zeros_T) * valid_T / temperature
        ge_T = grad_entropy_T.float() / temperature if grad_entropy_T is not None else None
        lowp = hidden_TH.dtype != torch.float32
        gh_TH = torch.zeros(T, hidden_TH.shape[1], dtype=torch.float32, device=hidden_TH.device) if need_h else None
        gw_VH = torch.empty_like(weight_VH) if need_w else None
        for v0 in range(0, V, vocab_tile):
            w_vH = weight_VH[v0:v0 + vocab_tile]
            nv = w_vH.shape[0]
            gw_vH = torch.zeros(w_vH.shape, dtype=torch.float32, device=w_vH.device) if need_w else None
            for t0 in range(0, T, token_tile):
                t = slice(t0, t0 + token_tile)
                h_tH = hidden_TH[t]
                logp_tv = _logits(h_tH, w_vH, temperature).sub_(lse_T[t, None])
                p_tv = torch.exp(logp_tv)
                if ge_T is None:
                    dz_tv = p_tv.mul_(gl_T[t, None])
                else:  # p * (g - e (log p + entropy))
                    coef_tv = logp_tv.add_(entropy_T[t, None]).mul_(-ge_T[t, None]).add_(gl_T[t, None])
                    dz_tv = p_tv.mul_(coef_tv)
                idx_t = local_T[t] - v0
                here_t = (idx_t >= 0) & (idx_t < nv)
                dz_tv.scatter_add_(1, idx_t.clamp(0, nv - 1)[:, None], -(gl_T[t] * here_t)[:, None])
                dz_tv = dz_tv.to(hidden_TH.dtype)
                if need_h:
                    if lowp:
                        gh_TH[t] += dz_tv @ w_vH
                    else:
                        gh_TH[t].addmm_(dz_tv, w_vH)
                if need_w:
                    if lowp:
                        gw_vH += dz_tv.T @ h_tH
                    else:
                        gw_vH.addmm_(dz_tv.T, h_tH)
            if need_w:
                gw_VH[v0:v0 + nv] = gw_vH
        if need_h and group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(gh_TH, group=group)  # every vocab slice contributes to dhidden
        gh_TH = gh_TH.to(hidden_TH.dtype) if need_h else None
        return (gh_TH, gw_VH) + (None,) * 8


@register("loss", "linear_ce", summary="tiled LM head + CE: online log-sum-exp, no [tokens, vocab] logits")
def linear_cross_entropy(hidden_TH, weight_VH, labels_T, *, ignore_index: int = -100, reduction: str = "mean",
                         with_entropy: bool = False, temperature: float = 1.0, vocab_group=None,
                         token_tile: int | None = None, vocab_tile: int | None = None):
    """Same contract as ``ce.cross_entropy``: the reduced loss, or (loss, entropy_T) with
    ``with_entropy``; ``reduction="none"`` gives -log p(label) per token (0 where ignored).
    ``vocab_group``: process group over which ``weight_VH`` rows are sharded in rank order."""
    check_loss_args(hidden_TH, weight_VH, labels_T, reduction, temperature)
    dev = hidden_TH.device
    if torch.is_autocast_enabled(dev.type):  # behave like F.linear under autocast (as ``ce`` does)
        dtype = torch.get_autocast_dtype(dev.type)
        hidden_TH, weight_VH = hidden_TH.to(dtype), weight_VH.to(dtype)
    if hidden_TH.dtype != weight_VH.dtype:
        raise ValueError(f"hidden ({hidden_TH.dtype}) and weight ({weight_VH.dtype}) must have the same dtype "
                         "(or run under autocast)")
    tiles = default_tiles(dev)
    token_tile = tiles[0] if token_tile is None else token_tile
    vocab_tile = tiles[1] if vocab_tile is None else vocab_tile
    if token_tile <= 0 or vocab_tile <= 0:
        raise ValueError(f"token_tile and vocab_tile must be positive, got {token_tile} and {vocab_tile}")
    valid_T = labels_T != ignore_index
    offset, v_total = (0, weight_VH.shape[0]) if vocab_group is None else \
        _vocab_offset(weight_VH.shape[0], vocab_group, dev)
    bad = valid_T & ((labels_T < 0) | (labels_T >= v_total))
    if bool(bad.any()):
        raise ValueError(f"labels must be in [0, {v_total}) or ignore_index={ignore_index}; "
                         f"got {labels_T[bad][:4].tolist()}")
    with torch.autocast(dev.type, enabled=False):
        out = _LinearCE.apply(hidden_TH, weight_VH, labels_T, valid_T, offset, float(temperature), with_entropy,
                              vocab_group, token_tile, vocab_tile)
    loss_T, entropy_T = out if with_entropy else (out, None)
    loss = reduce_loss(loss_T, valid_T, reduction)
    return (loss, entropy_T) if with_entropy else loss
