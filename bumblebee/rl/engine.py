"""``bumblebee.Engine``: the training side of an RL loop, the surface an RL framework drives.

Rollouts come from elsewhere (an inference engine, or ``rl/sampler.py``); the
Engine scores them and updates the policy, on the layouts the runtime supports
(single process, or under torchrun: fsdp2 / zero1 data parallelism, expert and
context parallelism; not yet pipeline parallelism):

    engine = Engine(cfg, hf_path=None)               # model, sharding, optimizer (runtime pieces)
    lp = engine.compute_logprobs(batch, entropy=True)  # forward only, token-aligned [B, T]
    metrics = engine.train_step(batch, loss_fn=PolicyLoss(...))  # one optimizer step
    for name, tensor in engine.named_weights(): ...   # full HF-named tensors -> rollout engine
    engine.export_hf(dir); engine.save(dir); engine.load(dir); engine.offload(); engine.onload()

Every rank passes the same *global* batch (``rl/batch.py``: packed sequences, loss
mask, advantages, old/reference log-probs); the Engine gives each data-parallel rank
its rows (padding the batch with empty rows when it does not split evenly), each
context-parallel rank its zigzag share of those rows' tokens, and runs them in
micro-batches of ``train.micro_batch`` rows. Aggregation weights are computed
on the global batch first (``losses.aggregation_weights``), so each micro-batch's loss
is its exact share of the global loss and the summed gradients -- the sharding
primitives' convention -- are those of the full batch, whatever the layout.
Log-probs never materialize ``[tokens, vocab]`` (``losses.token_logprobs``).

Calls that touch the model are collective: every rank must make them, in the same order.
"""

from __future__ import annotations

import dataclasses
import io
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from bumblebee.config import Config, ConfigError
from bumblebee.models import resolve_arch
from bumblebee.models.hf import hf_state_dict, to_hf
from bumblebee.primitives.cp.layout import unshard_sequence
from bumblebee.primitives.parallel import ParallelGroups
from bumblebee.primitives.sharding.common import full_named_parameters, local
from bumblebee.rl.batch import IGNORE, OPTIONAL, RLBatch, has_prefix, prediction_view, shift_right
from bumblebee.rl.losses import PolicyInputs, PolicyLoss, token_logprobs
from bumblebee.runtime.checkpoint import Checkpointer, named_checkpoint
from bumblebee.runtime.resolve import resolve_layout
from bumblebee.runtime.optim import build_optimizer
from bumblebee.runtime.step import accumulate, autocast_for, balance_denominator, optimizer_tail, shard_rows
from bumblebee.runtime.trainer import (build_initial_model, build_parallel_context, build_sharding, pick_device,
                                       seed_everything)



@dataclass
class LogProbs:
    logprobs: torch.Tensor  # [B, T] log p(token | its prefix), 0 where there is no prefix
    entropy: torch.Tensor | None = None  # [B, T] entropy of the distribution the token came from


class _FullModel:
    """A model's architecture plus its full (gathered) parameters, as ``hf_state_dict`` reads them."""

    def __init__(self, arch, named):
        self.arch, self._named = arch, named

    def named_parameters(self):
        return self._named


def _all_gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


