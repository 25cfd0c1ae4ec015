"""Fused linear cross-entropy (slot ``loss``, implementation ``linear_ce``).

Computes the same quantities as the ``ce`` reference -- per-token
``-log p(label)``, optionally the per-token entropy, from ``logits = hidden @
weight^T / temperature`` -- without ever materializing ``[tokens, vocab]``: the
logits exist one ``[token_tile, vocab_tile]`` tile at a time (
65,536 x 124,160 fp32 logits are 32.55 GB, the tiles a few tens of MB).

Forward keeps fp32 statistics per token and vocab tile -- the max ``m``,
``s = sum_j exp(z_j - m)`` and, for the entropy, ``u = sum_j exp(z_j - m)(z_j - m)``
(one fused ``log_softmax`` pass per tile gives ``log s`` at the arg-max) -- and
merges them after the loop as in the online softmax (Milakov & Gimelshein 2018,
"Online normalizer calculation for softmax"): ``lse = m + log s``, ``entropy =
log s - u / s`` (no cancellation of large logits). Backward recomputes each
logits tile and applies, with ``p = softmax(z)``, ``g`` the incoming per-token
loss gradient and ``e`` the incoming entropy gradient,

    dL/dz_j = g (p_j - [j = label]) - e p_j (log p_j + entropy),

then accumulates ``dhidden += dz @ W_tile`` (over vocab tiles, in an fp32 buffer)
and ``dW_tile += dz^T @ h_tile`` (over token tiles; in fp32 straight into the
gradient) -- GEMMs run in the input dtype, as in ``ce``. Without entropy ``g`` is
applied to the small ``[t, H]`` operands instead of the ``[t, v]`` tile, and in
fp32 ``- lse`` is folded into the logits GEMM, so a tile costs one GEMM and one
``exp`` more than ``ce``'s share. Reductions (mean/sum) are ordinary autograd
ops on the per-token output, so per-token losses and entropy carry gradients
(RL) and every reduction shares one kernel.

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

from bumblebee.primitives import emulation, kernel_choice
from bumblebee.primitives.loss import linear_ce_tiles
from bumblebee.primitives.loss.ce import check_loss_args, reduce_loss
from bumblebee.primitives.loss.costs import LossCosts
from bumblebee.registry import register

# (token_tile, vocab_tile) defaults: one fp32 [t, v] tile is 32 MB on CPU and 64 MB on GPU,
# a few of them live at once -- small next to [T, V] fp32 logits (5 GB at 8K x 152K) --
# and large enough that the per-tile fp32 accumulation of bf16 GEMM partials (dW over token
# tiles, dhidden over vocab tiles: ~H / (2 x tile) of the tile traffic) stays minor.
DEFAULT_TILES = {"cpu": (2048, 4096), "cuda": (2048, 8192)}
_FP32_MIN = torch.finfo(torch.float32).min  # "no logit seen yet": exp(_FP32_MIN - m) == 0


def default_tiles(device: torch.device) -> tuple[int, int]:
    kind = (
        kernel_choice.assumed_device() or device.type
    )  # the planner's dry run: the target's tiles
    return DEFAULT_TILES.get(kind, DEFAULT_TILES["cuda"])


def _vocab_offset(v_local: int, group, device) -> tuple[int, int]:
    """(first global row of this rank's slice, global vocabulary size)."""
    sizes = [
        torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size(group))
    ]
    dist.all_gather(sizes, torch.tensor([v_local], dtype=torch.int64, device=device), group=group)
    sizes = [int(x) for x in sizes]
    return sum(sizes[: dist.get_rank(group)]), sum(sizes)


def _logits(h_tH, w_vH, temperature):
    """fp32 logits tile z = h w^T / temperature (GEMM in the input dtype, like ``ce``)."""
    z_tv = (h_tH @ w_vH.T).float()
    return z_tv.div_(temperature) if temperature != 1.0 else z_tv


def _rebase(m_T, s_T, u_T, new_m_T):
    """Re-express (s, u) relative to a larger max ``new_m`` (any leading dims broadcast)."""
    scale = torch.exp(m_T - new_m_T)
    return s_T * scale, None if u_T is None else scale * (u_T + s_T * (m_T - new_m_T))


def _merge_tiles(m_NT, logs_NT, negh_NT):
    """Combine per-tile stats of N vocab tiles into one (m, s, u) per token.

    Per tile: max m, log s = log sum exp(z - m) and -H of the in-tile softmax q;
    then u = sum exp(z - m)(z - m) = s (log s - H)."""
    if m_NT.shape[0] == 0:  # empty vocabulary slice: contributes nothing
        zeros_T = torch.zeros(m_NT.shape[1], dtype=torch.float32, device=m_NT.device)
        return zeros_T + _FP32_MIN, zeros_T, None if negh_NT is None else zeros_T
    m_T = m_NT.amax(dim=0)
    s_NT = torch.exp(logs_NT)
    u_NT = None if negh_NT is None else s_NT * (logs_NT + negh_NT)
    s_NT, u_NT = _rebase(m_NT, s_NT, u_NT, m_T)
    return m_T, s_NT.sum(0), None if u_NT is None else u_NT.sum(0)


