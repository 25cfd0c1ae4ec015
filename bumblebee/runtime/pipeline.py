"""Pipeline parallelism: decoder layers split into stages, run by a ``torch.distributed.pipelining``
schedule (slot ``pipeline``), composed with FSDP2 / zero1, EP and CP on the same mesh.

Placement. Ranks are (pp, dp_shard, cp, tp) (runtime/mesh.py); ranks with equal dp/cp/tp
coordinates form one pipeline. With v virtual stages per rank there are S = pp x v stages, stage s
on pipeline rank s mod pp (torch's loop placement). Stage 0 also holds the embedding; stage S-1
the final norm, the LM head and the loss primitive (linear CE included), and the multi-token
prediction modules when they train (models/mtp.py): stage 0 embeds their shifted tokens and
every stage passes those embeddings on beside its hidden states (``CausalLM._layers``).

Splitting. ``primitives.pp_layout`` lists each stage's layers; otherwise contiguous stages
minimize the most expensive one on the model's FLOPs per layer (``layer_flops``: full attention,
linear attention, MoE and dense MLP layers differ) x3 for forward + backward (x4 with full
recompute), the LM head counted on the last stage.

What a rank holds. Every rank builds the whole model from the seed (the initialization of any
other layout), then keeps its stages' layers (``CausalLM.keep_stages``): the others become
parameter-free placeholders, so parameter names stay global. The sharding primitive wraps this
part as it would a whole model (FSDP2: one unit per kept layer over the stage's dp x cp ranks,
experts over edp, the model as root); ``hidden_states`` / ``loss_terms`` with ``stage=`` run one
stage and are the FSDP entry points.

Loss and gradients keep pp = 1's convention. The last stage returns each micro-batch's summed
token loss, divided by the global token count in the schedule's loss (``scale_grads=False``). A
stage's balance loss never travels down the pipeline: ``AttachAuxGrad`` gives its routers their
gradient in the backward of the stage output (as Megatron-LM's MoEAuxLossAutoScaler). FSDP units
reduce-scatter once, in their stage's last micro-batch backward. The optimizer tail is the step's
(runtime/step.py), with the gradient norm summed over pp; logged losses cover all ranks. The
balance loss is the ``micro_batch`` definition (the step one needs every micro-batch's
router statistics before the first backward, which 1F1B schedules never have).

Expert loads. Each stage records its MoE layers' router statistics per micro-batch; ``run``
returns this rank's expert counts in the rows of the whole model's layers (zeros elsewhere), so
the step's one all-reduce over every rank gives each layer its global load: the stage that holds
a ``sigmoid_bias`` router moves its bias with it after the optimizer step, and the expert-load
metrics cover every layer, as at pp = 1.

PipelineStage infers activation shapes and dtypes from the first micro-batch (a forward and an
input-gradient backward on the first step, parameter gradients untouched), so fp32 and bf16
residual streams cross stage boundaries exactly as they flow between layers at pp = 1.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage

from bumblebee import registry
from bumblebee.data import Batch
from bumblebee.primitives.moe.balance import dropped_pairs, split_stats


# ------------------------------------------------------------------------------ which layers where
def balance_layers(costs: list[float], stages: int, last_extra: float = 0.0) -> list[list[int]]:
    """Split layers 0..L-1 into ``stages`` contiguous non-empty stages that minimize the cost of the
    most expensive stage (the last also carries ``last_extra``). Dynamic programming over the
    split points, O(stages x L^2)."""
    L = len(costs)
    assert 1 <= stages <= L
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (L + 1) for _ in range(stages + 1)]  # best[s][i]: layers [0, i) in s stages
    start = [[0] * (L + 1) for _ in range(stages + 1)]  # where the s-th stage of that split starts
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        extra = last_extra if s == stages else 0.0
        for i in range(s, L + 1):
            for j in range(s - 1, i):
                cost = max(best[s - 1][j], prefix[i] - prefix[j] + extra)
                if cost < best[s][i]:
                    best[s][i], start[s][i] = cost, j
    split, i = [], L
    for s in range(stages, 0, -1):
        split.append(list(range(start[s][i], i)))
        i = start[s][i]
    return split[::-1]


def stage_layout(cfg, model, stages: int) -> list[list[int]]:
    """Decoder layers of every stage: ``primitives.pp_layout`` if given, else balanced on cost."""
    if cfg.primitives.pp_layout:
        return [list(layers) for layers in cfg.primitives.pp_layout]
    layers, head = model.layer_flops(cfg.train.seq_len)
    passes = (
        4 if cfg.primitives.recompute in ("full", "offload") else 3
    )  # forward + backward (+ recomputed forward)
    mtp = model.mtp_depth  # MTP depths run on the last stage: a (MoE) layer and the LM head each
    return balance_layers(
        [passes * c for c in layers],
        stages,
        last_extra=3 * head * (1 + mtp) + passes * mtp * max(layers),
    )


# ------------------------------------------------------------------------------ one stage
class AttachAuxGrad(torch.autograd.Function):
    """Identity on ``x``; its backward also gives ``aux`` (a stage's share of the balance loss) the
    gradient ``scale`` = d loss / d aux, so the stage's routers learn from the balance loss without
    it travelling down the pipeline."""

    @staticmethod
    def forward(ctx, x, aux, scale: float):
        ctx.scale, ctx.aux_dtype = scale, aux.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        aux_grad = torch.full((), ctx.scale, dtype=ctx.aux_dtype, device=grad.device)
        return grad, aux_grad if ctx.needs_input_grad[1] else None, None


class StageModule(nn.Module):
    """One stage as ``PipelineStage`` runs it: ``forward(x, position_ids=, labels=)``. It enters the
    part through its FSDP entry points and holds no parameters itself."""

    def __init__(self, part, stage: int, aux_scale: float, autocast):
        super().__init__()
        object.__setattr__(
            self, "part", part
        )  # not a submodule: the model (this rank's part) is the FSDP root
        self.stage, self.aux_scale, self.autocast = stage, aux_scale, autocast
        self.is_last = stage == part.num_stages - 1
        self.aux_log: list[torch.Tensor] = []  # this stage's balance loss, one per forward
        self.stats_log: list = []  # this stage's router stats [L, 2E + 2] (or None), one per forward
        # another last-stage head: ``head(part, x, position_ids, labels, stage) -> (out [b, ...], balance
        # loss, router stats)`` (the RL engine's per-token log-probs); None: the summed token loss
        self.head = None

    def forward(self, x, position_ids, labels):
        with self.autocast:
            if self.is_last and self.head is not None:
                out, aux, stats = self.head(self.part, x, position_ids, labels, self.stage)
            elif self.is_last:  # the loss, with the MTP modules' when they train (models/mtp.py)
                terms = self.part.loss_terms(x, labels, position_ids, stage=self.stage)
                out, aux = (
                    torch.stack([terms.loss_sum.float()]),
                    terms.aux_loss,
                )  # [1], concatenated over micro-batches
                stats = terms.router_stats
            else:
                out, aux, stats = self.part.hidden_states(
                    x, position_ids, stage=self.stage, return_stats=True
                )
        self.aux_log.append(aux.detach())
        self.stats_log.append(None if stats is None else stats.detach())
        return AttachAuxGrad.apply(out, aux, self.aux_scale)

    def sync_units(self) -> list[tuple[FSDPModule, bool]]:
        """(FSDP unit, recurse) for the units whose gradients this stage's backward produces."""
        units = [(self.part.decoder_layers[i], True) for i in self.part.stage_layers[self.stage]]
        if self.stage == 0:
            units.append(
                (self.part.model.embed_tokens, True)
            )  # a unit of its own when untied (fsdp_units)
        if self.is_last and self.part.lm_head is not None:
            units.append((self.part.lm_head, True))  # a unit of its own (fsdp_units)
        if self.is_last:
            units += [
                (m, True) for m in ([] if self.part.mtp is None else self.part.mtp_units())
            ]  # MTP: last stage
        if self.stage == 0 or self.is_last:
            units.append((self.part, False))  # the root: final norm (and a tied embedding)
        return [(u, recurse) for u, recurse in units if isinstance(u, FSDPModule)]


class _Stage(PipelineStage):
    """A PipelineStage whose FSDP units reduce-scatter their gradients as ``train.grad_accum``
    says: in every micro-batch's backward (``"sharded"``: FSDP adds each result into the sharded
    gradient) or only in the stage's last (``"unsharded"``). Its module is not the FSDP root, so
    PipelineStage's own handling of an FSDP module does not apply."""

    sync_every = True  # set from train.grad_accum by Pipeline

    def backward_maybe_with_nosync(
        self, backward_type, bwd_kwargs: dict, last_backward: bool = False
    ):
        for unit, recurse in self.submod.sync_units():
            unit.set_requires_gradient_sync(last_backward or self.sync_every, recurse=recurse)
        return super().backward_maybe_with_nosync(
            backward_type, bwd_kwargs, last_backward=last_backward
        )


# ------------------------------------------------------------------------------ the schedule
class Pipeline:
    """This rank's stages and the schedule that runs them: ``run`` is the micro-batch branch of
    the step (runtime/step.py) when pp > 1. Construction keeps only this rank's stages of
    ``model`` (``keep_stages``); the sharding primitive wraps the model after that."""

    def __init__(self, cfg, plan, ctx, model: nn.Module, device: torch.device, autocast):
        p, L = cfg.primitives, ctx.layout
        self.cfg, self.ctx = cfg, ctx
        num_stages = L.pp * p.pp_virtual_stages
        self.layout = stage_layout(cfg, model, num_stages)
        mine = [ctx.pp_rank + j * L.pp for j in range(p.pp_virtual_stages)]
        model.keep_stages({s: self.layout[s] for s in mine}, num_stages)
        self.microbatches = plan.pp_microbatches
        # d loss / d (mean balance loss of one micro-batch), as at pp = 1
        aux_scale = model.arch.router_aux_loss_coef / plan.balance_denominator
        self.modules = [StageModule(model, s, aux_scale, autocast) for s in mine]
        self.stages = [
            _Stage(m, s, num_stages, device, group=ctx.pp_group) for m, s in zip(self.modules, mine)
        ]
        for stage in self.stages:
            stage.sync_every = cfg.train.grad_accum == "sharded"
        self.schedule = registry.get("pipeline", p.pipeline).factory.build(
            self.stages, self.microbatches, self._loss
        )
        self.global_tokens = 1

    def describe(self) -> str:
        return f"pipeline {self.cfg.primitives.pipeline}, {self.microbatches} micro-batches, stages {self.layout}"

    def _loss(self, out_1, target):
        """The schedule's loss of one micro-batch: its summed token loss / the global token count."""
        return out_1.sum() / self.global_tokens

    def run(self, local: Batch, global_tokens: int):
        """Every micro-batch's forward and backward through the schedule, on this rank's rows
        ``local``. Returns this rank's summed token loss (last stage; 0 elsewhere), its stages'
        share of the mean balance loss, and ``router_counts`` (below) for the step's logged
        figures and the bias update."""
        L = self.ctx.layout
        self.global_tokens = global_tokens
        for m in self.modules:
            m.aux_log.clear()
            m.stats_log.clear()
        inputs = (local.input_ids,) if 0 in self.modules[0].part.stage_layers else ()
        out = self.schedule.step(
            *inputs, target=local.labels, position_ids=local.position_ids, labels=local.labels
        )
        n = self.microbatches
        zero = torch.zeros((), device=local.input_ids.device)
        loss_sum = out.detach().float().sum() if out is not None else zero
        aux = sum((a for m in self.modules for a in m.aux_log[-n:]), zero) / (n * L.dp_shard * L.cp)
        return loss_sum, aux, *self.router_counts(n, zero.device)

    def forward_only(self, local: Batch, head=None):
        """Every micro-batch's forward through the stages, no backward (held-out evaluation,
        runtime/eval.py), on rows shaped as a step's. The last stage runs ``head`` (a
        ``StageModule.head``; None: the summed token loss of each micro-batch, as in training) and
        gets its outputs concatenated over micro-batches; a rank without the last stage gets None.
        The stage shapes inferred on the first step are the ones sent (the last stage's output
        goes nowhere, so the head may return any shape)."""
        previous = [m.head for m in self.modules]
        for m in self.modules:
            m.head = head
        try:
            inputs = (local.input_ids,) if 0 in self.modules[0].part.stage_layers else ()
            with torch.no_grad():
                out = self.schedule.eval(
                    *inputs,
                    target=local.labels,
                    position_ids=local.position_ids,
                    labels=local.labels,
                )
        finally:
            for m, h in zip(self.modules, previous):
                m.head = h
        return None if out is None else out.detach()

    def router_counts(self, n: int, device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(expert counts [R, E] in the rows of the whole model's router stats, capacity-dropped
        pairs) of this rank's stages over their last ``n`` forwards, i.e. this schedule run's
        micro-batches (the first run's extra metadata forward is the oldest entry of each log);
        zeros in the rows of other stages' layers, so a sum over every rank is the global load.
        (None, None) for a model without MoE layers."""
        part = self.modules[0].part
        rows = part.router_row_count()
        if not rows:
            return None, None
        counts = torch.zeros(rows, part.arch.num_experts, device=device)
        dropped = torch.zeros((), device=device)
        for m in self.modules:
            log = m.stats_log[-n:]
            assert len(log) == n, (len(log), n)
            for stats in log:
                if stats is not None:
                    counts[part.router_rows(m.stage)] += split_stats(stats)[0]
                    dropped += dropped_pairs(stats)
        return counts, dropped
