"""Pipeline parallelism: decoder layers split into stages, run by a ``torch.distributed.pipelining``
schedule (slot ``pipeline``), composed with FSDP2 / zero1, EP and CP on the same mesh.

Placement. Ranks are (pp, dp_shard, cp, tp) (runtime/mesh.py); ranks with equal dp/cp/tp
coordinates form one pipeline. With v virtual stages per rank there are S = pp x v stages, stage s
on pipeline rank s mod pp (torch's loop placement). Stage 0 also holds the embedding; stage S-1
the final norm, the LM head and the loss primitive (linear CE included).

Splitting. ``primitives.pp_layout`` lists each stage's layers; otherwise contiguous stages
minimize the most expensive one on the model's FLOPs per layer (``layer_flops``: full attention,
linear attention, MoE and dense MLP layers differ) x3 for forward + backward (x4 with full
recompute), the LM head counted on the last stage.

What a rank holds. Every rank builds the whole model from the seed (the initialization of any
other layout), then keeps its stages' layers: the others become parameter-free placeholders, so
parameter names stay global. The sharding primitive wraps this part (``PipelinePart``) as it
would a whole model (FSDP2: one unit per kept layer over the stage's dp x cp ranks, experts over
edp, the part as root); its ``hidden_states`` / ``loss_terms`` run one stage and are the FSDP
entry points.

Loss and gradients keep pp = 1's convention. The last stage returns each micro-batch's summed
token loss, divided by the global token count in the schedule's loss (``scale_grads=False``). A
stage's balance loss never travels down the pipeline: ``AttachAuxGrad`` gives its routers their
gradient in the backward of the stage output (as Megatron-LM's MoEAuxLossAutoScaler). FSDP units
reduce-scatter once, in their stage's last micro-batch backward. The gradient norm is global (the
sharding primitive's norm of this stage, squared, summed over pp); logged losses cover all ranks.

PipelineStage infers activation shapes and dtypes from the first micro-batch (a forward and an
input-gradient backward on the first step, parameter gradients untouched), so fp32 and bf16
residual streams cross stage boundaries exactly as they flow between layers at pp = 1.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage

from bumblebee import registry
from bumblebee.config import ConfigError
from bumblebee.data import Batch
from bumblebee.models.qwen3_moe import LossTerms
from bumblebee.primitives.cp.layout import shard_sequence
from bumblebee.primitives.sharding.common import local
from bumblebee.runtime.optim import lr_at, set_lr


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
    passes = 4 if cfg.primitives.recompute == "full" else 3  # forward + backward (+ recomputed forward)
    return balance_layers([passes * c for c in layers], stages, last_extra=3 * head)


def check_pipeline(cfg, layout, arch, rows_per_rank: int) -> None:
    """Reject pipeline settings that cannot run (one-line ConfigErrors, before any process starts)."""
    p = cfg.primitives
    if p.pp_microbatches < 0 or p.pp_virtual_stages < 1:
        raise ConfigError(f"primitives.pp_microbatches must be >= 0 and pp_virtual_stages >= 1, "
                          f"got {p.pp_microbatches} and {p.pp_virtual_stages}")
    if layout.pp == 1:
        if p.pp_layout or p.pp_virtual_stages != 1:
            raise ConfigError("primitives.pp_layout and pp_virtual_stages need parallel.pp > 1")
        return
    m = p.pp_microbatches or rows_per_rank // cfg.train.micro_batch
    if rows_per_rank % m:
        raise ConfigError(f"primitives.pp_microbatches = {m} must divide the {rows_per_rank} rows of each "
                          f"pipeline (train.global_batch / dp_shard)")
    problem = registry.get("pipeline", p.pipeline).factory.check(layout.pp, m, p.pp_virtual_stages)
    if problem:
        raise ConfigError(f"primitives.pipeline = {p.pipeline!r} {problem}")
    stages, n = layout.pp * p.pp_virtual_stages, arch.num_hidden_layers
    if stages > n:
        raise ConfigError(f"pp x pp_virtual_stages = {stages} stages need at least as many decoder layers, "
                          f"the model has {n}")
    if arch.tie_word_embeddings:
        raise ConfigError("tied embeddings cannot be split over pipeline stages (embedding on the first, "
                          "LM head on the last); use parallel.pp = 1")
    if p.pp_layout:
        ok = (isinstance(p.pp_layout, list) and len(p.pp_layout) == stages
              and all(isinstance(s, list) and s for s in p.pp_layout)
              and [i for s in p.pp_layout for i in s] == list(range(n)))
        if not ok:
            raise ConfigError(f"primitives.pp_layout must list {stages} non-empty stages of consecutive decoder "
                              f"layers covering 0..{n - 1} in order, e.g. [[0, 1], [2, 3]]; got {p.pp_layout}")


# ------------------------------------------------------------------------------ this rank's part
class Elsewhere(nn.Module):
    """Stands in for a decoder layer that another pipeline stage holds (no parameters)."""

    def __init__(self, index: int):
        super().__init__()
        self.index = index

    def forward(self, *args):
        raise RuntimeError(f"decoder layer {self.index} lives on another pipeline stage")


class PipelinePart(nn.Module):
    """This rank's stages of a model: its layers (placeholders elsewhere), the embedding if it
    holds stage 0, the final norm and LM head if it holds the last stage. ``hidden_states`` and
    ``loss_terms`` mirror the model's entry points, for one stage at a time."""

    def __init__(self, model: nn.Module, stage_layers: dict[int, list[int]], num_stages: int):
        super().__init__()
        self.arch, self.family = model.arch, model.family
        self.recompute, self.loss_fn, self.layer_context = model.recompute, model.loss_fn, model.layer_context
        self.num_moe = max(sum(int(layer.is_moe) for layer in model.model.layers), 1)  # over the whole model
        self.stage_layers, self.num_stages = stage_layers, num_stages
        kept = {i for layers in stage_layers.values() for i in layers}
        for i in range(len(model.model.layers)):
            if i not in kept:
                model.model.layers[i] = Elsewhere(i)
        if 0 not in stage_layers:
            model.model.embed_tokens = None
        if num_stages - 1 not in stage_layers:
            model.model.norm = model.lm_head = None
        self.model, self.lm_head = model.model, model.lm_head

    def hidden_states(self, inputs, position_ids_BT, *, stage: int):
        """Stage ``stage``: the embedding (stage 0: ``inputs`` are token ids [B, T], else the previous
        stage's hidden states [B, T, H]), its decoder layers, the final norm (last stage). Returns
        the hidden states and this stage's share of the mean balance loss over MoE layers."""
        x = self.model.embed_tokens(inputs) if stage == 0 else inputs
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        cos, sin, layout = self.layer_context(position_ids_BT, dtype)
        aux = x.new_zeros((), dtype=torch.float32)
        for i in self.stage_layers[stage]:
            x, a = self.recompute.layer(self.model.layers[i], x, cos, sin, layout)
            aux = aux + a
        if stage == self.num_stages - 1:
            x = self.model.norm(x)
        return x, aux / self.num_moe

    def loss_terms(self, inputs, labels_BT, position_ids_BT, *, stage: int) -> LossTerms:
        """The last stage: its hidden states, then the summed token loss through the loss primitive."""
        h_BTH, aux = self.hidden_states(inputs, position_ids_BT, stage=stage)
        labels_T = labels_BT.reshape(-1)
        loss_sum = self.loss_fn(h_BTH.reshape(-1, h_BTH.shape[-1]), self.lm_head.weight, labels_T, reduction="sum")
        return LossTerms(loss_sum, (labels_T != -100).sum(), aux)


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

    def __init__(self, part: PipelinePart, stage: int, aux_scale: float, autocast):
        super().__init__()
        object.__setattr__(self, "part", part)  # not a submodule: the part is the FSDP root
        self.stage, self.aux_scale, self.autocast = stage, aux_scale, autocast
        self.is_last = stage == part.num_stages - 1
        self.aux_log: list[torch.Tensor] = []  # this stage's balance loss, one per forward

    def forward(self, x, position_ids, labels):
        with self.autocast:
            if self.is_last:
                terms = self.part.loss_terms(x, labels, position_ids, stage=self.stage)
                out, aux = terms.loss_sum.float(), terms.aux_loss
            else:
                out, aux = self.part.hidden_states(x, position_ids, stage=self.stage)
        self.aux_log.append(aux.detach())
        out = AttachAuxGrad.apply(out, aux, self.aux_scale)
        return torch.stack([out]) if self.is_last else out  # [1], concatenated over micro-batches

    def sync_units(self) -> list[tuple[FSDPModule, bool]]:
        """(FSDP unit, recurse) for the units whose gradients this stage's backward produces."""
        units = [(self.part.model.layers[i], True) for i in self.part.stage_layers[self.stage]]
        if self.stage == 0 or self.is_last:
            units.append((self.part, False))  # the root: embedding, or final norm + LM head
        return [(u, recurse) for u, recurse in units if isinstance(u, FSDPModule)]


