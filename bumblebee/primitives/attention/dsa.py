"""DeepSeek Sparse Attention (DSA; DeepSeek-V3.2-Exp report): the attention core on MLA latents.

A lightning indexer scores every allowed key s for query t with a few small ReLU heads,

    I[t, s] = sum_h w[t, h] relu(scale_i * qi[t, h] . ki[s])       (w already times Hi^-0.5)

and the main attention of query t runs only over the ``topk`` keys of highest I (among the
keys it may see: causal, same document). The main attention is MLA in its absorbed
("MQA") form: one latent key per token, ``lat = [c_kv | RoPE(k_rope)]`` [C + R], shared by
all heads, against absorbed queries ``q_abs_n = [q_nope_n W_uk_n | RoPE(q_rope_n)]``; the
output is the latent mix ``o_lat_n = sum_s p_ns c_kv_s`` [C] (the caller applies W_uv).
Scores equal the expanded form's q_n . k_n, so this is MLA exactly, up to rounding.

Indexer loss: KL(p_main || softmax(I)) per query over the keys the main attention saw, where
p_main is the main attention's distribution summed over heads and renormalized, detached:
the indexer learns to predict where the main attention looks; its own gradient never reaches
the main model (its inputs are detached by the caller). ``dense = True`` is the dense
warm-up stage: every allowed key is attended (the indexer does not select) and the KL runs
over all of them.

Two implementations of the same maths:

- ``dsa_reference``: dense masked computation over [Tq, S] (tests; HF's eager semantics,
  ``torch.topk`` over the full masked row);
- ``dsa_blockwise``: query blocks of ``block`` rows; each block scores keys up to its last
  query's position only, takes its top-k, *gathers* the selected latents and attends to them;
  every block runs under activation checkpointing, so what the backward keeps is the inputs
  and the block outputs. Nothing [Tq, S] is ever materialized: the transient is
  ``block x S`` indexer scores (``selection_scores`` sums the heads one at a time) and
  ``block x topk x (C + R)`` gathered latents.

``select_keys`` + ``attend_selected`` split a block into its selection and its attention, for
context parallelism (``dsa_cp.py``: select over the global row, fetch, then attend).

Queries may be a subset of the keys (context parallelism: local zigzag shards against the
whole row), given by their global positions ``qpos`` and document ids.

Legend: B batch, Tq queries, S keys, N heads, Hi indexer heads, Di indexer dim, C kv latent,
R rope dims, K = min(topk, S) selected keys.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


def _up(x):
    """At least fp32 (scores and probabilities of half-precision inputs)."""
    return x.float() if x.element_size() < 4 else x


def index_scores(qi_BTHD, ki_BSD, w_BTH, scale: float):
    """Indexer scores [B, Tq, S] (at least fp32)."""
    s = torch.einsum("bthd,bsd->bths", _up(qi_BTHD), _up(ki_BSD)) * scale
    return torch.einsum("bth,bths->bts", _up(w_BTH), torch.relu(s))


def selection_scores(qi_BQHD, ki_BSD, w_BQH, scale: float):
    """``index_scores`` without gradient, one indexer head at a time: the transient is two
    [B, Q, S] fp32 buffers (the running sum and one head's products), never [B, Q, Hi, S]
    (4 GiB at 128 queries x 64 heads x 128K keys; this is 128 MiB: skills/models/dsa.md)."""
    k = _up(ki_BSD).transpose(1, 2)
    acc = None
    for h in range(qi_BQHD.shape[2]):
        s = torch.matmul(_up(qi_BQHD[:, :, h]), k).mul_(scale).relu_()
        s.mul_(_up(w_BQH[:, :, h, None]))
        acc = s if acc is None else acc.add_(s)
        del s  # before the next head's product: two [B, Q, S] buffers at a time, not three
    return acc


class IndexScores(torch.autograd.Function):
    """``index_scores`` with gradient, one indexer head at a time both ways (the dense warm-up
    stage trains the indexer over every allowed key): forward is ``selection_scores``; backward
    recomputes each head's products from the saved inputs. Transient: a few [B, Q, S] fp32
    buffers, never [B, Q, Hi, S]."""

    @staticmethod
    def forward(ctx, qi_BQHD, ki_BSD, w_BQH, scale: float):
        ctx.save_for_backward(qi_BQHD, ki_BSD, w_BQH)
        ctx.scale = scale
        return selection_scores(qi_BQHD, ki_BSD, w_BQH, scale)

    @staticmethod
    def backward(ctx, g_BQS):
        qi, ki, w = ctx.saved_tensors
        k, g = _up(ki), _up(g_BQS)
        gq = torch.empty(qi.shape, dtype=k.dtype, device=k.device)
        gk, gw = torch.zeros_like(k), torch.empty(w.shape, dtype=k.dtype, device=k.device)
        for h in range(qi.shape[2]):
            q = _up(qi[:, :, h])
            r = torch.matmul(q, k.transpose(1, 2)).mul_(ctx.scale).relu_()  # this head's products
            gw[:, :, h] = torch.matmul(g[:, :, None, :], r[..., None])[..., 0, 0]
            # d relu(s) = g x w_h where s > 0; d s = that x scale
            ds = torch.where(r > 0, g, 0.0).mul_(_up(w[:, :, h, None]) * ctx.scale)
            del r
            gq[:, :, h] = torch.matmul(ds, k)
            gk.baddbmm_(ds.transpose(1, 2), q)
            del ds
        return gq.to(qi.dtype), gk.to(ki.dtype), gw.to(w.dtype), None


def allowed(qpos_T, doc_q_BT, doc_k_BS, end: int):
    """[B, Tq, end]: key s visible to query t (causal, same document)."""
    kpos = torch.arange(end, device=qpos_T.device)
    causal = kpos[None, :] <= qpos_T[:, None]
    return causal[None] & (doc_q_BT[:, :, None] == doc_k_BS[:, None, :end])


def select_top(scores, k: int):
    """Indices [..., k] of the k highest scores per row. Exact ties happen at 0 (every ReLU head
    dead); they go to the earliest key: a zero becomes -(position + 1) x 1e-30, below every
    positive score and above every negative one of magnitude > 1e-23, so the choice does not
    depend on the row's width (query block, CP shard) as ``torch.topk``'s order among ties does."""
    pos = torch.arange(1, scores.shape[-1] + 1, device=scores.device, dtype=scores.dtype)
    keyed = torch.where(scores == 0, pos * -1e-30, scores)
    return keyed.topk(k, dim=-1).indices


def _attend(q_abs, lat_sel, valid, scale, C):
    """Main attention over given keys. lat_sel [B, Tq, K, C+R] or [B, K, C+R] (shared keys)."""
    eq = "bqnc,bqkc->bqnk" if lat_sel.dim() == 4 else "bqnc,bkc->bqnk"
    s = _up(torch.einsum(eq, q_abs, lat_sel)) * scale
    s = s.masked_fill(~valid[:, :, None], float("-inf"))
    p = torch.softmax(s, dim=-1)
    eo = "bqnk,bqkc->bqnc" if lat_sel.dim() == 4 else "bqnk,bkc->bqnc"
    return torch.einsum(eo, p.to(lat_sel.dtype), lat_sel[..., :C]), p


def _attend_dense(q_abs, lat_BSF, ok_BQS, scale, C):
    """``_attend`` over shared keys, one head at a time: (o_lat [B, Q, N, C], the heads' mean
    distribution [B, Q, S], detached). Without gradient (the warm-up stage: the main attention is
    frozen) the transient is a few [B, Q, S] buffers, not [B, Q, N, S]; with it autograd keeps
    each head's probabilities, as ``_attend``."""
    B, Q, N = q_abs.shape[:3]
    o, acc = lat_BSF.new_empty(B, Q, N, C), None  # filled head by head: no list + stack copy
    for n in range(N):
        s = _up(torch.matmul(q_abs[:, :, n], lat_BSF.transpose(1, 2))) * scale
        p = torch.softmax(s.masked_fill(~ok_BQS, float("-inf")), dim=-1)
        del s
        o[:, :, n] = torch.matmul(p.to(lat_BSF.dtype), lat_BSF[..., :C])
        acc = p.detach().clone() if acc is None else acc.add_(p.detach())
        del p
    return o, acc / N


def _kl(p_BQNK, i_BQK, valid):
    """Sum over queries of KL(mean-over-heads main distribution || softmax(indexer scores))."""
    return _kl_to(p_BQNK.detach().mean(dim=2), i_BQK, valid)


def _kl_to(target, i_BQK, valid):
    """``_kl`` given the target distribution [B, Q, K] (the heads' mean)."""
    log_q = torch.log_softmax(i_BQK.masked_fill(~valid, float("-inf")), dim=-1)
    t = torch.where(valid, target, 0.0)
    log_t = torch.where(t > 0, t, 1.0).log()
    return (t * (log_t - torch.where(valid, log_q, 0.0))).sum()


def dsa_reference(
    q_abs, lat, qi, ki, w, qpos, doc_q, doc_k, *, topk, scale, index_scale, dense, C, block=0
):
    """(o_lat [B, Tq, N, C], summed indexer KL, selection mask [B, Tq, S]): dense masked form."""
    S = lat.shape[1]
    ok = allowed(qpos, doc_q, doc_k, S)
    scores = index_scores(qi, ki, w, index_scale).masked_fill(~ok, float("-inf"))
    if dense:
        sel = ok
    else:
        idx = select_top(scores, min(topk, S))
        sel = torch.zeros_like(ok).scatter(-1, idx, True) & ok
    o, p = _attend(q_abs, lat, sel, scale, C)
    return o, _kl(p, scores, sel), sel


def _block(q_abs, lat, qi, ki, w, qpos, doc_q, doc_k, topk, scale, index_scale, dense, C):
    end = int(qpos[-1]) + 1  # causality: later keys are never seen by this block
    ok = allowed(qpos, doc_q, doc_k, end)
    if dense:  # every allowed key, heads one at a time (no [block, Hi, S] or [block, N, S])
        scores = IndexScores.apply(qi, ki[:, :end], w, index_scale)
        o, target = _attend_dense(q_abs, lat[:, :end], ok, scale, C)
        return o, _kl_to(target, scores, ok)
    with torch.no_grad():  # the selection: no gradient, so nothing [block, S] is kept for backward
        scores = selection_scores(qi, ki[:, :end], w, index_scale).masked_fill_(~ok, float("-inf"))
        indices = select_top(scores, min(topk, end))
        valid = ok.gather(-1, indices)
    B, Q, K = indices.shape
    flat = indices.reshape(B, Q * K, 1)
    lat_sel = lat.gather(1, flat.expand(-1, -1, lat.shape[-1])).view(B, Q, K, lat.shape[-1])
    ki_sel = ki.gather(1, flat.expand(-1, -1, ki.shape[-1])).view(B, Q, K, ki.shape[-1])
    return attend_selected(
        q_abs, lat_sel, ki_sel, qi, w, valid, scale=scale, index_scale=index_scale, C=C
    )


def dsa_blockwise(
    q_abs, lat, qi, ki, w, qpos, doc_q, doc_k, *, topk, scale, index_scale, dense, block, C
):
    """(o_lat [B, Tq, N, C], summed indexer KL): query blocks, gathered keys, no [Tq, S] tensor."""
    outs, kl = [], _up(q_abs.new_zeros(()))
    grad = torch.is_grad_enabled()
    for i in range(0, q_abs.shape[1], block):
        j = min(i + block, q_abs.shape[1])
        args = (q_abs[:, i:j], lat, qi[:, i:j], ki, w[:, i:j], qpos[i:j], doc_q[:, i:j], doc_k)
        rest = (topk, scale, index_scale, dense, C)
        if grad:
            o, k = checkpoint(_block, *args, *rest, use_reentrant=False)
        else:
            o, k = _block(*args, *rest)
        outs.append(o)
        kl = kl + k
    return torch.cat(outs, dim=1), kl


@torch.no_grad()
def select_keys(qi, ki, w, qpos, doc_q, doc_k, *, topk: int, index_scale: float, block: int):
    """Every query's top-k keys at once, by query blocks: global key positions [B, Tq, K]
    (K = min(topk, S)), -1 where a block sees fewer than K allowed keys. The same choice as
    ``_block``'s (same scores, same tie rule), made before the main attention so that the keys
    can be fetched (context parallelism: ``dsa_cp.py``)."""
    B, Tq = qi.shape[:2]
    K = min(topk, ki.shape[1])
    out = torch.full((B, Tq, K), -1, dtype=torch.long, device=qi.device)
    for i in range(0, Tq, block):
        j = min(i + block, Tq)
        end = int(qpos[j - 1]) + 1
        ok = allowed(qpos[i:j], doc_q[:, i:j], doc_k, end)
        scores = selection_scores(qi[:, i:j], ki[:, :end], w[:, i:j], index_scale)
        idx = select_top(scores.masked_fill_(~ok, float("-inf")), min(K, end))
        out[:, i:j, : idx.shape[-1]] = torch.where(ok.gather(-1, idx), idx, -1)
    return out


def attend_selected(q_abs, lat_sel, ki_sel, qi, w, valid, *, scale, index_scale, C):
    """(o_lat, summed KL) of queries against their selected keys, given gathered: latents
    [B, Q, K, C + R] and indexer keys [B, Q, K, Di] (what ``_block`` computes after its gather)."""
    o, p = _attend(q_abs, lat_sel, valid, scale, C)
    s = torch.einsum("bqhd,bqkd->bqhk", _up(qi), _up(ki_sel)) * index_scale
    i_sel = torch.einsum("bqh,bqhk->bqk", _up(w), torch.relu(s))
    return o, _kl(p, i_sel, valid)


class AddLoss(torch.autograd.Function):
    """``x`` unchanged; backward also differentiates ``loss`` (with gradient 1): an auxiliary
    objective whose parameters the main loss never reaches, without a second loss channel."""

    @staticmethod
    def forward(ctx, x, loss):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.ones((), dtype=torch.float32, device=grad.device)
