"""The training loop: one optimizer step reads top to bottom.

step:
  1. take this rank's rows of the step's global batch (a pure function of seed and step);
  2. count the valid labels of the *global* batch, so the loss is a mean over all
     of its tokens whatever the layout;
  3. for each micro-batch: forward through the model's loss primitive, scale the
     summed token loss by 1 / global tokens (plus the balance loss averaged over
     micro-batches), backward;
  4. clip the gradient norm, set the scheduled learning rate, optimizer step;
  5. log one metrics line.

The trainer knows nothing of a model's internals: it builds the model through
``bumblebee.models`` and talks to it through ``loss_terms``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

import torch
import torch.distributed as dist

from bumblebee import registry
from bumblebee.config import Config, ConfigError, dump_toml
from bumblebee.data import Batch, build_source
from bumblebee.models import build_model, resolve_arch
from bumblebee.perf.memory import MemoryTracker
from bumblebee.primitives.cp.layout import shard_sequence
from bumblebee.primitives.parallel import ParallelGroups
from bumblebee.primitives.sharding import ShardingGroups
from bumblebee.runtime.checkpoint import Checkpointer
from bumblebee.runtime.eval import evaluate
from bumblebee.runtime.mesh import ParallelContext, build_context, plan_layout, single_process
from bumblebee.runtime.metrics import MetricsWriter
from bumblebee.runtime.nonfinite import check_finite
from bumblebee.runtime.pipeline import Pipeline, check_pipeline
from bumblebee.runtime.optim import lr_at, set_lr
from bumblebee.runtime.signals import Preempted, Preemption


def pick_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def seed_everything(seed: int, deterministic: bool) -> None:
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=False)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def build_initial_model(cfg: Config, device: torch.device, groups: ParallelGroups | None = None):
    """The model a config describes, initialized identically on every rank and for every
    layout (same seed), or loaded from ``model.hf_path``; holds this rank's experts only."""
    arch = resolve_arch(cfg.model)
    groups = groups or ParallelGroups()
    torch.manual_seed(cfg.train.seed)
    model = build_model(arch, cfg.primitives, groups)
    if cfg.model.hf_path:
        from bumblebee.models.hf import load_hf_weights

        full = model if groups.ep_size == 1 else build_model(arch, cfg.primitives)
        load_hf_weights(full, cfg.model.hf_path)
        if full is not model:
            copy_expert_slice(full, model, groups.ep_rank, groups.ep_size)
    return model.to(device)


@torch.no_grad()
def copy_expert_slice(full: torch.nn.Module, part: torch.nn.Module, ep_rank: int, ep_size: int) -> None:
    """Copy a full model's weights into an expert-parallel model (its share of experts)."""
    src = dict(full.named_parameters())
    for name, p in part.named_parameters():
        t = src[name]
        if t.shape != p.shape:
            n = p.shape[0]
            t = t[ep_rank * n:(ep_rank + 1) * n]
        p.copy_(t)


def check_run(cfg: Config, world: int):
    """Everything about a run on ``world`` ranks that can be rejected before any process
    group exists (the launcher calls this in the parent process)."""
    layout = plan_layout(cfg.parallel, world, resolve_arch(cfg.model))
    if world > 1 and cfg.primitives.sharding == "none":
        raise ConfigError(f"primitives.sharding = 'none' needs a single process (world size is {world}); "
                          "use 'fsdp2' or 'zero1'")
    if layout.ep > 1 and cfg.primitives.moe_comm == "local":
        raise ConfigError("primitives.moe_comm = 'local' keeps all experts on one rank; with ep > 1 use 'alltoall'")
    if cfg.train.seq_len % (2 * layout.cp):
        raise ConfigError(f"train.seq_len ({cfg.train.seq_len}) must be divisible by 2 x parallel.cp "
                          f"({2 * layout.cp}): each rank holds two of the 2*cp zigzag chunks")
    if layout.cp > 1 and cfg.model.name not in ("qwen3_moe", "qwen3_5_moe"):
        raise ConfigError(f"parallel.cp > 1 is not supported yet for model {cfg.model.name!r}; "
                          "valid: qwen3_moe, qwen3_5_moe")
    rows, rem = divmod(cfg.train.global_batch, layout.dp_shard)
    if rem or rows % cfg.train.micro_batch:
        raise ConfigError(f"train.global_batch ({cfg.train.global_batch}) must be a multiple of dp_shard "
                          f"({layout.dp_shard}) x train.micro_batch ({cfg.train.micro_batch})")
    check_pipeline(cfg, layout, resolve_arch(cfg.model), rows)
    if cfg.train.eval_every and layout.pp > 1:
        raise ConfigError("train.eval_every is not supported with parallel.pp > 1 yet")
    return layout