def _eager_stats(hidden_TH, weight_VH, local_T, temperature, with_entropy, token_tile, vocab_tile):
    """(m, s, u or None, target logit) per token: the eager tile loop (CPU; CUDA unfused)."""
    T, V = hidden_TH.shape[0], weight_VH.shape[0]
    N = -(-V // vocab_tile)  # vocab tiles
    on_slice_T = (local_T >= 0) & (local_T < V)
    tile_T = torch.where(on_slice_T, local_T // vocab_tile, 0)  # vocab tile holding the label
    col_T = torch.where(on_slice_T, local_T % vocab_tile, 0)  # its column in that tile
    # per (vocab tile, token) statistics; merged once after the loop (a few bytes per token and tile)
    m_NT, logs_NT, pick_NT = (
        torch.empty(N, T, dtype=torch.float32, device=hidden_TH.device) for _ in "123"
    )
    negh_NT = torch.empty_like(m_NT) if with_entropy else None
    for j, v0 in enumerate(range(0, V, vocab_tile)):
        w_vH = weight_VH[v0 : v0 + vocab_tile]
        col_t = col_T.clamp(max=w_vH.shape[0] - 1)[:, None]
        for t0 in range(0, T, token_tile):
            t = slice(t0, t0 + token_tile)
            z_tv = _logits(hidden_TH[t], w_vH, temperature)
            torch.gather(z_tv, 1, col_t[t], out=pick_NT[j, t, None])
            m_t, arg_t = z_tv.max(dim=1)
            m_NT[j, t] = m_t
            lsm_tv = torch.log_softmax(z_tv, dim=1)  # z - m - log s: one fused pass
            del z_tv
            torch.gather(lsm_tv, 1, arg_t[:, None], out=logs_NT[j, t, None])  # = -log s
            if with_entropy:  # -H of the in-tile softmax
                negh_NT[j, t] = torch.einsum("tv,tv->t", torch.exp(lsm_tv), lsm_tv)
    m_T, s_T, u_T = _merge_tiles(m_NT, logs_NT.neg_(), negh_NT)
    # target logit from the label's tile; 0 where the label is on another rank's slice
    target_T = (
        pick_NT.gather(0, tile_T[None]).squeeze(0) * on_slice_T if N else torch.zeros_like(m_T)
    )
    return m_T, s_T, u_T, target_T


class _LinearCE(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden_TH,
        weight_VH,
        labels_T,
        valid_T,
        offset,
        temperature,
        with_entropy,
        group,
        token_tile,
        vocab_tile,
        compiled,
    ):
        local_T = torch.where(
            valid_T, labels_T - offset, -1
        )  # label's row in this slice, or out of range
        if compiled:  # CUDA: fewer, larger tiles, each one compiled function (linear_ce_tiles.py)
            m_T, s_T, u_T, target_T = linear_ce_tiles.forward(
                hidden_TH, weight_VH, local_T, temperature, with_entropy, (token_tile, vocab_tile)
            )
        else:
            m_T, s_T, u_T, target_T = _eager_stats(
                hidden_TH, weight_VH, local_T, temperature, with_entropy, token_tile, vocab_tile
            )
        if group is not None and dist.get_world_size(group) > 1:
            global_m_T = m_T.clone()
            dist.all_reduce(global_m_T, op=dist.ReduceOp.MAX, group=group)
            s_T, u_T = _rebase(m_T, s_T, u_T, global_m_T)
            stats_KT = torch.stack([s_T, target_T] + ([u_T] if with_entropy else []))
            dist.all_reduce(stats_KT, group=group)
            m_T, s_T, target_T = global_m_T, stats_KT[0], stats_KT[1]
            u_T = stats_KT[2] if with_entropy else None
        lse_T = m_T + torch.log(s_T)
        loss_T = torch.where(valid_T, lse_T - target_T, 0.0)
        entropy_T = torch.log(s_T) - u_T / s_T if with_entropy else None
        ctx.save_for_backward(
            hidden_TH, weight_VH, local_T, valid_T, lse_T, entropy_T if with_entropy else lse_T
        )
        ctx.cfg = (temperature, with_entropy, group, token_tile, vocab_tile, compiled)
        ctx.set_materialize_grads(False)
        return (loss_T, entropy_T) if with_entropy else loss_T

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss_T, grad_entropy_T=None):
        hidden_TH, weight_VH, local_T, valid_T, lse_T, entropy_T = ctx.saved_tensors
        temperature, with_entropy, group, token_tile, vocab_tile, compiled = ctx.cfg
        need_h, need_w = ctx.needs_input_grad[:2]
        if (grad_loss_T is None and grad_entropy_T is None) or not (need_h or need_w):
            return (None,) * 11
        T, V = hidden_TH.shape[0], weight_VH.shape[0]
        dtype, lowp = hidden_TH.dtype, hidden_TH.dtype != torch.float32
        # dL/dz = gl (p - onehot) - ge p (log p + entropy); 1/temperature (dz/dlogits) folded in
        gl_T = (
            grad_loss_T.float() * valid_T if grad_loss_T is not None else torch.zeros_like(lse_T)
        ) / temperature
        ge_T = grad_entropy_T.float() / temperature if grad_entropy_T is not None else None
        if compiled:  # dz whole inside each compiled tile (linear_ce_tiles.py)
            gh_TH, gw_VH = linear_ce_tiles.backward(
                hidden_TH,
                weight_VH,
                local_T,
                lse_T,
                gl_T,
                ge_T,
                entropy_T if ge_T is not None else None,
                (need_h, need_w),
                temperature,
                (token_tile, vocab_tile),
            )
            return _finish_grads(gh_TH, gw_VH, None, group, dtype)
        if ge_T is None:  # dz = gl (p - onehot): keep gl out of the tile, scale [t, H] rows instead
            hs_TH = (hidden_TH * gl_T[:, None]).to(dtype) if need_w else None
            row_T, onehot_T = gl_T, torch.ones_like(gl_T)
        else:  # dz = p (c - ge log p) - gl onehot, c = gl - ge entropy
            row_T, hs_TH, onehot_T, c_T = None, hidden_TH, gl_T, gl_T - ge_T * entropy_T
        # dhidden accumulates over vocab tiles in fp32; dW over token tiles -- straight into the
        # output in fp32, through an fp32 buffer for bf16 partials only when there are several
        gh_TH = (
            torch.zeros(T, hidden_TH.shape[1], dtype=torch.float32, device=hidden_TH.device)
            if need_h
            else None
        )
        gw_VH = torch.empty_like(weight_VH) if need_w else None
        one_token_tile = T <= token_tile
        for v0 in range(0, V, vocab_tile):
            w_vH = weight_VH[v0 : v0 + vocab_tile]
            nv = w_vH.shape[0]
            idx_T = local_T - v0
            here_T = (idx_T >= 0) & (idx_T < nv)
            idx_T1, sub_T1 = idx_T.clamp(0, nv - 1)[:, None], (-onehot_T * here_T)[:, None]
            gw_vH = gw_VH[v0 : v0 + nv] if need_w else None
            acc_vH = None  # fp32 sum of bf16 dW partials
            for t0 in range(0, T, token_tile):
                t = slice(t0, t0 + token_tile)
                if lowp:
                    logp_tv = _logits(hidden_TH[t], w_vH, temperature).sub_(lse_T[t, None])
                else:  # fp32: subtract lse inside the GEMM
                    logp_tv = torch.addmm(
                        lse_T[t, None], hidden_TH[t], w_vH.T, beta=-1, alpha=1 / temperature
                    )
                if ge_T is None:
                    dz_tv = logp_tv.exp_()  # p; gl is applied to the [t, H] operands
                else:
                    coef_tv = torch.addcmul(c_T[t, None], logp_tv, ge_T[t, None], value=-1.0)
                    dz_tv = logp_tv.exp_().mul_(coef_tv)
                    del coef_tv
                dz_tv = dz_tv.scatter_add_(1, idx_T1[t], sub_T1[t]).to(dtype)  # the onehot term
                if need_h:
                    if lowp:
                        gh_TH[t] += dz_tv @ w_vH
                    else:
                        gh_TH[t].addmm_(dz_tv, w_vH)
                if need_w:
                    if not lowp and t0 > 0:
                        gw_vH.addmm_(dz_tv.T, hs_TH[t])
                    elif not lowp or one_token_tile:  # the GEMM writes the output rows directly
                        torch.mm(dz_tv.T, hs_TH[t], out=gw_vH)
                    elif acc_vH is None:
                        acc_vH = (dz_tv.T @ hs_TH[t]).float()
                    else:
                        acc_vH += dz_tv.T @ hs_TH[t]
            if acc_vH is not None:
                gw_vH.copy_(acc_vH)
        return _finish_grads(gh_TH, gw_VH, row_T, group, dtype)


def _finish_grads(gh_TH, gw_VH, row_T, group, dtype):
    """The backward's return: fp32 dhidden scaled per row (``row_T``), summed over the vocabulary
    slices, cast to the input dtype."""
    if gh_TH is not None:
        if row_T is not None:
            gh_TH *= row_T[:, None]
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(gh_TH, group=group)  # every vocab slice contributes to dhidden
        gh_TH = gh_TH.to(dtype)
    return (gh_TH, gw_VH) + (None,) * 9


# kept for backward per token: the int64 target, the valid flag, the fp32 log-sum-exp; while it
# runs: the bf16 head gradient, an fp32 dhidden accumulator + the bf16 hidden gradient, and
# about four fp32 [token_tile, vocab_tile] tiles of the CUDA defaults
COSTS = LossCosts(
    kept_per_token=8 + 1 + 4,
    kept_per_logit=0,
    work_per_logit=0,
    work_per_hidden=4 + 2,
    head_grad_per_weight=2,
    workspace=4 * DEFAULT_TILES["cuda"][0] * DEFAULT_TILES["cuda"][1] * 4,
    tiled_head=True,
    explain="{v:.0f} x {h} x 2 B (head gradient, bf16) + {t} x ({norm:.0f} + {h} x 6) B "
    "(final norm, fp32 dh, hidden grad) + 4 fp32 [2048, 8192] tiles",
    explain_eval="its fp32 tiles (no head gradient)",
)


def linear_ce_kernel(q: kernel_choice.KernelQuery) -> kernel_choice.Kernel:
    """The LM head + CE tile loop: compiled per tile on CUDA, eager tiles elsewhere."""
    if q.cuda and not q.unfused:
        label = "linear CE, torch.compile per 4096 x 16384 tile"
        return kernel_choice.Kernel("compiled_tiles", label, True)
    return kernel_choice.Kernel("eager_tiles", "linear CE, eager ops per tile", False)


@register(
    "loss",
    "linear_ce",
    summary="tiled LM head + CE: online log-sum-exp, no [tokens, vocab] logits",
    costs=COSTS,
    kernel=linear_ce_kernel,
)
def linear_cross_entropy(
    hidden_TH,
    weight_VH,
    labels_T,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    with_entropy: bool = False,
    temperature: float = 1.0,
    vocab_group=None,
    token_tile: int | None = None,
    vocab_tile: int | None = None,
):
    """Same contract as ``ce.cross_entropy``: the reduced loss, or (loss, entropy_T) with
    ``with_entropy``; ``reduction="none"`` gives -log p(label) per token (0 where ignored).
    ``vocab_group``: process group over which ``weight_VH`` rows are sharded in rank order."""
    check_loss_args(hidden_TH, weight_VH, labels_T, reduction, temperature)
    dev = hidden_TH.device
    if torch.is_autocast_enabled(dev.type):  # behave like F.linear under autocast (as ``ce`` does)
        dtype = torch.get_autocast_dtype(dev.type)
        hidden_TH, weight_VH = hidden_TH.to(dtype), weight_VH.to(dtype)
    if hidden_TH.dtype != weight_VH.dtype:
        raise ValueError(
            f"hidden ({hidden_TH.dtype}) and weight ({weight_VH.dtype}) must have the same dtype "
            "(or run under autocast)"
        )
    compiled = (
        kernel_choice.select("loss", "linear_ce", emulation.kind(hidden_TH), hidden_TH.dtype).name
        == "compiled_tiles"
    )
    tiles = linear_ce_tiles.TILES if compiled else default_tiles(dev)
    token_tile = tiles[0] if token_tile is None else token_tile
    vocab_tile = tiles[1] if vocab_tile is None else vocab_tile
    if token_tile <= 0 or vocab_tile <= 0:
        raise ValueError(
            f"token_tile and vocab_tile must be positive, got {token_tile} and {vocab_tile}"
        )
    labels_T = labels_T.long()
    valid_T = labels_T != ignore_index
    offset, v_total = (
        (0, weight_VH.shape[0])
        if vocab_group is None
        else _vocab_offset(weight_VH.shape[0], vocab_group, dev)
    )
    bad = valid_T & ((labels_T < 0) | (labels_T >= v_total))
    if emulation.kind(labels_T) == "cuda":  # checked on the device: no host read in the step
        torch._assert_async(
            ~bad.any(), f"labels must be in [0, {v_total}) or ignore_index={ignore_index}"
        )
    elif bool(bad.any()):
        raise ValueError(
            f"labels must be in [0, {v_total}) or ignore_index={ignore_index}; "
            f"got {labels_T[bad][:4].tolist()}"
        )
    with torch.autocast(dev.type, enabled=False):
        out = _LinearCE.apply(
            hidden_TH,
            weight_VH,
            labels_T,
            valid_T,
            offset,
            float(temperature),
            with_entropy,
            vocab_group,
            token_tile,
            vocab_tile,
            compiled,
        )
    loss_T, entropy_T = out if with_entropy else (out, None)
    loss = reduce_loss(loss_T, valid_T, reduction)
    return (loss, entropy_T) if with_entropy else loss
