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

from bumblebee.config import Config, ConfigError, dump_toml
from bumblebee.data import build_source
from bumblebee.models import build_model, resolve_arch
from bumblebee.runtime.metrics import MetricsWriter
from bumblebee.runtime.optim import build_optimizer, lr_at, set_lr


def pick_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def seed_everything(seed: int, deterministic: bool) -> None:
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=False)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def build_initial_model(cfg: Config, device: torch.device):
    """The model a config describes, initialized identically on every rank (same seed),
    or loaded from ``model.hf_path``."""
    arch = resolve_arch(cfg.model)
    torch.manual_seed(cfg.train.seed)
    if cfg.model.hf_path:
        from bumblebee.models.hf import load_hf_weights

        model = build_model(arch, cfg.primitives)
        load_hf_weights(model, cfg.model.hf_path)
    else:
        model = build_model(arch, cfg.primitives)
    return model.to(device)


class Trainer:
    def __init__(self, cfg: Config, *, stream=sys.stdout):
        self.cfg = cfg
        t = cfg.train
        self.device = pick_device()
        self.dp_rank, self.dp_size = 0, 1
        rows_per_rank, rem = divmod(t.global_batch, self.dp_size)
        if rem or rows_per_rank % t.micro_batch:
            raise ConfigError(f"train.global_batch ({t.global_batch}) must be a multiple of data-parallel size "
                              f"({self.dp_size}) x train.micro_batch ({t.micro_batch})")
        self.rows_per_rank = rows_per_rank
        self.accum = rows_per_rank // t.micro_batch
        seed_everything(t.seed, t.deterministic)
        self.model = build_initial_model(cfg, self.device)
        self.optimizer = build_optimizer(self.model, t)
        self.source = build_source(cfg.data, t, self.model.arch.vocab_size)
        self.autocast = (torch.autocast(self.device.type, dtype=torch.bfloat16) if t.dtype == "bfloat16"
                         else contextlib.nullcontext())
        self.step = 0
        os.makedirs(t.out_dir, exist_ok=True)
        with open(os.path.join(t.out_dir, "config.toml"), "w") as f:
            f.write(dump_toml(cfg))
        self.metrics = MetricsWriter(t.out_dir, total_steps=t.steps, log_every=t.log_every, stream=stream)

    def train_step(self) -> dict:
        t, model = self.cfg.train, self.model
        start = time.perf_counter()
        reset_peak_memory(self.device)
        batch = self.source.global_batch_at(self.step)
        global_tokens = max(batch.num_valid, 1)
        local = batch.rows(self.dp_rank * self.rows_per_rank, (self.dp_rank + 1) * self.rows_per_rank)
        local = local.to(self.device)
        coef = model.arch.router_aux_loss_coef
        loss_sum = torch.zeros((), device=self.device)
        aux_sum = torch.zeros((), device=self.device)
        for i in range(self.accum):
            mb = local.rows(i * t.micro_batch, (i + 1) * t.micro_batch)
            with self.autocast:
                terms = model.loss_terms(mb.input_ids, mb.labels, mb.position_ids)
            loss = terms.loss_sum / global_tokens + coef * terms.aux_loss / self.accum
            loss.backward()
            loss_sum += terms.loss_sum.detach().float()
            aux_sum += terms.aux_loss.detach() / self.accum
        max_norm = t.clip_grad if t.clip_grad > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        lr = lr_at(self.step, t)
        set_lr(self.optimizer, lr)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        elapsed = time.perf_counter() - start
        tokens = batch.input_ids.numel()
        return {
            "step": self.step,
            "loss": float(loss_sum) / global_tokens,
            "aux_loss": float(aux_sum),
            "grad_norm": float(grad_norm),
            "lr": lr,
            "tokens": tokens,
            "valid_tokens": batch.num_valid,
            "tokens_per_s": tokens / elapsed,
            "step_time_s": elapsed,
            "peak_mem_bytes": peak_memory(self.device),
        }

    def run(self) -> dict:
        while self.step < self.cfg.train.steps:
            self.metrics.log(self.train_step())
        return self.metrics.close()


# ------------------------------------------------------------------------------ memory figures
def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> int:
    """Peak bytes: the CUDA allocator's peak on GPU; the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