def build_parallel_context(cfg: Config, device: torch.device) -> ParallelContext:
    """Single process, or the meshes of the current process group."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    layout = check_run(cfg, world)
    return single_process(device) if world == 1 else build_context(layout, device)


def build_sharding(cfg: Config, ctx: ParallelContext):
    """The configured sharding primitive over this layout's groups (``wrap(model)`` comes next)."""
    groups = ShardingGroups(dense_mesh=ctx.dp_cp["dp_cp"] if ctx.dp_cp is not None else None,
                            expert_mesh=ctx.experts["edp"] if ctx.experts is not None else None,
                            ep_group=ctx.ep_group)
    return registry.get("sharding", cfg.primitives.sharding).factory(groups, cfg.train)


class Trainer:
    def __init__(self, cfg: Config, *, stream=sys.stdout, device: torch.device | None = None):
        self.cfg = cfg
        t = cfg.train
        self.device = device or pick_device()
        self.ctx = build_parallel_context(cfg, self.device)
        self.rank = self.ctx.rank
        self.dp_rank, self.dp_size = self.ctx.dp_rank, self.ctx.layout.dp_shard
        rows_per_rank = t.global_batch // self.dp_size
        self.rows_per_rank = rows_per_rank
        self.accum = rows_per_rank // t.micro_batch
        seed_everything(t.seed, t.deterministic)
        ctx = self.ctx
        self.cp, self.cp_rank = ctx.layout.cp, ctx.cp_rank
        self.model = build_initial_model(cfg, self.device, ParallelGroups(ep_group=ctx.ep_group,
                                                                          cp_group=ctx.cp_group))
        self.pipeline = None
        if ctx.layout.pp > 1:  # keep this rank's pipeline stages only; that part is what gets sharded
            self.pipeline = Pipeline(cfg, ctx, self.model, self.device)
            self.model = self.pipeline.part
        self.sharding = build_sharding(cfg, ctx)
        self.model = self.sharding.wrap(self.model)
        self.source = build_source(cfg.data, t, self.model.arch.vocab_size)
        self.autocast = (torch.autocast(self.device.type, dtype=torch.bfloat16) if t.dtype == "bfloat16"
                         else contextlib.nullcontext())
        self.checkpoint = Checkpointer(cfg, ctx, self.model, self.sharding, stream=stream)
        self.step = self.checkpoint.resume(t.resume)  # 0 unless train.resume names a checkpoint
        if self.rank == 0:
            os.makedirs(t.out_dir, exist_ok=True)
            with open(os.path.join(t.out_dir, "config.toml"), "w") as f:
                f.write(dump_toml(cfg))
            if ctx.distributed:
                stream.write(f"bumblebee: {ctx.layout.describe()}; sharding {cfg.primitives.sharding}\n")
            if self.pipeline is not None:
                stream.write(f"bumblebee: {self.pipeline.describe()}\n")
        self.metrics = MetricsWriter(t.out_dir if self.rank == 0 else None, total_steps=t.steps,
                                     log_every=t.log_every, stream=stream, first_step=self.step,
                                     tensorboard=t.tensorboard)
        self.skipped = self.metrics.resumed.get("skipped_steps", 0)  # non-finite steps skipped so far
        self.stream = stream
        if self.rank == 0 and self.source.describe():
            stream.write(f"bumblebee: {self.source.describe()}\n")

    def train_step(self) -> dict:
        """One optimizer step, with its peak live memory measured (perf.memory)."""
        with MemoryTracker(self.device, self.model, self.sharding.optimizer) as memory:
            record = self._step()
        record["peak_mem_bytes"] = self._max_over_ranks(memory.peak_bytes)
        return record

    def _step(self) -> dict:
        if self.pipeline is not None:
            return self._pipeline_step()
        t, model = self.cfg.train, self.model
        start = time.perf_counter()
        lo = self.dp_rank * self.rows_per_rank  # this rank's rows only are built (data/)
        local = self.source.rows_at(self.step, lo, lo + self.rows_per_rank)
        global_valid = self.source.num_valid_at(self.step)
        global_tokens = max(global_valid, 1)
        if self.cp > 1:  # this rank's zigzag share of every row (tokens, labels, positions alike)
            local = Batch(*(shard_sequence(x, self.cp, self.cp_rank)
                            for x in (local.input_ids, local.labels, local.position_ids)))
        local = local.to(self.device)
        coef = model.arch.router_aux_loss_coef
        loss_sum = torch.zeros((), device=self.device)
        aux_sum = torch.zeros((), device=self.device)
        for i in range(self.accum):
            self.sharding.set_grad_sync(i == self.accum - 1)
            mb = local.rows(i * t.micro_batch, (i + 1) * t.micro_batch)
            with self.autocast:
                terms = model.loss_terms(mb.input_ids, mb.labels, mb.position_ids)
            # the balance loss is a mean over all micro-batches of the global batch (all dp ranks);
            # cp ranks hold identical copies of it (statistics reduced over the sequence)
            loss = terms.loss_sum / global_tokens + coef * terms.aux_loss / (self.accum * self.dp_size * self.cp)
            loss.backward()
            loss_sum += terms.loss_sum.detach().float()
            aux_sum += terms.aux_loss.detach() / self.accum
        self.sharding.reduce_grads()
        max_norm = t.clip_grad if t.clip_grad > 0 else float("inf")
        grad_norm = self.sharding.clip_grad_norm(max_norm)
        if self.ctx.distributed:  # the logged loss covers the whole global batch (so every rank checks the same)
            stats = torch.stack([loss_sum, aux_sum / (self.dp_size * self.cp)])
            dist.all_reduce(stats, group=self.ctx.dp_cp_group)
            loss_sum, aux_sum = stats[0], stats[1]
        lr = lr_at(self.step, t)
        if check_finite(self.step + 1, loss_sum / global_tokens, grad_norm, t.on_nonfinite):  # False: skip; "stop" raises
            set_lr(self.sharding, lr)
            self.sharding.step()
        else:
            self.skipped += 1
        self.sharding.zero_grad()
        self.step += 1
        elapsed = time.perf_counter() - start
        tokens = t.global_batch * t.seq_len
        return {
            "step": self.step,
            "loss": float(loss_sum) / global_tokens,
            "aux_loss": float(aux_sum),
            "grad_norm": float(grad_norm),
            "lr": lr,
            "tokens": tokens,
            "valid_tokens": global_valid,
            "tokens_per_s": tokens / elapsed,
            "step_time_s": elapsed,
            "skipped_steps": self.skipped,
        }

    def _pipeline_step(self) -> dict:
        """The step when pp > 1: the pipeline schedule runs every micro-batch (runtime/pipeline.py)."""
        record = self.pipeline.step(self)
        self.step += 1
        return record

    def _max_over_ranks(self, peak: int) -> int:
        """Peak bytes of the most loaded rank."""
        if self.ctx.distributed:
            t = torch.tensor([peak], dtype=torch.float64, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            peak = int(t.item())
        return peak

    def run(self) -> dict:
        t = self.cfg.train
        world = dist.group.WORLD if self.ctx.distributed else None
        with Preemption() as preemption:  # SIGTERM / SIGUSR1: stop at the next step boundary
            while self.step < t.steps:
                record = self.train_step()
                if t.eval_every and (self.step % t.eval_every == 0 or self.step == t.steps):
                    record.update(evaluate(self))
                self.metrics.log(record)
                self.checkpoint.on_step(self.step)  # saves every train.save_every steps
                if self.step < t.steps and (signum := preemption.requested(world, self.device)):
                    path = self.checkpoint.save(self.step) if self.checkpoint.last_saved != self.step \
                        else self.checkpoint.last_path
                    raise Preempted(self.step, path, signum)
        self.checkpoint.on_end(self.step)  # final save; Hugging Face export if train.export_hf
        summary = self.metrics.close()
        if self.source.stats:  # documents, rows, skipped / truncated / dropped records
            summary["data"] = self.source.stats
            if self.rank == 0:
                self.stream.write(f"bumblebee: {self.source.describe()}\n")
        return summary