class Engine:
    """The policy under training on this rank's share of the layout ``cfg`` describes.

    ``hf_path``: start from a Hugging Face checkpoint (sets ``model.hf_path``; ``model.arch``
    overrides still apply), else from the config's initialization (``train.seed``).
    ``temperature``: the sampling temperature of the rollouts; log-probs, entropies and
    the update use ``softmax(logits / temperature)``. The optimizer is the runtime's
    AdamW (``runtime/optim.py``) (``train.lr``, betas, weight decay, ``train.clip_grad``); the
    learning rate follows ``train``'s schedule unless ``train_step(lr=...)`` sets it.
    """

    def __init__(self, cfg: Config, hf_path: str | None = None, *, device: torch.device | None = None,
                 temperature: float = 1.0):
        if hf_path:
            cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hf_path=hf_path))
        if temperature <= 0:
            raise ConfigError(f"temperature must be > 0, got {temperature}")
        if cfg.parallel.pp > 1:  # before the layout checks, whose pipeline messages would mislead
            raise ConfigError("the RL Engine does not support pipeline parallelism yet; use parallel.pp = 1")
        # the caller's batch is the global batch: train.global_batch only has to pass the runtime's check
        world = dist.get_world_size() if dist.is_initialized() else 1
        dp = resolve_layout(cfg.parallel, world, resolve_arch(cfg.model)).dp_shard
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, global_batch=dp * cfg.train.micro_batch))
        self.cfg, self.temperature = cfg, temperature
        self.device = device or pick_device()
        self.ctx = build_parallel_context(cfg, self.device)
        seed_everything(cfg.train.seed, cfg.train.deterministic)
        ctx = self.ctx
        model = build_initial_model(cfg, self.device, ParallelGroups(ep_group=ctx.ep_group, cp_group=ctx.cp_group))
        self.sharding = build_sharding(cfg, ctx)
        self.model = self.sharding.wrap(model)
        self.optimizer = build_optimizer(cfg.train, self.sharding)
        self.arch = self.model.arch
        self.autocast = autocast_for(self.device, cfg.train.dtype)
        self.step = 0
        self.offloaded = False

    # ------------------------------------------------------------------ rows of this rank
    @property
    def _dp(self) -> int:
        return self.ctx.layout.dp_shard

    def _local(self, P: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], int]:
        """This rank's part of the global batch: its data-parallel rows, and with CP its
        zigzag share of every row. The batch is padded first with empty rows (to split
        evenly over dp) and empty columns (a padding sequence, to split into 2 x cp chunks)."""
        B, T = P["input_ids"].shape
        cp = self.ctx.layout.cp
        rows, cols = -(-B // self._dp), T if cp == 1 else -(-T // (2 * cp)) * 2 * cp
        if rows * self._dp != B or cols != T:
            padded = {}
            for k, v in P.items():
                x = torch.full((rows * self._dp, cols), IGNORE if k == "targets" else 0, dtype=v.dtype,
                               device=v.device)
                x[:B, :T] = v
                padded[k] = x
            pos = padded["position_ids"]
            pos[B:] = torch.arange(cols, device=pos.device)
            pos[:B, T:] = torch.arange(cols - T, device=pos.device)  # restarts: a sequence of its own
            P = padded
        local = shard_rows(P, rows, self.ctx.dp_rank, cp, self.ctx.cp_rank)
        return {k: v.to(self.device) for k, v in local.items()}, rows

    def _micro_batches(self, local: dict[str, torch.Tensor], rows: int):
        m = self.cfg.train.micro_batch
        for i in range(0, rows, m):
            yield {k: v[i:i + m] for k, v in local.items()}

    def _scores(self, mb: dict[str, torch.Tensor], with_entropy: bool):
        """Forward one micro-batch: (logp [b, T], entropy [b, T] or None, balance loss)."""
        with self.autocast:
            h_BTH, aux = self.model.hidden_states(mb["input_ids"], mb["position_ids"])
            logp_T, ent_T = token_logprobs(h_BTH.reshape(-1, h_BTH.shape[-1]), self.model.lm_head_weight,
                                           mb["targets"].reshape(-1), temperature=self.temperature,
                                           with_entropy=with_entropy)
        shape = mb["targets"].shape
        return logp_T.view(shape), None if ent_T is None else ent_T.view(shape), aux

    def _check_onloaded(self) -> None:
        if self.offloaded:
            raise RuntimeError("the Engine is offloaded; call onload() before using the model")

    # ------------------------------------------------------------------ scoring
    @torch.no_grad()
    def compute_logprobs(self, batch: RLBatch, entropy: bool = False) -> LogProbs:
        """Token-aligned log-probs (and entropies) of ``batch`` under the current policy,
        forward only; the full [B, T] result on every rank, on the batch's device."""
        self._check_onloaded()
        local, rows = self._local(prediction_view(batch, None))
        parts = [self._scores(mb, entropy)[:2] for mb in self._micro_batches(local, rows)]
        out = [torch.cat([p[k] for p in parts]).float() for k in range(2 if entropy else 1)]
        if self.ctx.layout.cp > 1:  # the whole sequence of every local row
            out = [unshard_sequence(_all_gather(t, self.ctx.cp_group)) for t in out]
        if self._dp > 1:  # every rank gets every row
            out = [torch.cat(_all_gather(t, self.ctx.dense.get_group("dp_shard"))) for t in out]
        prefix = has_prefix(batch.position_ids).to(self.device)
        B, T = batch.input_ids.shape
        res = [torch.where(prefix, shift_right(t[:B, :T]), 0.0).to(batch.input_ids.device) for t in out]
        return LogProbs(res[0], res[1] if entropy else None)

    # ------------------------------------------------------------------ update
    def train_step(self, batch: RLBatch, loss_fn=None, *, lr: float | None = None) -> dict:
        """One optimizer step on ``batch`` (micro-batched); returns the step's metrics.
        ``loss_fn(PolicyInputs) -> (loss share, {name: sum over masked tokens})``, with
        attributes ``agg`` and ``needs_entropy`` (default: ``PolicyLoss()``, PPO/GRPO); it
        must return the same metric names for every micro-batch. Metrics: ``loss`` (the
        batch's aggregated loss), ``grad_norm`` (before clipping), ``lr``, ``tokens``
        (trained tokens), and each loss metric as a mean over trained tokens (PolicyLoss:
        ``clip_frac``, ``dual_clip_frac``, ``kl``, ``entropy``, ``approx_kl_old``)."""
        self._check_onloaded()
        loss_fn = loss_fn if loss_fn is not None else PolicyLoss()
        t, start = self.cfg.train, time.perf_counter()
        P = prediction_view(batch, getattr(loss_fn, "agg", "token-mean"))
        n_tokens = int((P["targets"] != IGNORE).sum())
        local, rows = self._local(P)
        parts = list(self._micro_batches(local, rows))
        denominator = balance_denominator(len(parts), self._dp, self.ctx.layout.cp)
        aux_scale = self.arch.router_aux_loss_coef / denominator  # d loss / d (one micro-batch's balance loss)

        def forward(mb):
            logp, ent, aux = self._scores(mb, getattr(loss_fn, "needs_entropy", False))
            mask = mb["targets"] != IGNORE
            loss, stats = loss_fn(PolicyInputs(logp, ent, mask, mb["weights"], *(mb.get(k) for k in OPTIONAL)))
            return loss + aux_scale * aux, {"loss": loss, **stats}

        stat_sums = accumulate(parts, self.sharding, forward)
        loss_sum = stat_sums.pop("loss")
        grad_norm, lr, _ = optimizer_tail(self.sharding, self.optimizer, t, self.step, lr=lr)
        self.step += 1
        names = sorted(stat_sums)
        totals = torch.stack([loss_sum] + [stat_sums[k] for k in names])
        if self.ctx.distributed:  # sums over every rank's tokens
            dist.all_reduce(totals, group=self.ctx.dp_cp_group)
        metrics = {"step": self.step, "loss": float(totals[0]), "grad_norm": float(grad_norm), "lr": lr,
                   "tokens": n_tokens}
        metrics.update({k: float(v) / max(n_tokens, 1) for k, v in zip(names, totals[1:])})  # token means
        metrics["step_time_s"] = time.perf_counter() - start
        return metrics

    # ------------------------------------------------------------------ weights out
    def named_weights(self, *, hf_names: bool = True):
        """Stream (name, full tensor) for every parameter: HF names (experts split per
        expert) by default, bumblebee names with ``hf_names=False``. Collective: every
        rank must iterate to the end. A tensor may share storage with the live parameter
        (replicated layouts): copy what you keep across an update."""
        self._check_onloaded()
        named = full_named_parameters(self.model, self.ctx.ep_group)
        return hf_state_dict(_FullModel(self.arch, named)) if hf_names else named

    def export_hf(self, out_dir: str) -> None:
        """Write a HF directory (config.json + safetensors) from rank 0. Collective."""
        if self.ctx.rank == 0:
            to_hf(_FullModel(self.arch, self.named_weights(hf_names=False)), out_dir)
        else:
            for _ in self.named_weights(hf_names=False):
                pass
        self._barrier()

    # ------------------------------------------------------------------ checkpoint and memory
    def _checkpointer(self, out_dir: str) -> Checkpointer:
        cfg = dataclasses.replace(self.cfg, train=dataclasses.replace(self.cfg.train, out_dir=out_dir))
        return Checkpointer(cfg, self.ctx, self.model, self.sharding, self.optimizer, stream=io.StringIO())

    def save(self, path: str) -> str:
        """Resumable state (parameters, optimizer state, step, RNG) as a runtime checkpoint,
        ``<path>/checkpoints/step_<N>`` (crash-safe; loads on any layout; the newest
        ``train.keep_last`` are kept). Returns its directory. Collective."""
        self._check_onloaded()
        return self._checkpointer(path).save(self.step)

    def load(self, path: str) -> None:
        """Restore a checkpoint directory, or the newest complete one under ``path`` (what
        ``save`` wrote, or a ``bumblebee train`` run directory). Collective."""
        self._check_onloaded()
        self.step = self._checkpointer(self.cfg.train.out_dir).load(named_checkpoint(path))

    @torch.no_grad()
    def offload(self) -> None:
        """Move parameters and optimizer state to host memory (e.g. while rollouts run)."""
        self._move(torch.device("cpu"))
        self.offloaded = True
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @torch.no_grad()
    def onload(self) -> None:
        self._move(self.device)
        self.offloaded = False

    def _move(self, device: torch.device) -> None:
        """Parameters (``Module.to`` keeps every Parameter object, and FSDP2 re-registers its
        shards in ``_apply``), optimizer state, and optimizer-only parameters (zero1's fp32
        master slices); scalar step counters stay where the optimizer keeps them."""
        if any(local(p).device != device for p in self.model.parameters()):
            self.model.to(device)
        own = {id(p) for p in self.model.parameters()}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in own and p.device != device:
                    p.data = p.data.to(device)
        for entry in self.optimizer.state.values():
            for k, v in entry.items():
                if torch.is_tensor(v) and v.dim() > 0 and local(v).device != device:
                    entry[k] = v.to(device)

    def _barrier(self) -> None:
        if self.ctx.distributed:
            dist.barrier()
