"""Pipeline parallelism in the RL Engine: the runtime's stages and schedule (runtime/pipeline.py)
with a policy head on the last stage.

The runtime's ``Pipeline`` splits the decoder layers into stages, keeps this rank's and runs a
``torch.distributed.pipelining`` schedule over micro-batches. For RL the last stage does not
return a summed token loss: its head returns per-token ``(log p(target), entropy)`` [b, T, 2]
through the fused linear CE (``losses.token_logprobs``), and the schedule's loss is the
policy loss callback on those and the micro-batch's per-token inputs (trained mask,
aggregation weights, advantages, old / reference log-probs), packed as the schedule's
``target`` [b, T, k]. Each micro-batch's loss is already its share of the global loss
(weights from the global totals), so gradients are summed as at pp = 1.

Shapes. A stage infers its activation shapes once, so every schedule run has the same shape:
``micro_batch`` rows x ``train.seq_len`` tokens per micro-batch, ``pp_microbatches`` (default
pp) micro-batches per run. A rank's rows are padded to whole runs (empty rows), and every dp
rank makes as many runs (the maximum any needs). Rows longer than ``train.seq_len`` are an
error; a token budget is refused with pp > 1.

Outputs. The last stage's per-token results (and the loss metrics) are broadcast over the
pipeline group, so every rank returns the same log-probs and figures as at pp = 1.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from bumblebee import registry
from bumblebee.primitives.cp.zigzag import shard_sequence
from bumblebee.rl import microbatch as mbs
from bumblebee.rl.batch import LOSS_INPUTS
from bumblebee.rl.losses import PolicyInputs, token_logprobs
from bumblebee.runtime.pipeline import Pipeline
from bumblebee.runtime.step import add_stat


class EnginePipeline:
    def __init__(self, cfg, plan, ctx, model, device, autocast, temperature: float):
        self.cfg, self.plan, self.ctx = cfg, plan, ctx
        self.device, self.temperature = device, temperature
        self.pipe = Pipeline(
            cfg, plan, ctx, model, device, autocast
        )  # keeps this rank's stages of ``model``
        for m in self.pipe.modules:
            m.head = self._head
        self.schedule = registry.get("pipeline", cfg.primitives.pipeline).factory.build(
            self.pipe.stages, self.pipe.microbatches, self._loss
        )
        self.rows = self.pipe.microbatches * cfg.train.micro_batch  # rows per schedule run
        self.last_rank = dist.get_global_rank(
            ctx.pp_group, ctx.layout.pp - 1
        )  # holds the last stage (v = 1
        if (
            cfg.primitives.pp_virtual_stages > 1
        ):  # and with v stages per rank: stage S-1 on rank (S-1) mod pp)
            self.last_rank = dist.get_global_rank(
                ctx.pp_group, (ctx.layout.pp * cfg.primitives.pp_virtual_stages - 1) % ctx.layout.pp
            )
        self.is_last = dist.get_rank() == self.last_rank
        self.with_entropy, self.loss_fn, self.names, self.log = False, None, (), []

    def describe(self) -> str:
        return self.pipe.describe()

    # ------------------------------------------------------------------ the last stage
    def _head(self, part, x, position_ids, labels, stage):
        (logp_T, ent_T), aux, stats = part.scores(
            x,
            position_ids,
            token_logprobs,
            labels.reshape(-1),
            stage=stage,
            return_stats=True,
            temperature=self.temperature,
            with_entropy=self.with_entropy,
        )
        ent_T = torch.zeros_like(logp_T) if ent_T is None else ent_T
        return torch.stack([logp_T, ent_T], -1).view(*labels.shape, 2), aux, stats

    def _inputs(self, out_bT2, target_bTk) -> PolicyInputs:
        extra = iter(target_bTk[..., 2:].unbind(-1))
        return PolicyInputs(
            out_bT2[..., 0],
            out_bT2[..., 1] if self.with_entropy else None,
            target_bTk[..., 0] > 0,
            target_bTk[..., 1],
            *(next(extra) if k in self.names else None for k in LOSS_INPUTS),
        )

    def _loss(self, out_bT2, target_bTk):
        if self.loss_fn is None:  # forward only, nothing to score
            return out_bT2.sum() * 0.0
        loss, stats = self.loss_fn(self._inputs(out_bT2, target_bTk))
        self.log.append({"loss": loss.detach(), **{k: v.detach() for k, v in stats.items()}})
        return loss

    # ------------------------------------------------------------------ one call of forward_backward
    def run(
        self,
        P: dict,
        loss_fn,
        forward_only: bool,
        with_entropy: bool,
        dp_max,
        aux_coef: float,
        load=None,
    ):
        """All of this rank's rows through the schedule. Returns (metric sums or {}, kept) where kept
        holds (logp, entropy, index) per run as ``Engine._token_aligned`` reads them (forward only).
        ``load`` (runtime.step.ExpertLoad) receives each training run's expert counts of this rank's
        stages (padding rows included: they are routed like any token)."""
        t = self.cfg.train
        B, T = P["input_ids"].shape
        if T > t.seq_len:
            raise ValueError(
                f"rows of {T} tokens are longer than train.seq_len = {t.seq_len}, the row length "
                "of the pipeline's micro-batches (pp > 1)"
            )
        runs = max(int(dp_max(torch.tensor([-(-B // self.rows)]))), 1)
        for (
            m
        ) in self.pipe.modules:  # the balance loss is a mean over every micro-batch of the batch
            m.aux_scale = aux_coef / (runs * self.plan.balance_denominator)
        self.with_entropy, self.loss_fn, self.log = with_entropy, loss_fn, []
        self.names = tuple(k for k in LOSS_INPUTS if k in P)
        index = torch.arange(B * T).view(B, T)
        kept = []
        for r in range(runs):
            part = {k: v[r * self.rows : (r + 1) * self.rows] for k, v in P.items()}
            part["index"] = index[r * self.rows : (r + 1) * self.rows]
            part = (
                mbs.pad_columns(self._pad_rows(part), t.seq_len)
                if part["input_ids"].shape[1] < t.seq_len
                else self._pad_rows(part)
            )
            for m in self.pipe.modules:
                m.aux_log.clear()
                m.stats_log.clear()
            kept.append(self._run(part, forward_only))
            if (
                load is not None
            ):  # the run's micro-batches (the first run also logs a metadata forward)
                load.add(self.pipe.router_counts(self.pipe.microbatches, self.device)[0])
        sums = self._sums(loss_fn, kept)
        return sums, [k for k in kept if k is not None]

    def _pad_rows(self, part: dict) -> dict:
        n = part["input_ids"].shape[0]
        if n == self.rows:
            return part
        pad = mbs.empty_micro_batch(part, part["input_ids"].shape[1])
        return {k: torch.cat([v] + [pad[k]] * (self.rows - n)) for k, v in part.items()}

    def _run(self, part: dict, forward_only: bool):
        cp = self.ctx.layout.cp
        part = {k: v.to(self.device) for k, v in part.items()}
        if cp > 1:
            part = {k: shard_sequence(v, cp, self.ctx.cp_rank) for k, v in part.items()}
        fields = (
            [part["mask"].float(), part["weights"]]
            if "mask" in part
            else [torch.zeros_like(part["targets"], dtype=torch.float)] * 2
        )
        target = torch.stack(fields + [part[k].float() for k in self.names], -1)
        first = 0 in self.pipe.modules[0].part.stage_layers
        inputs = (part["input_ids"],) if first else ()
        kwargs = dict(target=target, position_ids=part["position_ids"], labels=part["targets"])
        if forward_only:
            with torch.no_grad():
                out = self.schedule.eval(*inputs, **kwargs)
        else:
            out = self.schedule.step(*inputs, **kwargs)
        if not forward_only:
            return None
        shape = (*part["targets"].shape, 2)
        out = out.detach().float() if self.is_last else torch.empty(shape, device=self.device)
        dist.broadcast(out, src=self.last_rank, group=self.ctx.pp_group)
        return out[..., 0], out[..., 1], part["index"]

    def _sums(self, loss_fn, kept) -> dict:
        """Loss metric sums over this rank's micro-batches, on every rank of the pipeline (the
        figures live on the last stage: its sums, 0 elsewhere, summed over the pipeline group)."""
        if loss_fn is None:
            return {}
        n = len(kept) * self.pipe.microbatches
        log = self.log[-n:] if self.is_last else []
        names = [sorted(log[0])] if self.is_last else [None]
        dist.broadcast_object_list(names, src=self.last_rank, group=self.ctx.pp_group)
        # zeros off the last stage: the pp sum is the last stage's figure (a "_max" figure is >= 0)
        sums = {k: torch.zeros((), device=self.device) for k in names[0]}
        for entry in log:
            for k, v in entry.items():
                add_stat(sums, k, v)
        total = torch.stack([sums[k] for k in names[0]])
        dist.all_reduce(total, group=self.ctx.pp_group)
        return dict(zip(names[0], total))
