"""The training loop: build the run's pieces once, then one step per batch.

step (runtime/step.py does the work):
  1. take the step's global batch (a pure function of seed and step) and count its valid
     labels, so the loss is a mean over all of its tokens whatever the layout;
  2. this rank's rows and CP share of them;
  3. forward + backward over micro-batches (or the pipeline schedule when pp > 1);
  4. the optimizer tail: reduce, clip, LR, update, zero;
  5. log one metrics line.

The trainer knows nothing of a model's internals: it builds the model through
``bumblebee.models`` and talks to it through the protocol of ``models/base.py``.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import torch
import torch.distributed as dist

from bumblebee import safe_write
from bumblebee.config import Config, ConfigError, eval_interval
from bumblebee.config_parse import dump_toml
from bumblebee.data import build_source
from bumblebee.data.packing import Batch
from bumblebee.perf.flops import Throughput, device_peak
from bumblebee.perf.memory import MemoryTracker
from bumblebee.primitives import emulation
from bumblebee.primitives.kernel_choice import configured as configured_dispatch
from bumblebee.primitives.kernel_choice import describe as describe_kernels
from bumblebee.primitives.moe.balance import load_summary
from bumblebee.primitives.replay_check import ReplayCheck, checking
from bumblebee.runtime.build import build_run, check_world, pick_device
from bumblebee.runtime.checkpoint.checkpointer import Checkpointer
from bumblebee.runtime.checkpoint.export import export_checkpoint, run_tokenizer
from bumblebee.runtime.eval import evaluate
from bumblebee.runtime.launch.outdir import LockWatch
from bumblebee.runtime.launch.signals import Preempted, Preemption
from bumblebee.runtime.metrics import MetricsWriter, wandb_init
from bumblebee.runtime.optim import lr_at, static_state_bytes
from bumblebee.runtime.pipeline import Pipeline
from bumblebee.runtime.resolve import RunPlan
from bumblebee.runtime.step import (
    GROUP_BALANCE,
    accumulate,
    accumulate_global_balance,
    lm_forward,
    local_batch,
    micro_batches,
    optimizer_tail,
)


class Trainer:
    """``plan``: the run as ``check_run`` resolved it for this world (resolved here if not given)."""

    def __init__(
        self,
        cfg: Config,
        *,
        stream=None,
        device: torch.device | None = None,
        plan: RunPlan | None = None,
    ):
        # emulation: wrapping picks the NCCL forms of FSDP2's collectives
        with emulation.maybe(cfg.train.emulate_cuda), configured_dispatch(cfg.primitives):
            self._build(cfg, stream=stream, device=device, plan=plan)

    def _build(self, cfg: Config, *, stream, device: torch.device | None, plan) -> None:
        stream = (
            stream or sys.stdout
        )  # looked up now: sys.stdout may have been replaced since import
        self.cfg = cfg
        t = cfg.train
        self.device = device or (torch.device("cpu") if t.emulate_cuda else pick_device())
        kind = "cuda" if t.emulate_cuda else self.device.type
        self.plan = plan = plan.on_device(cfg, kind) if plan else check_world(cfg, device=kind)
        run = build_run(cfg, plan, self.device, Pipeline, capacity=True)
        self.ctx = ctx = run.ctx
        self.rank = ctx.rank
        self.dp_rank, self.dp_size = ctx.dp_rank, plan.layout.dp_shard
        self.rows_per_rank, self.accum = plan.rows_per_rank, plan.micro_batches
        self.cp, self.cp_rank = ctx.layout.cp, ctx.cp_rank
        self.autocast, self.pipeline, self.sharding = run.autocast, run.pipeline, run.sharding
        self.model, self.optimizer = run.model, run.optimizer
        self.model.set_step_tokens(plan.tokens_per_step)  # in-forward auxiliary losses' mean
        self.source = build_source(cfg.data, t, self.model.arch.vocab_size)
        self.checkpoint = Checkpointer(
            cfg, ctx, self.model, self.sharding, self.optimizer, stream=stream
        )
        self.step = self.checkpoint.resume(t.resume)  # 0 unless train.resume names a checkpoint
        if (
            self.step > t.steps
        ):  # the run would end at once, having trained nothing: say why instead
            raise ConfigError(
                f"train.steps = {t.steps} but the checkpoint it resumes is at step {self.step}: "
                f"nothing to train; set train.steps above {self.step} to continue it"
            )
        if self.step and self.step == t.steps:
            self.checkpoint._say(
                f"the checkpoint is at train.steps = {t.steps} already: nothing to train"
            )
        if self.rank == 0:
            safe_write.make_dirs(t.out_dir)
            safe_write.write_file(
                os.path.join(t.out_dir, "config.toml"), dump_toml(cfg), doing="write the config"
            )
            if ctx.distributed:
                stream.write(
                    f"bumblebee: {ctx.layout.describe()}; sharding {cfg.primitives.sharding}\n"
                )
            kernels = describe_kernels(plan.kernels)
            stand_ins = (
                "FLA's Triton kernels through Triton's interpreter, the other kernels' references"
                if t.emulate_cuda == emulation.REAL_KERNELS
                else "reference kernels"
            )
            emulated = f" (emulated CUDA: CPU tensors, {stand_ins}, checked communication)"
            stream.write(
                "bumblebee: kernels " + kernels + (emulated if t.emulate_cuda else "") + "\n"
            )
            if self.pipeline is not None:
                stream.write(f"bumblebee: {self.pipeline.describe()}\n")
        self._describe_static_memory(stream)
        spec = dataclasses.replace(self.model.arch.to_spec(), mtp_depth=plan.mtp_depth)
        self.throughput = Throughput(
            spec.model_flops_per_token(t.seq_len),
            ctx.layout.world,
            device_peak(self.device, t.dtype)[1],
        )  # tflops_per_gpu, mfu of each step
        self.metrics = MetricsWriter(
            t.out_dir if self.rank == 0 else None,
            total_steps=t.steps,
            log_every=t.log_every,
            stream=stream,
            first_step=self.step,
            tensorboard=t.tensorboard,
            wandb=wandb_init(cfg) if t.wandb else None,
            expert_ceiling=spec.experts / spec.top_k if spec.experts else 0.0,
        )
        self.skipped = self.metrics.resumed.get(
            "skipped_steps", 0
        )  # non-finite steps skipped so far
        self.stream = stream
        # rank 0 stops if the out_dir lock it runs under vanishes (the directory deleted)
        self.lock_watch = LockWatch(t.out_dir) if self.rank == 0 else None
        self._peak = None  # peak live bytes of the last measured step
        self._eval_peak = None  # ... and of the last measured evaluation
        self.eval_every = eval_interval(
            cfg
        )  # held-out evaluation cadence (0: none), on every layout
        if self.rank == 0 and self.source.describe():
            stream.write(f"bumblebee: {self.source.describe()}\n")

    def _describe_static_memory(self, stream) -> None:
        """One line: the largest per-rank static state (params / grads / optimizer), collective."""
        b = static_state_bytes(self.model, self.optimizer)
        figures = torch.tensor(
            [b["params"], b["grads"], b["optimizer"]], dtype=torch.float64, device=self.device
        )
        if self.ctx.distributed:
            dist.all_reduce(figures, op=dist.ReduceOp.MAX)
        if self.rank == 0:

            def size(x: float) -> str:
                return f"{x / 2**30:.2f} GiB" if x >= 2**30 else f"{x / 2**20:.1f} MiB"

            p, g, o = (size(x) for x in figures.tolist())
            stream.write(
                f"bumblebee: static memory per rank (largest): params {p}, grads {g}, optimizer {o}; "
                f"total {size(float(figures.sum()))} ({self.cfg.train.dtype} compute)\n"
            )

    def rank_batch(self) -> Batch:
        """This rank's share of the current step's global batch: its dp rows (only those are
        built, data/), then its cp shard, on the device."""
        lo = self.dp_rank * self.rows_per_rank
        rows = self.source.rows_at(self.step, lo, lo + self.rows_per_rank)
        return local_batch(rows, self.cp, self.cp_rank, self.device)

    def train_step(self) -> dict:
        """One optimizer step, with its peak live memory (perf.memory). On CUDA the allocator's
        counters are read every step; on CPU live tensors are counted by a dispatch mode around
        every op, which costs step time, so only the first step of a run is measured unless
        ``train.track_memory`` (later steps report that peak)."""
        with (
            emulation.maybe(self.cfg.train.emulate_cuda),
            configured_dispatch(self.cfg.primitives),
        ):
            measured = (
                self.device.type == "cuda" or self.cfg.train.track_memory or self._peak is None
            )
            if not measured:
                record = self._step()
            else:
                with MemoryTracker(self.device, self.model, self.optimizer) as memory:
                    record = self._step()
                self._peak = self._max_over_ranks(memory.peak_bytes)
        record["peak_mem_bytes"] = self._peak
        record["peak_mem_measured"] = measured  # False: the last measured step's peak, repeated
        return record

    def evaluate(self) -> dict:
        """The held-out figures (runtime/eval.py) with the evaluation's own peak live memory,
        ``eval_peak_mem_bytes``, measured as ``train_step`` measures a step's (CPU: the first one
        unless ``train.track_memory``): evaluation is meant to fit wherever training does."""
        if (
            self.device.type != "cuda"
            and not self.cfg.train.track_memory
            and self._eval_peak is not None
        ):
            out = evaluate(self)
        else:
            with MemoryTracker(self.device, self.model, self.optimizer) as memory:
                out = evaluate(self)
            self._eval_peak = self._max_over_ranks(memory.peak_bytes)
        return {**out, "eval_peak_mem_bytes": self._eval_peak} if out else out

    def _step(self) -> dict:
        t = self.cfg.train
        if self.source.num_valid_at(self.step) == 0:
            return self._skip_step()
        start = time.perf_counter()
        global_valid = self.source.num_valid_at(self.step)
        global_tokens = max(global_valid, 1)
        local = self.rank_batch()
        # this rank's expert counts [L, E] (global after the all-reduce below); the step's
        # recomputes compare their routing with their forwards' into ``replay``
        replay = ReplayCheck()
        with checking(replay):
            loss_sum, aux, counts, dropped = self._forward_backward(local, global_tokens)
        if (
            self.ctx.distributed
        ):  # the logged loss covers the whole global batch (so every rank checks the same)
            # (pipeline: over every rank, each layer's counts coming from the ranks of its stage)
            extra = [] if counts is None else [dropped.reshape(1), counts.flatten()]
            stats = torch.cat([torch.stack([loss_sum, aux])] + extra)
            dist.all_reduce(
                stats, group=None if self.pipeline is not None else self.ctx.dp_cp_group
            )
            loss_sum, aux = stats[0], stats[1]
            if counts is not None:
                dropped, counts = stats[2], stats[3:].view_as(counts)
        grad_norm, lr, applied = optimizer_tail(
            self.sharding,
            self.optimizer,
            t,
            self.step,
            loss=loss_sum / global_tokens,
            pp_group=self.ctx.pp_group if self.pipeline is not None else None,
            params=self.model.parameters(),
            replay=replay,
        )
        if applied and counts is not None:  # sigmoid_bias routers follow the step's global load
            self.model.update_router_bias(counts, self.cfg.moe.bias_update_rate)
        self.skipped += not applied
        self.step += 1
        elapsed = time.perf_counter() - start
        tokens = self.plan.tokens_per_step
        record = {
            "step": self.step,
            "loss": float(loss_sum) / global_tokens,
            "aux_loss": float(aux),
            "grad_norm": float(grad_norm),
            "lr": lr,
            "tokens": tokens,
            "valid_tokens": global_valid,
            "tokens_per_s": tokens / elapsed,
            **self.throughput.fields(tokens, elapsed),
            "step_time_s": elapsed,
            "skipped_steps": self.skipped,
        }
        if counts is not None:
            record.update(load_summary(counts), dropped_tokens=int(dropped))
            every = self.cfg.moe.load_histogram_every
            if every and self.step % every == 0:  # per-layer per-expert token counts of this step
                record["expert_load"] = counts.round().long().tolist()
        return record

    def _forward_backward(self, local: Batch, global_tokens: int) -> tuple:
        """Every micro-batch's forward and backward: (loss_sum, aux, counts, dropped) of this rank
        (counts / dropped: None without MoE layers)."""
        t = self.cfg.train
        if self.pipeline is not None:  # the schedule runs every micro-batch's forward and backward
            loss_sum, aux, counts, dropped = self.pipeline.run(
                local, global_tokens
            )  # counts: this rank's layers
        else:
            coef, parts = self.model.arch.router_aux_loss_coef, micro_batches(local, t.micro_batch)
            # the balance definitions over the dp x cp group: one window of the whole step, or
            # one per micro-batch (runtime/step.py)
            if self.plan.balance in GROUP_BALANCE:
                sums = accumulate_global_balance(
                    parts,
                    self.sharding,
                    self.model,
                    global_tokens,
                    coef,
                    self.autocast,
                    self.ctx.dp_cp_group,
                    paired=self.plan.paired,
                    window=GROUP_BALANCE[self.plan.balance],
                )
            else:
                forward = lm_forward(
                    self.model,
                    global_tokens,
                    coef,
                    self.accum,
                    self.dp_size,
                    self.cp,
                    self.autocast,
                    balance=self.plan.balance,
                )
                sums = accumulate(parts, self.sharding, forward, paired=self.plan.paired)
            loss_sum, aux = sums["loss_sum"], sums["aux"] / (self.dp_size * self.cp)
            counts, dropped = sums.get("router_counts"), sums.get("router_dropped")
        return loss_sum, aux, counts, dropped

    def _skip_step(self) -> dict:
        """A global batch without a single loss token (all loss_mask false, one-token documents)
        has no gradient to follow: no forward, no update (the router and the weight decay stay
        untouched); the step is counted and logged as skipped, with loss null."""
        self.step += 1
        nan = float("nan")
        t = self.cfg.train
        return {
            "step": self.step,
            "loss": nan,
            "aux_loss": nan,
            "grad_norm": nan,
            "lr": lr_at(self.step - 1, t),
            "tokens": self.plan.tokens_per_step,
            "valid_tokens": 0,
            "tokens_per_s": 0.0,
            "step_time_s": 0.0,
            "skipped": True,
        }

    def _max_over_ranks(self, peak: int) -> int:
        """Peak bytes of the most loaded rank."""
        if self.ctx.distributed:
            t = torch.tensor([peak], dtype=torch.float64, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            peak = int(t.item())
        return peak

    def run(self) -> dict:
        with (
            emulation.maybe(self.cfg.train.emulate_cuda),
            configured_dispatch(self.cfg.primitives),
        ):
            return self._run()

    def _run(self) -> dict:
        t = self.cfg.train
        world = dist.group.WORLD if self.ctx.distributed else None
        # SIGTERM / SIGUSR1: stop at the next step boundary; one during the final save or the
        # export lets them finish and still ends the run as preempted (exit 128 + signal)
        with Preemption() as preemption:
            while self.step < t.steps:
                record = self.train_step()
                if self.eval_every and (self.step % self.eval_every == 0 or self.step == t.steps):
                    record.update(self.evaluate())
                if self.lock_watch is not None:  # before anything of this step is written
                    self.lock_watch.check(self.step)
                self.metrics.log(record)
                self.checkpoint.on_step(self.step)  # saves every train.save_every steps
                if self.step < t.steps and (signum := preemption.requested(world, self.device)):
                    path = (
                        self.checkpoint.save(self.step)
                        if self.checkpoint.last_saved != self.step
                        else self.checkpoint.last_path
                    )
                    raise Preempted(self.step, path, signum)
            self.checkpoint.on_end(self.step)  # final save
            signum = preemption.requested(world, self.device)  # before rank 0 exports alone
            if t.export_hf and self.rank == 0:  # the other ranks are done
                out = os.path.join(t.out_dir, "hf")
                # the run's own export directory; the paths it names are this run's config's
                tok, chat = run_tokenizer(dataclasses.asdict(self.cfg.data))
                export_checkpoint(
                    self.checkpoint.last_path,
                    out,
                    overwrite=True,
                    source=self.cfg.model.hf_path,
                    tokenizer=tok,
                    chat=chat,
                    root=t.out_dir,
                )
                self.checkpoint._say(
                    f"exported {self.checkpoint.last_path} as a Hugging Face model to {out}"
                )
            if signum := signum or preemption.requested():
                self.metrics.close()
                raise Preempted(self.step, self.checkpoint.last_path, signum, finished=True)
        summary = self.metrics.close()
        if self.source.stats:  # documents, rows, skipped / truncated / dropped records
            summary["data"] = self.source.stats
            if self.rank == 0:
                self.stream.write(f"bumblebee: {self.source.describe()}\n")
        return summary
