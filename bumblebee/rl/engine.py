"""``bumblebee.Engine``: the training side of an RL loop, the surface an RL framework drives.

Rollouts come from elsewhere (an inference engine, or ``rl/sampler.py``); the Engine scores
them and updates the policy on the layouts the runtime supports (single process, or under
torchrun: fsdp2 / zero1 data parallelism, expert, context and pipeline parallelism -- the last
through the runtime's schedule with a policy head on the last stage, rl/pipeline.py). Two
levels, the second built on the first:

    # what a framework (verl's engine workers, ...) calls, each dp rank with its own rows
    with engine.train_mode():
        engine.zero_grad()
        out = engine.forward_backward(local_batch, loss_fn)   # micro-batches, loss callback, metrics
        norm = engine.optimizer_step()                        # clip, scheduled LR, update, zero
    out = engine.forward_backward(local_batch, None, forward_only=True).logprobs
    engine.get_data_parallel_rank() / _size() / _group()

    # every rank passes the same global batch (its rows are cut here)
    lp = engine.compute_logprobs(batch, entropy=True)
    metrics = engine.train_step(batch, loss_fn=PolicyLoss(...))

Rank-local batches and micro-batches: ``rl/forward.py``.

Routers with a selection bias (``sigmoid_bias``) move it after each applied ``optimizer_step``
by the global expert load of the training forwards since the last step, as the Trainer does
(``runtime.step.ExpertLoad``). Multi-token-prediction modules are carried, not trained
(``mtp.depth`` is 0 here: the policy is the next-token model); exports write them as held.

Weights out (``rl/weights.py``): ``weight_buckets`` (bucketed, HF-named, for a rollout
engine), ``named_weights``, ``export_hf`` (merged with LoRA adapters); ``export_peft`` writes the
adapters themselves (``rl/adapters.py``). Memory (``rl/offload.py``): ``offload`` /
``onload`` by part. Calls that touch the model are collective: every rank makes them, in order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch
import torch.distributed as dist

from bumblebee.config import Config, ConfigError
from bumblebee.primitives.replay_check import ReplayCheck
from bumblebee.rl.adapters import EngineAdapters
from bumblebee.rl.checkpoint import EngineCheckpoints
from bumblebee.rl.forward import EngineForward, ForwardOutput  # noqa: F401 (ForwardOutput: public)
from bumblebee.rl.offload import Offloader
from bumblebee.rl.split_batch import EngineSplitBatch, LogProbs  # noqa: F401 (LogProbs: public)
from bumblebee.rl.weights import EngineWeights
from bumblebee.runtime.build import build_run, check_world, pick_device
from bumblebee.runtime.optim import check_lr
from bumblebee.runtime.step import ExpertLoad, optimizer_tail

# vLLM clamps a sampling temperature below 1e-2 up to it (smaller ones cause numerical errors); at
# 1e-20 the training log-probs' 1/temperature scale turns the first step's gradient into NaN
MIN_TEMPERATURE = 1e-2


def check_temperature(value, name: str = "temperature") -> None:
    """A training temperature is a finite number >= MIN_TEMPERATURE (0, greedy, is for sampling only)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < MIN_TEMPERATURE
    ):
        raise ConfigError(
            f"{name} must be a finite number >= {MIN_TEMPERATURE} (greedy sampling, 0, has no "
            f"log-probs to train on), got {value!r}"
        )


