"""Held-out evaluation during training (``train.eval_every``): ``eval_loss`` on the source's
held-out global batches.

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
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from bumblebee.data import Batch
from bumblebee.data.packing import IGNORE
from bumblebee.primitives.cp.layout import shard_sequence


@torch.no_grad()
def evaluate(trainer) -> dict:
    """{"eval_loss", "eval_tokens"} over the held-out batches (empty without a held-out split)."""
    if hasattr(trainer.source, "eval_queries"):
        return evaluate_answers(trainer, trainer.source.eval_queries())
    batches = trainer.source.eval_batch_list()
    if not batches:
        return {}
    model, mb_rows = trainer.model, trainer.cfg.train.micro_batch
    lo, hi = trainer.dp_rank * trainer.rows_per_rank, (trainer.dp_rank + 1) * trainer.rows_per_rank
    loss_sum = torch.zeros((), device=trainer.device, dtype=torch.float32)
    valid = 0
    was_training = model.training
    model.eval()
    try:
        for batch in batches:
            valid += batch.num_valid
            local = batch.rows(lo, hi)
            if trainer.cp > 1:
                local = Batch(*(shard_sequence(x, trainer.cp, trainer.cp_rank)
                                for x in (local.input_ids, local.labels, local.position_ids)))
            local = local.to(trainer.device)
            for i in range(0, local.input_ids.shape[0], mb_rows):
                mb = local.rows(i, i + mb_rows)
                with trainer.autocast:
                    terms = model.loss_terms(mb.input_ids, mb.labels, mb.position_ids)
                loss_sum += terms.loss_sum.float()
    finally:
        model.train(was_training)
    if trainer.ctx.distributed:
        dist.all_reduce(loss_sum, group=trainer.ctx.dp_cp_group)
    return {"eval_loss": float(loss_sum) / max(valid, 1), "eval_tokens": valid}


def _local(trainer, *tensors_BT):
    """This rank's rows of held-out [B, T] tensors, then its zigzag share of each row."""
    lo, hi = trainer.dp_rank * trainer.rows_per_rank, (trainer.dp_rank + 1) * trainer.rows_per_rank
    out = [x[lo:hi] for x in tensors_BT]
    if trainer.cp > 1:
        out = [shard_sequence(x, trainer.cp, trainer.cp_rank) for x in out]
    return [x.to(trainer.device) for x in out]


@torch.no_grad()
def evaluate_answers(trainer, held_out) -> dict:
    """eval_loss and eval_accuracy (exact match per query) over ``EvalBatch``es. Runs the model's
    logits forward: meant for small vocabularies (the byte-level synthetic task)."""
    if not held_out:
        return {}
    model, mb_rows, device = trainer.model, trainer.cfg.train.micro_batch, trainer.device
    n_queries = [len(ev.distances) for ev in held_out]
    wrong_Q = torch.zeros(sum(n_queries), dtype=torch.float64, device=device)
    stats = torch.zeros(2, dtype=torch.float64, device=device)  # answer-token loss sum, answer tokens
    was_training = model.training
    model.eval()
    try:
        offset = 0
        for ev, n in zip(held_out, n_queries):
            b = ev.batch
            ids, labels, pos, qids = _local(trainer, b.input_ids, b.labels, b.position_ids, ev.query_ids)
            for i in range(0, ids.shape[0], mb_rows):
                with trainer.autocast:
                    logits_BTV = model(ids[i:i + mb_rows], position_ids=pos[i:i + mb_rows])
                lab, q = labels[i:i + mb_rows], qids[i:i + mb_rows]
                keep = lab != IGNORE
                logits_NV, lab_N = logits_BTV[keep].float(), lab[keep]
                stats[0] += F.cross_entropy(logits_NV, lab_N, reduction="sum").double()
                stats[1] += lab_N.numel()
                wrong_Q.index_add_(0, q[keep] + offset, (logits_NV.argmax(-1) != lab_N).double())
            offset += n
    finally:
        model.train(was_training)
    if trainer.ctx.distributed:
        both = torch.cat([wrong_Q, stats])
        dist.all_reduce(both, group=trainer.ctx.dp_cp_group)
        wrong_Q, stats = both[:-2], both[-2:]
    distances = [d for ev in held_out for d in ev.distances]
    return {"eval_loss": float(stats[0] / stats[1].clamp(min=1)), "eval_tokens": int(stats[1]),
            "eval_accuracy": float((wrong_Q == 0).double().mean()),
            "eval_distance_min": min(distances), "eval_distance_max": max(distances)}