class _Stage(PipelineStage):
    """A PipelineStage whose FSDP units reduce-scatter their gradients only in the stage's last
    micro-batch backward (its module is not the FSDP root, so PipelineStage's own handling of an
    FSDP module does not apply)."""

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        for unit, recurse in self.submod.sync_units():
            unit.set_requires_gradient_sync(last_backward, recurse=recurse)
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)


# ------------------------------------------------------------------------------ the step
class Pipeline:
    """This rank's stages and the schedule that runs them; ``step`` replaces the trainer's
    micro-batch loop when pp > 1."""

    def __init__(self, cfg, ctx, model: nn.Module, device: torch.device):
        p, L = cfg.primitives, ctx.layout
        self.cfg, self.ctx = cfg, ctx
        num_stages = L.pp * p.pp_virtual_stages
        self.layout = stage_layout(cfg, model, num_stages)
        mine = [ctx.pp_rank + j * L.pp for j in range(p.pp_virtual_stages)]
        self.part = PipelinePart(model, {s: self.layout[s] for s in mine}, num_stages)
        rows = cfg.train.global_batch // L.dp_shard
        self.microbatches = p.pp_microbatches or rows // cfg.train.micro_batch
        # d loss / d (mean balance loss of one micro-batch), as at pp = 1
        aux_scale = model.arch.router_aux_loss_coef / (self.microbatches * L.dp_shard * L.cp)
        autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if cfg.train.dtype == "bfloat16"
                    else contextlib.nullcontext())
        self.modules = [StageModule(self.part, s, aux_scale, autocast) for s in mine]
        self.stages = [_Stage(m, s, num_stages, device, group=ctx.pp_group) for m, s in zip(self.modules, mine)]
        self.schedule = registry.get("pipeline", p.pipeline).factory.build(self.stages, self.microbatches,
                                                                           self._loss)
        self.global_tokens = 1

    def describe(self) -> str:
        return f"pipeline {self.cfg.primitives.pipeline}, {self.microbatches} micro-batches, stages {self.layout}"

    def _loss(self, out_1, target):
        """The schedule's loss of one micro-batch: its summed token loss / the global token count."""
        return out_1.sum() / self.global_tokens

    def step(self, trainer) -> dict:
        """One optimizer step (``trainer.step`` is not advanced here): the schedule runs every
        micro-batch's forward and backward; then the global gradient norm, clipping, the update."""
        t, L, sharding = self.cfg.train, self.ctx.layout, trainer.sharding
        start = time.perf_counter()
        batch = trainer.source.global_batch_at(trainer.step)
        self.global_tokens = max(batch.num_valid, 1)
        rows = trainer.rows_per_rank
        local_batch = batch.rows(trainer.dp_rank * rows, (trainer.dp_rank + 1) * rows)
        if L.cp > 1:  # this rank's zigzag share of every row, as at pp = 1
            local_batch = Batch(*(shard_sequence(x, L.cp, trainer.cp_rank)
                                  for x in (local_batch.input_ids, local_batch.labels, local_batch.position_ids)))
        local_batch = local_batch.to(trainer.device)
        for m in self.modules:
            m.aux_log.clear()
        inputs = (local_batch.input_ids,) if 0 in self.part.stage_layers else ()
        out = self.schedule.step(*inputs, target=local_batch.labels, position_ids=local_batch.position_ids,
                                 labels=local_batch.labels)
        sharding.reduce_grads()
        grad_norm = self._clip_grad_norm(sharding, t.clip_grad if t.clip_grad > 0 else float("inf"))
        lr = lr_at(trainer.step, t)
        set_lr(sharding, lr)
        sharding.step()
        sharding.zero_grad()
        # logged figures over the global batch: token losses from the last stage, balance loss
        # from every stage (the first step's metadata forward is the extra, oldest log entry)
        n = self.microbatches
        zero = torch.zeros((), device=trainer.device)
        loss_sum = out.detach().float().sum() if out is not None else zero
        aux = sum((a for m in self.modules for a in m.aux_log[-n:]), zero) / (n * L.dp_shard * L.cp)
        stats = torch.stack([loss_sum, aux])
        dist.all_reduce(stats)
        elapsed = time.perf_counter() - start
        return {"step": trainer.step + 1, "loss": float(stats[0]) / self.global_tokens, "aux_loss": float(stats[1]),
                "grad_norm": float(grad_norm), "lr": lr, "tokens": batch.input_ids.numel(),
                "valid_tokens": batch.num_valid, "tokens_per_s": batch.input_ids.numel() / elapsed,
                "step_time_s": elapsed}

    def _clip_grad_norm(self, sharding, max_norm: float) -> torch.Tensor:
        """Norm of all gradients of all stages; scale them by min(1, max_norm / (norm + 1e-6))."""
        stage_norm = sharding.clip_grad_norm(float("inf"))  # this stage's norm (multiplies gradients by 1)
        sq = stage_norm.detach().float().pow(2).reshape(1)
        dist.all_reduce(sq, group=self.ctx.pp_group)
        total = sq.sqrt()[0]
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in self.part.parameters():
            if p.grad is not None:
                local(p.grad).mul_(coef.to(p.grad.dtype))
        return total
