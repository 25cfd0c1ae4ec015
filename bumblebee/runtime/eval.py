"""Held-out evaluation during training (``train.eval_every``): ``eval_loss`` on the source's
held-out global batches.

Each held-out batch is split over ranks exactly like a training batch (this rank's
rows, then its context-parallel share of each row), run forward without gradients
through the same loss primitive, and the token-loss sums are all-reduced: the
result is the mean loss per held-out label, identical on any layout. Sources
without a held-out split return no batches and nothing is logged. A source may
add task metrics by extending ``evaluate`` (e.g. answer accuracy of the synthetic
task).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from bumblebee.data import Batch
from bumblebee.primitives.cp.layout import shard_sequence


@torch.no_grad()
def evaluate(trainer) -> dict:
    """{"eval_loss", "eval_tokens"} over the held-out batches (empty without a held-out split)."""
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
