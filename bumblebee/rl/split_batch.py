"""The RL Engine's calls on one whole batch: every rank passes the same batch, its part is cut here
and the results are gathered back.

``compute_logprobs`` and ``train_step`` are thin wrappers over the engine-level surface
(``forward_backward`` + ``optimizer_step``): this dp rank's rows of the global batch -- padded
with empty rows to split evenly and with columns to 2 x cp chunks, exactly as the trainer
splits rows --, or with a token budget whole sequences spread over dp ranks by token count
(``microbatch.assign_to_ranks``); the results are gathered back to the global [B, T] on every rank.

A mixin of ``rl.engine.Engine``.
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist

from bumblebee.models.head import check_token_ids
from bumblebee.rl import microbatch as mbs
from bumblebee.rl.batch import RLBatch, gather_tokens, pad_batch
from bumblebee.rl.shared_prefix import check_tree_batch
from bumblebee.runtime.optim import check_lr


@dataclasses.dataclass
class LogProbs:
    logprobs: torch.Tensor  # [B, T] log p(token | its prefix), 0 where there is no prefix
    entropy: torch.Tensor | None = None  # [B, T] entropy of the distribution the token came from
    routing: torch.Tensor | None = (
        None  # [B, T, L, K] experts per token and MoE layer (return_routing)
    )


def _all_gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


class EngineSplitBatch:
    def _rank_part(self, batch: RLBatch, budget: int | None) -> tuple[RLBatch, object]:
        """This dp rank's part of a global batch, and how to put its results back: rows (padded
        to split evenly, and to 2 x cp chunks), or with a token budget whole sequences balanced
        over dp ranks by token count."""
        B, T = batch.input_ids.shape
        check_tree_batch(batch, budget=budget, cp=self.ctx.layout.cp, pp=1)
        if budget is None:
            cp = self.ctx.layout.cp
            rows, cols = -(-B // self._dp), T if cp == 1 else -(-T // (2 * cp)) * 2 * cp
            padded = pad_batch(batch, rows * self._dp, cols)
            return padded.select_rows(self.ctx.dp_rank * rows, (self.ctx.dp_rank + 1) * rows), None
        spans = mbs.spans(batch.position_ids, batch.seq_index)
        owner = mbs.assign_to_ranks([n for _, n in spans], self._dp)
        index = [
            torch.cat([torch.arange(spans[i][0], sum(spans[i])) for i in mine])
            if mine
            else torch.zeros(0, dtype=torch.long)
            for mine in owner
        ]
        mine = index[self.ctx.dp_rank]
        if not len(mine):  # no sequence for this rank: one padding token
            return RLBatch(
                torch.zeros(1, 1, dtype=torch.long),
                torch.zeros(1, 1, dtype=torch.long),
                torch.zeros(1, 1, dtype=torch.bool),
            ), index
        return gather_tokens(batch, mine), index

    def _gather_rows(self, t: torch.Tensor, B: int, T: int, index) -> torch.Tensor:
        """This rank's token-aligned results [b, t, ...] -> the global batch's [B, T, ...], on every rank."""
        if index is None:
            full = torch.cat(_all_gather(t, self.get_data_parallel_group())) if self._dp > 1 else t
            return full[:B, :T]
        extra = tuple(t.shape[2:])
        width = max(len(i) for i in index)
        row = torch.zeros(width, *extra, dtype=t.dtype, device=t.device)
        n = len(index[self.ctx.dp_rank])
        row[:n] = t.reshape(-1, *extra)[:n]
        rows = _all_gather(row, self.get_data_parallel_group()) if self._dp > 1 else [row]
        out = torch.zeros(B * T, *extra, dtype=t.dtype, device=t.device)
        for r, i in zip(rows, index):
            out[i.to(t.device)] = r[: len(i)]
        return out.view(B, T, *extra)

    @torch.no_grad()
    def compute_logprobs(
        self, batch: RLBatch, entropy: bool = False, return_routing: bool = False
    ) -> LogProbs:
        """Token-aligned log-probs (and entropies) of the global ``batch`` under the current
        policy, forward only; the full [B, T] result on every rank, on the batch's device.
        ``return_routing``: also the experts every token was routed to, [B, T, L, K] (L MoE
        layers in order), the layout a batch's ``routing`` takes for replay. A batch carrying
        ``routing`` is scored with those experts."""
        check_token_ids(
            batch.input_ids, self.arch.vocab_size, "batch.input_ids"
        )  # on every rank alike
        budget = self.max_tokens_per_micro_batch
        part, index = self._rank_part(batch, budget)
        out = self.forward_backward(
            part, None, forward_only=True, entropy=entropy, return_routing=return_routing
        )
        B, T = batch.input_ids.shape

        def gather(t):
            return (
                None if t is None else self._gather_rows(t, B, T, index).to(batch.input_ids.device)
            )

        return LogProbs(
            gather(out.logprobs), gather(out.entropy) if entropy else None, gather(out.routing)
        )

    def train_step(self, batch: RLBatch, loss_fn=None, *, lr: float | None = None) -> dict:
        """One optimizer step on the global ``batch``: ``forward_backward`` on this rank's part,
        then ``optimizer_step``. Metrics: ``loss`` (the batch's aggregated loss), ``grad_norm``
        (before clipping), ``lr``, ``tokens`` (trained tokens), and each loss metric as a mean
        over trained tokens (PolicyLoss: ``clip_frac``, ``dual_clip_frac``, ``kl``, ``entropy``,
        ``approx_kl_old``)."""
        start = time.perf_counter()
        check_lr(lr)  # before the forward and backward, not after them
        check_token_ids(
            batch.input_ids, self.arch.vocab_size, "batch.input_ids"
        )  # on every rank alike
        part, _ = self._rank_part(batch, self.max_tokens_per_micro_batch)
        out = self.forward_backward(part, loss_fn)
        opt = self.optimizer_step(lr=lr)
        metrics = {
            "step": self.step,
            "loss": out.loss,
            "grad_norm": opt["grad_norm"],
            "lr": opt["lr"],
            "tokens": out.tokens,
            **out.metrics,
        }
        metrics["step_time_s"] = time.perf_counter() - start
        return metrics
