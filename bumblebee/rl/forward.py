"""The Engine's forward / backward over this rank's rows (``Engine.forward_backward``).

Rank-local batches: ``forward_backward`` trains on this dp rank's rows only (cp ranks of one
dp rank pass the same rows); the aggregation denominators (trained tokens, sequences) are
summed over the dp ranks first, so each micro-batch's loss is its exact share of the global
loss and the summed gradients -- the sharding primitives' convention -- are those of the
whole batch, whatever the layout. Micro-batches are ``train.micro_batch`` rows, or with
``max_tokens_per_micro_batch`` whole sequences repacked under a token budget
(``rl/microbatch.py``); every dp rank runs the same number of them. Log-probs never
materialize ``[tokens, vocab]`` (``losses.token_logprobs``).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist

from bumblebee.models.head import check_token_ids
from bumblebee.primitives.cp.zigzag import shard_sequence, unshard_sequence
from bumblebee.primitives.moe.replay import RoutingScope, check_routing
from bumblebee.primitives.packed import assume_documents
from bumblebee.primitives.prefix_tree import tree_layout
from bumblebee.primitives.replay_check import checking
from bumblebee.rl import microbatch as mbs
from bumblebee.rl.batch import (
    LOSS_INPUTS,
    RLBatch,
    has_prefix,
    prediction_view,
    sequence_ids,
    shift_right,
    trained_tokens,
)
from bumblebee.rl.losses import (
    PolicyInputs,
    PolicyLoss,
    aggregation_totals,
    call_loss,
    token_logprobs,
)
from bumblebee.rl.shared_prefix import check_tree_batch
from bumblebee.rl.split_batch import _all_gather
from bumblebee.runtime.step import accumulate, add_stat, balance_denominator


@dataclasses.dataclass
class ForwardOutput:
    """What ``forward_backward`` returns (every figure covers all dp ranks' tokens)."""

    loss: float | None  # the aggregated loss of the global batch (None without a loss_fn)
    tokens: int  # trained tokens of the global batch
    metrics: dict  # each loss metric as a mean over trained tokens
    logprobs: torch.Tensor | None = None  # [B, T] token-aligned, this rank's rows (forward_only)
    entropy: torch.Tensor | None = None
    routing: torch.Tensor | None = (
        None  # [B, T, L, K] experts per token and MoE layer (return_routing)
    )


class EngineForward:
    """``forward_backward`` and its micro-batching; the Engine holds the model, its parallel
    state (``ctx``), the sharding, the pipeline and the offloader."""

    def _micro_batches(
        self, P: dict[str, torch.Tensor], seq_index, budget: int | None
    ) -> list[dict]:
        """This rank's micro-batches, as many on every dp rank (``rl/microbatch.py``)."""
        if budget is None:
            parts = mbs.row_micro_batches(P, self.cfg.train.micro_batch)
            count = self._dp_sum(torch.tensor([len(parts)]), dist.ReduceOp.MAX).item()
            width = P["input_ids"].shape[1]
            return parts + [mbs.empty_micro_batch(P, width) for _ in range(count - len(parts))]
        spans = mbs.spans(P["position_ids"], seq_index)
        lengths = [n for _, n in spans]
        mbs.check_budget(lengths, budget)
        count = max(
            self._dp_sum(torch.tensor([mbs.ffd_bins(lengths, budget)]), dist.ReduceOp.MAX).item(), 1
        )
        return mbs.token_micro_batches(P, spans, mbs.token_bins(lengths, budget, count))

    def _cp_share(self, mb: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        cp = self.ctx.layout.cp
        mb = {k: v.to(self.device) for k, v in mb.items()}
        if cp == 1:
            return mb
        mb = mbs.pad_columns(mb, 2 * cp)
        return {k: shard_sequence(v, cp, self.ctx.cp_rank) for k, v in mb.items()}

    def _scores(self, mb: dict[str, torch.Tensor], with_entropy: bool, scope=None):
        """Forward one micro-batch: (logp [b, T], entropy [b, T] or None, balance loss, router stats).
        ``scope``: a ``RoutingScope`` replaying ``mb["routing"]`` and/or recording the experts used.
        A shared-prefix batch (``mb["attach"]``) runs on its tree layout (primitives/prefix_tree.py)."""
        tree = contextlib.nullcontext()
        if "attach" in mb:
            tree = assume_documents(lambda pos: tree_layout(pos, mb["attach"]))
        with self.autocast, tree:
            (logp_T, ent_T), aux, stats = self.model.scores(
                mb["input_ids"],
                mb["position_ids"],
                token_logprobs,
                mb["targets"].reshape(-1),
                routing=scope,
                return_stats=True,
                temperature=self.temperature,
                with_entropy=with_entropy,
            )
        shape = mb["targets"].shape
        return logp_T.view(shape), None if ent_T is None else ent_T.view(shape), aux, stats

    def _whole(self, t: torch.Tensor) -> torch.Tensor:
        """A micro-batch result on this cp rank's share -> the whole micro-batch."""
        return unshard_sequence(_all_gather(t, self.ctx.cp_group)) if self.ctx.layout.cp > 1 else t

    # ------------------------------------------------------------------ the engine-level step
    def forward_backward(
        self,
        batch: RLBatch,
        loss_fn=None,
        forward_only: bool = False,
        *,
        entropy: bool = False,
        max_tokens_per_micro_batch: int | None = None,
        return_routing: bool = False,
    ) -> ForwardOutput:
        """Forward (and unless ``forward_only`` backward, accumulating into the gradients) over
        micro-batches of this dp rank's rows ``batch``. ``loss_fn(PolicyInputs) -> (loss share,
        {name: sum over trained tokens})`` is called per micro-batch (attributes ``agg``,
        ``needs_entropy``, optional ``all_targets``: log-probs at every position with a prefix, not
        only trained ones; default ``PolicyLoss()`` when training); it must return the same
        metric names every time. ``forward_only`` also returns this rank's token-aligned
        log-probs (and entropies with ``entropy``, and with ``return_routing`` the experts every
        token was routed to, [B, T, L, K]). A batch carrying ``routing`` is run with those experts
        (routing replay, primitives/moe/replay.py). A batch carrying ``attach`` is a shared-prefix
        tree (rl/shared_prefix.py: cp = 1, pp = 1, row micro-batches). Collective over all ranks."""
        if not isinstance(batch, RLBatch):
            raise TypeError(f"batch must be an RLBatch, got {type(batch).__name__}")
        if batch.input_ids.numel() == 0:
            raise ValueError(
                f"batch has no tokens (input_ids shape {tuple(batch.input_ids.shape)})"
            )
        check_token_ids(batch.input_ids, self.arch.vocab_size, "batch.input_ids")
        if batch.routing is not None:
            check_routing(
                batch.routing,
                self.model.main_moe_layers,
                self.arch.num_experts_per_tok,
                self.arch.num_experts,
            )
        if forward_only:
            self.offloader.require("params")
        else:
            self.offloader.require("params", "grads")
            loss_fn = loss_fn if loss_fn is not None else PolicyLoss()
        budget = max_tokens_per_micro_batch or self.max_tokens_per_micro_batch
        check_tree_batch(
            batch, budget=budget, cp=self.ctx.layout.cp, pp=2 if self.pipeline is not None else 1
        )
        agg = getattr(loss_fn, "agg", "token-mean") if loss_fn is not None else None
        totals = None
        if agg:
            totals = self._dp_sum(
                aggregation_totals(trained_tokens(batch), sequence_ids(batch.position_ids))
            )
        P = prediction_view(
            batch, agg, totals, all_targets=forward_only or getattr(loss_fn, "all_targets", False)
        )
        with_entropy = entropy or getattr(loss_fn, "needs_entropy", False)
        if self.pipeline is not None and (batch.routing is not None or return_routing):
            raise ValueError(
                "routing replay / return_routing is not supported with parallel.pp > 1 yet"
            )
        if self.pipeline is not None:  # the schedule runs every micro-batch (rl/pipeline.py)
            dp_max = lambda t: self._dp_sum(t, dist.ReduceOp.MAX)  # noqa: E731
            with checking(self.replay_check):  # its recomputes' routing, read at the update
                sums, kept = self.pipeline.run(
                    P,
                    loss_fn,
                    forward_only,
                    with_entropy,
                    dp_max,
                    self.arch.router_aux_loss_coef,
                    None if forward_only else self.expert_load,
                )
            out = self._finish(batch, sums, totals, loss_fn, forward_only, kept, entropy)
            if not forward_only:
                self.step_loss += out.loss
            return out
        parts = self._micro_batches(P, batch.seq_index, budget)
        aux_scale = self.arch.router_aux_loss_coef / balance_denominator(
            len(parts), self._dp, self.ctx.layout.cp
        )
        kept: list[tuple] = []
        seen: list = []  # the loss's metric names, per micro-batch

        def forward(mb):
            scope = None
            if "routing" in mb or return_routing:
                scope = RoutingScope(
                    replay_BTLK=mb.get("routing"), record={} if return_routing else None
                )
            logp, ent, aux, stats = self._scores(mb, with_entropy, scope)
            if not forward_only:  # the expert load of what trains (sigmoid_bias routers follow it)
                self.expert_load.add_stats(stats)
            if forward_only:
                kept.append(
                    (
                        logp.detach(),
                        None if ent is None else ent.detach(),
                        mb["index"],
                        scope.recorded() if return_routing else None,
                    )
                )
            if loss_fn is None:
                return aux, {}
            x = PolicyInputs(
                logp, ent, mb["mask"], mb["weights"], *(mb.get(k) for k in LOSS_INPUTS)
            )
            loss, stats = call_loss(loss_fn, x, seen)
            return loss + aux_scale * aux, {"loss": loss, **stats}

        shards = [self._cp_share(mb) for mb in parts]
        if forward_only:
            with torch.no_grad():
                sums = {}
                for mb in shards:
                    for k, v in forward(mb)[1].items():
                        add_stat(sums, k, v)
        else:
            tokens = sum(mb["input_ids"].numel() for mb in shards)
            # its recomputes' routing checks, read at the update (replay_check.py)
            with self._step_tokens(tokens), checking(self.replay_check):
                sums = accumulate(shards, self.sharding, forward)
        out = self._finish(batch, sums, totals, loss_fn, forward_only, kept, entropy)
        if not forward_only:  # checked with the gradients at the next optimizer_step
            self.step_loss += out.loss
        return out

    @contextlib.contextmanager
    def _step_tokens(self, local: int):
        """Inside, a module injecting a per-token loss in its forward (DSA's indexer KL) divides by
        the tokens every forward of this step runs over all dp ranks (``local``: this rank's, cp
        shards; x cp = whole rows), as the Trainer's ``set_step_tokens`` does; 0 again after."""
        if not any(hasattr(m, "step_tokens") for m in self.model.modules()):
            yield  # no such module: no collective
            return
        n = self._dp_sum(torch.tensor([local * self.ctx.layout.cp], device=self.device))
        self.model.set_step_tokens(int(n))
        try:
            yield
        finally:
            self.model.set_step_tokens(0)

    def _finish(self, batch, sums, totals, loss_fn, forward_only, kept, entropy) -> ForwardOutput:
        out = self._aggregate(
            sums, int(totals[0]) if totals is not None else 0, loss_fn is not None
        )
        if forward_only:
            out.logprobs, out.entropy = self._token_aligned(batch, kept, entropy)
            if (
                kept and len(kept[0]) > 3 and kept[0][3] is not None
            ):  # recorded experts, at token positions
                index = [self._whole(p[2]) for p in kept]
                out.routing = mbs.scatter_back(
                    [self._whole(p[3]) for p in kept], index, batch.input_ids.shape
                )
        return out

    def _aggregate(self, sums: dict, n_tokens: int, has_loss: bool) -> ForwardOutput:
        """Loss and metric sums over every rank's tokens; metrics as token means (``_max``
        names: the maximum over every rank)."""
        if not has_loss:
            return ForwardOutput(None, n_tokens, {})
        names = sorted(k for k in sums if k != "loss" and not k.endswith("_max"))
        maxima = sorted(k for k in sums if k.endswith("_max"))
        totals = torch.stack([sums["loss"]] + [sums[k] for k in names])
        top = torch.stack([sums[k] for k in maxima]) if maxima else None
        if self.ctx.distributed:
            dist.all_reduce(totals, group=self.ctx.dp_cp_group)
            if top is not None:
                dist.all_reduce(top, op=dist.ReduceOp.MAX, group=self.ctx.dp_cp_group)
        metrics = {k: float(v) / max(n_tokens, 1) for k, v in zip(names, totals[1:])}
        metrics.update({k: float(v) for k, v in zip(maxima, top if top is not None else [])})
        return ForwardOutput(float(totals[0]), n_tokens, metrics)

    def _token_aligned(self, batch: RLBatch, kept: list, entropy: bool):
        """Per-micro-batch results at prediction positions -> token-aligned [B, T] of this rank."""
        B, T = batch.input_ids.shape
        prefix = has_prefix(batch.position_ids).to(self.device)
        res = []
        for k in range(2 if entropy else 1):
            parts = [self._whole(p[k]).float() for p in kept]
            flat = mbs.scatter_back(
                parts, [self._whole(p[2]) if self.ctx.layout.cp > 1 else p[2] for p in kept], (B, T)
            )
            res.append(torch.where(prefix, shift_right(flat), 0.0).to(batch.input_ids.device))
        return res[0], res[1] if entropy else None