class Engine(EngineForward, EngineSplitBatch, EngineWeights, EngineAdapters, EngineCheckpoints):
    """The policy under training on this rank's share of the layout ``cfg`` describes.

    ``hf_path``: start from a Hugging Face checkpoint (sets ``model.hf_path``; ``model.arch``
    overrides still apply), else from the config's initialization (``train.seed``).
    ``temperature``: the sampling temperature of the rollouts; log-probs, entropies and
    the update use ``softmax(logits / temperature)``. The optimizer is the runtime's AdamW
    (``runtime/optim.py``); the learning rate follows ``train``'s schedule unless a call sets it.
    ``max_tokens_per_micro_batch``: micro-batch by a token budget instead of by rows.
    """

    def __init__(
        self,
        cfg: Config,
        hf_path: str | None = None,
        *,
        device: torch.device | None = None,
        temperature: float = 1.0,
        max_tokens_per_micro_batch: int | None = None,
    ):
        if hf_path:
            cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hf_path=hf_path))
        check_temperature(temperature)
        if max_tokens_per_micro_batch is not None and max_tokens_per_micro_batch < 1:
            raise ConfigError(
                f"max_tokens_per_micro_batch must be >= 1, got {max_tokens_per_micro_batch}"
            )
        pp = cfg.parallel.pp
        if pp > 1 and max_tokens_per_micro_batch is not None:
            raise ConfigError(
                "max_tokens_per_micro_batch needs parallel.pp = 1 (pipeline stages run fixed shapes)"
            )
        if pp > 1 and cfg.train.balance not in ("auto", "micro_batch"):  # what the stages compute
            raise ConfigError(
                f"train.balance = '{cfg.train.balance}' cannot run under a pipeline schedule "
                "(parallel.pp > 1): set 'micro_batch' or 'auto'"
            )
        # the policy is the next-token model: MTP modules are carried (exported as held) but not trained
        cfg = dataclasses.replace(cfg, mtp=dataclasses.replace(cfg.mtp, depth=0))
        self.cfg, self.temperature, self.max_tokens_per_micro_batch = (
            cfg,
            temperature,
            max_tokens_per_micro_batch,
        )
        self.device = device or pick_device()
        # the caller's batch is the batch, not train.global_batch: the plan is checked for one
        # schedule run of rows per rank (with pp > 1: pp_microbatches micro-batches, default pp)
        m = (cfg.primitives.pp_microbatches or pp) if pp > 1 else 1
        self.plan = plan = check_world(
            cfg, rows_per_rank=cfg.train.micro_batch * m, device=self.device.type
        )

        def pipeline(*args):  # this rank's stages with a policy head on the last (rl/pipeline.py)
            from bumblebee.rl.pipeline import EnginePipeline

            return EnginePipeline(*args, temperature)

        run = build_run(cfg, plan, self.device, pipeline)
        self.ctx, self.pipeline, self.sharding = run.ctx, run.pipeline, run.sharding
        self.model, self.optimizer, self.autocast = run.model, run.optimizer, run.autocast
        self.arch = self.model.arch
        self.step = 0
        # the losses of the forward_backward calls since the last optimizer_step (global, identical
        # on every rank): a non-finite one stops or skips the update as train.on_nonfinite says
        self.step_loss = 0.0
        self.weight_version = 0  # bumped by every applied optimizer step (rl/weights.py)
        self.offloader = Offloader(self)
        self.expert_load = ExpertLoad(
            self.model
        )  # expert counts of the training forwards, for sigmoid_bias routers
        # the recomputes' routing checks of the forwards since the last update (replay_check.py)
        self.replay_check = ReplayCheck()
        self.hf_prefixes = self._source_prefixes(cfg.model.hf_path)

    # ------------------------------------------------------------------ data parallelism
    def get_data_parallel_rank(self) -> int:
        return self.ctx.dp_rank

    def get_data_parallel_size(self) -> int:
        return self.ctx.layout.dp_shard

    def get_data_parallel_group(self):
        """The process group over which rank-local batches differ (None on one process)."""
        return self.ctx.dp_group if self._dp > 1 else None

    @property
    def _dp(self) -> int:
        return self.ctx.layout.dp_shard

    def _dp_sum(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        if self._dp > 1:
            dist.all_reduce(t, op=op, group=self.get_data_parallel_group())
        return t

    @contextlib.contextmanager
    def train_mode(self):
        """Onload what an update needs (restored on exit) and put the model in training mode."""
        with self.offloader.onloaded(params=True, grads=True, optimizer=True):
            self.model.train()
            yield self

    @contextlib.contextmanager
    def eval_mode(self):
        """Onload the parameters (restored on exit) and put the model in evaluation mode."""
        with self.offloader.onloaded(params=True, grads=False, optimizer=False):
            self.model.eval()
            try:
                yield self
            finally:
                self.model.train()

    def optimizer_step(self, lr: float | None = None) -> dict:
        """Reduce, clip, set the scheduled LR (or ``lr``), update, zero the gradients
        (runtime/step.py's tail). Returns ``grad_norm`` (before clipping) and ``lr``."""
        check_lr(lr)  # before anything moves: a refused call leaves the gradients for a retry
        self.offloader.require("params", "grads", "optimizer")
        pp = self.pipeline is not None
        grad_norm, lr, applied = optimizer_tail(
            self.sharding,
            self.optimizer,
            self.cfg.train,
            self.step,
            lr=lr,
            loss=self.step_loss,
            pp_group=self.ctx.pp_group if pp else None,
            params=self.model.parameters() if pp else None,
            replay=self.replay_check,
        )
        self.step_loss = 0.0
        # routers with a selection bias move it by the step's global expert load (as the Trainer)
        self.expert_load.update_bias(
            self.cfg.moe.bias_update_rate,
            applied,
            None if pp else self.ctx.dp_cp_group,
            self.ctx.distributed,
            self.device,
        )
        self.step += 1
        self.weight_version += int(applied)
        return {"grad_norm": float(grad_norm), "lr": lr, "applied": applied}

    def zero_grad(self) -> None:
        self.sharding.zero_grad(self.optimizer)
        self.step_loss = 0.0
        self.expert_load.counts = None  # the expert load of the dropped gradients goes with them

    # ------------------------------------------------------------------ memory
    def offload(
        self,
        params: bool = True,
        grads: bool = True,
        optimizer: bool = True,
        *,
        device: torch.device | None = None,
    ) -> dict:
        """Move the chosen parts to host memory (``device``, default the CPU); returns the bytes
        moved per part and what stays on the compute device (``rl/offload.py``)."""
        return self.offloader.offload(
            params=params, grads=grads, optimizer=optimizer, device=device
        )

    def onload(self, params: bool = True, grads: bool = True, optimizer: bool = True) -> dict:
        return self.offloader.onload(params=params, grads=grads, optimizer=optimizer)

    @property
    def offloaded(self) -> bool:
        return bool(self.offloader.away)

    def _barrier(self) -> None:
        if self.ctx.distributed:
            dist.barrier()
