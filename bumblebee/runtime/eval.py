"""Held-out evaluation during training (``train.eval_every``): ``eval_loss`` on the source's
held-out global batches, at the memory of training.

Each held-out batch is split over ranks exactly like a training batch (this rank's
rows, then its context-parallel share of each row), run forward without gradients
through the same loss primitive, and the token-loss sums are all-reduced: the
result is the mean loss per held-out label, identical on any layout. Sources
without a held-out split return no batches and nothing is logged.

A task with answers (the synthetic key-value task: ``source.eval_queries()``, each
answer label tagged with its query) also logs ``eval_accuracy``, the exact match of
the answers: the fraction of queries whose every answer token is the model's argmax
(teacher forcing; for a greedy decoder this is the same number, since a wrong first
token fails the query either way), and ``eval_distance_min`` / ``eval_distance_max``,
the token distances from record to answer that the held-out set covers. Per-query
error counts are summed over the dp x cp ranks, so these figures are layout-free too.

Memory. No ``[tokens, vocab]`` buffer exists for any vocabulary: the LM head is applied
(``CausalLM.scores``, one head call as in training, so FSDP2 gathers the head around it)
to the hidden states of the scored positions only, gathered first; their loss goes through
the model's loss primitive (linear CE: vocabulary tiles), their argmax is carried through
the same vocabulary tiles (``tiled_argmax``). A 4,096-token row at a 248,320-token
vocabulary asked 4.07 GB of fp32 logits here before; now an answer row set [N, vocab tile].

Pipeline parallelism: the forward-only pass runs through the stages (``Pipeline.forward_only``),
the last stage applies the same head and returns per-token (loss, miss) [b, T, 2]; its sums
are all-reduced over every rank (other stages add zeros), so every rank logs the same figures.

Legend: B rows, T tokens, H hidden, V vocabulary, N scored tokens, Q queries.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from bumblebee.data import Batch
from bumblebee.data.packing import IGNORE
from bumblebee.primitives.cp.zigzag import shard_sequence
from bumblebee.primitives.loss.linear_ce import default_tiles


def tiled_argmax(h_NH, w_VH) -> torch.Tensor:
    """argmax_v (h w^T)[n, v] [N] without the [N, V] logits: one [token tile, vocab tile] fp32 tile at
    a time (linear CE's tiles), a running max per row. Strictly-greater updates keep the first index
    of a tied maximum, as ``argmax`` over the whole row does."""
    token_tile, vocab_tile = default_tiles(h_NH.device)
    out_N = torch.zeros(h_NH.shape[0], dtype=torch.long, device=h_NH.device)
    for t0 in range(0, h_NH.shape[0], token_tile):
        h_tH = h_NH[t0 : t0 + token_tile]
        best_t = torch.full((h_tH.shape[0],), float("-inf"), device=h_NH.device)
        arg_t = out_N[t0 : t0 + token_tile]
        for v0 in range(0, w_VH.shape[0], vocab_tile):
            # GEMM in the compute dtype (under autocast: bf16, as F.linear gives the logits), compared in fp32
            m_t, i_t = (h_tH @ w_VH[v0 : v0 + vocab_tile].T).float().max(-1)
            better = m_t > best_t
            best_t = torch.where(better, m_t, best_t)
            arg_t.copy_(torch.where(better, i_t + v0, arg_t))
    return out_N


def answer_scores(h_TH, w_VH, labels_T, head_loss) -> torch.Tensor:
    """[T, 2] fp32: (-log p(label), 1 if the argmax is not the label) at scored positions (labels
    != -100), 0 elsewhere. The head sees the N scored rows only (``head_loss``: the model's loss
    primitive, per token)."""
    out_T2 = torch.zeros(labels_T.shape[0], 2, dtype=torch.float32, device=h_TH.device)
    idx_N = (labels_T != IGNORE).nonzero().squeeze(1)
    if idx_N.numel():
        h_NH, lab_N = h_TH[idx_N], labels_T[idx_N]
        out_T2[idx_N, 0] = head_loss(h_NH, w_VH, lab_N, reduction="none").float()
        out_T2[idx_N, 1] = (tiled_argmax(h_NH, w_VH) != lab_N).float()
    return out_T2


def answer_head(part, x, position_ids, labels_BT, stage):
    """``StageModule.head`` (and the pp = 1 call): per-token (loss, miss) [b, T, 2], balance loss, router stats."""
    out, aux, stats = part.scores(
        x,
        position_ids,
        answer_scores,
        labels_BT.reshape(-1),
        part.head_loss,
        stage=stage,
        return_stats=True,
    )
    return out.view(*labels_BT.shape, 2), aux, stats


def _local(trainer, *tensors_BT):
    """This rank's rows of held-out [B, T] tensors, then its zigzag share of each row."""
    lo, hi = trainer.dp_rank * trainer.rows_per_rank, (trainer.dp_rank + 1) * trainer.rows_per_rank
    out = [x[lo:hi] for x in tensors_BT]
    if trainer.cp > 1:
        out = [shard_sequence(x, trainer.cp, trainer.cp_rank) for x in out]
    return [x.to(trainer.device) for x in out]


def _forward(trainer, ids, labels, pos, head):
    """This rank's held-out rows forward, no gradient: ``head`` None gives each micro-batch's summed
    token loss [micro-batches], ``answer_head`` per-token (loss, miss) [B, T, 2]; with pp > 1 on the
    last stage only (None elsewhere)."""
    if trainer.pipeline is not None:
        return trainer.pipeline.forward_only(Batch(ids, labels, pos), head)
    model, mb, outs = trainer.model, trainer.cfg.train.micro_batch, []
    for i in range(0, ids.shape[0], mb):
        with trainer.autocast:
            if head is None:
                outs.append(
                    model.loss_terms(
                        ids[i : i + mb], labels[i : i + mb], pos[i : i + mb]
                    ).loss_sum.float()[None]
                )
            else:
                outs.append(
                    head(model, ids[i : i + mb], pos[i : i + mb], labels[i : i + mb], None)[0]
                )
    return torch.cat(outs)


def _all_reduce(trainer, x: torch.Tensor) -> torch.Tensor:
    """Sum over the ranks that score (dp x cp; with pp every rank, the stages before the last adding 0)."""
    if trainer.ctx.distributed:
        dist.all_reduce(x, group=None if trainer.pipeline is not None else trainer.ctx.dp_cp_group)
    return x


@contextlib.contextmanager
def _eval_mode(model):
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


@torch.no_grad()
def evaluate(trainer) -> dict:
    """{"eval_loss", "eval_tokens"} over the held-out batches (empty without a held-out split)."""
    if hasattr(trainer.source, "eval_queries"):
        return evaluate_answers(trainer, trainer.source.eval_queries())
    batches = trainer.source.eval_batch_list()
    if not batches:
        return {}
    loss_sum = torch.zeros((), device=trainer.device, dtype=torch.float32)
    with _eval_mode(trainer.model):
        for batch in batches:
            sums = _forward(
                trainer, *_local(trainer, batch.input_ids, batch.labels, batch.position_ids), None
            )
            for s in (
                [] if sums is None else sums
            ):  # one micro-batch at a time, as before (same rounding)
                loss_sum += s
    valid = sum(batch.num_valid for batch in batches)
    return {
        "eval_loss": float(_all_reduce(trainer, loss_sum)) / max(valid, 1),
        "eval_tokens": valid,
    }


@torch.no_grad()
def evaluate_answers(trainer, held_out) -> dict:
    """eval_loss and eval_accuracy (exact match per query) over ``EvalBatch``es; the head at the
    answer positions only (``answer_scores``)."""
    if not held_out:
        return {}
    device = trainer.device
    n_queries = [len(ev.distances) for ev in held_out]
    wrong_Q = torch.zeros(sum(n_queries), dtype=torch.float64, device=device)
    stats = torch.zeros(
        2, dtype=torch.float64, device=device
    )  # answer-token loss sum, answer tokens
    with _eval_mode(trainer.model):
        offset = 0
        for ev, n in zip(held_out, n_queries):
            b = ev.batch
            ids, labels, pos, qids = _local(
                trainer, b.input_ids, b.labels, b.position_ids, ev.query_ids
            )
            scores_BT2 = _forward(trainer, ids, labels, pos, answer_head)
            if scores_BT2 is not None:
                keep = labels != IGNORE
                scored_N2 = scores_BT2[keep].double()
                stats[0] += scored_N2[:, 0].sum()
                stats[1] += scored_N2.shape[0]
                wrong_Q.index_add_(0, qids[keep] + offset, scored_N2[:, 1])
            offset += n
    both = _all_reduce(trainer, torch.cat([wrong_Q, stats]))
    wrong_Q, stats = both[:-2], both[-2:]
    distances = [d for ev in held_out for d in ev.distances]
    return {
        "eval_loss": float(stats[0] / stats[1].clamp(min=1)),
        "eval_tokens": int(stats[1]),
        "eval_accuracy": float((wrong_Q == 0).double().mean()),
        "eval_distance_min": min(distances),
        "eval_distance_max": max(distances),
    }
