"""The embedded end-to-end RL run behind ``bumblebee rl``: warm-up, then GRPO.

1. A tiny model gets a short supervised warm-up on a built-in task (``rl/toy.py``),
   through ``Engine.train_step`` with a token NLL loss; the result is exported
   (``Engine.export_hf``) and becomes the reference policy of the KL penalty (and, with
   ``model.lora.rank > 0``, the frozen base whose LoRA adapters GRPO trains).
2. GRPO (Shao et al. 2024): per step, ``prompts_per_step`` problems, ``group_size``
   samples each from the built-in sampler (weights pushed from the Engine in
   ``weight_buckets``), exact rewards, group-normalized advantages, old and reference
   log-probs from ``compute_logprobs``, then ``updates_per_step`` PPO-clipped updates
   (Schulman et al. 2017) on row mini-batches of the rollout batch, each through the
   engine-level surface: every dp rank's own rows through ``forward_backward``, then
   ``optimizer_step``.

Every step writes one line of ``metrics.jsonl`` (phase, reward, accuracy, kl,
entropy, clip fraction, the rollout ratio ``pi_train / pi_rollout`` of the sampler's
tokens: ``is_ratio_*``, ...); ``rl.tis`` / ``rl.mis`` correct for it. Greedy accuracy
on a fixed held-out set is measured after the warm-up and at the end. RL settings live
in ``RLConfig`` (``--set rl.key=value`` or an ``[rl]`` table in the config file); the
rest is the ordinary run config.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import IO

import torch
import torch.distributed as dist

from bumblebee import safe_write
from bumblebee.config import Config, LoraConfig
from bumblebee.config_parse import dump_toml
from bumblebee.models import build_model
from bumblebee.rl.engine import Engine
from bumblebee.rl.losses import (
    TokenNLL,
    grpo_advantages,
)
from bumblebee.rl.rl_config import RLConfig
from bumblebee.rl.sampler import Sampler
from bumblebee.rl.toy import EOS, make_task, rollout_batch, supervised_batch
from bumblebee.runtime.launch.outdir import LockWatch
from bumblebee.runtime.metrics import json_line


class _Log:
    """metrics.jsonl and a progress line, on rank 0 only."""

    def __init__(self, out_dir: str, active: bool, stream: IO):
        self.active, self.stream, self.records = active, stream, []
        # the run stops if its out_dir lock vanishes (the directory deleted, maybe reused)
        self.watch = LockWatch(out_dir) if active else None
        if active:
            safe_write.make_dirs(out_dir)
            self.path = os.path.join(out_dir, "metrics.jsonl")
            self.file = safe_write.RecordFile(self.path, doing="write the metrics")

    def __call__(self, record: dict, line: str | None = None) -> None:
        if not self.active:
            return
        self.watch.check(record.get("step", 0))
        self.records.append(record)
        self.file.append(json_line(record) + "\n")
        if line:
            self.stream.write(line + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self.active:
            self.file.close()


def _broadcast(obj, ctx):
    if not ctx.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _push_weights(engine: Engine, sampler: Sampler | None) -> None:
    """Engine -> rollout model in weight buckets (collective: every rank walks the gathered buckets)."""
    named = (t for bucket in engine.weight_buckets(dtype=None, names="bumblebee") for t in bucket)
    if sampler is not None:
        sampler.load_weights(named)
    else:
        for _ in named:
            pass


def _update(engine: Engine, batch, loss_fn, lr: float) -> dict:
    """One policy update through the engine-level surface: every dp rank passes its own rows."""
    dp, rank = engine.get_data_parallel_size(), engine.get_data_parallel_rank()
    rows = -(-batch.rows // dp)
    local = batch.select_rows(rank * rows, min((rank + 1) * rows, batch.rows))
    with engine.train_mode():
        out = engine.forward_backward(local, loss_fn)
        opt = engine.optimizer_step(lr=lr)
    return {"loss": out.loss, "grad_norm": opt["grad_norm"], **out.metrics}


def _evaluate(sampler, task, problems, rl: RLConfig) -> dict:
    """Greedy exact-match rate, and mean reward of ``eval_samples`` samples per problem at the
    training temperature, on a fixed problem set with a fixed sampling seed (low-noise figures)."""
    prompts = [p.prompt for p in problems]
    greedy = sampler.generate(prompts, max_new_tokens=rl.max_new_tokens, temperature=0, eos_id=EOS)
    sampled = sampler.generate(
        prompts,
        group_size=rl.eval_samples,
        max_new_tokens=rl.max_new_tokens,
        temperature=rl.temperature,
        eos_id=EOS,
        generator=torch.Generator().manual_seed(rl.seed + 17),
    )
    rewards = [
        task.reward(problems[i // rl.eval_samples], c) for i, c in enumerate(sampled.completions)
    ]
    return {
        "greedy_accuracy": sum(c == p.answer for p, c in zip(problems, greedy.completions))
        / len(problems),
        "reward": sum(rewards) / len(rewards),
    }


def _grpo_step(
    step: int, engine: Engine, reference: Engine, sampler, task, rl: RLConfig, loss_fn, g
) -> dict:
    """Sample groups, score them, ``updates_per_step`` PPO updates; one metrics record."""
    t0 = time.perf_counter()
    problems = task.sample(rl.prompts_per_step, g)
    ro = (
        sampler.generate(
            [p.prompt for p in problems],
            group_size=rl.group_size,
            max_new_tokens=rl.max_new_tokens,
            temperature=rl.temperature,
            eos_id=EOS,
            generator=torch.Generator().manual_seed(rl.seed * 7919 + step),
        )
        if sampler
        else None
    )
    ro = _broadcast(ro, engine.ctx)  # rank 0 samples, every rank trains on the same global batch
    rewards = [task.reward(problems[i // rl.group_size], c) for i, c in enumerate(ro.completions)]
    batch = rollout_batch(
        ro.prompts,
        ro.completions,
        rl.seq_len,
        advantages=grpo_advantages(rewards, rl.group_size).tolist(),
        # the sampler's log-probs of its tokens, token-aligned (0 on the prompt): pi_rollout
        rollout_logprobs=[[0.0] * len(p) + lp for p, lp in zip(ro.prompts, ro.logprobs)],
    )
    old = engine.compute_logprobs(batch).logprobs
    batch = batch.replace(old_logprobs=old, ref_logprobs=reference.compute_logprobs(batch).logprobs)
    # the sampler's log-probs of its own tokens vs the Engine's (KV cache vs packed forward)
    trained = batch.loss_mask
    mismatch = (old - batch.rollout_logprobs)[trained].abs().max() if trained.any() else 0.0
    per_update = -(-batch.rows // rl.updates_per_step)
    ms = [
        _update(engine, batch.select_rows(i, i + per_update), loss_fn, rl.lr)
        for i in range(0, batch.rows, per_update)
    ]
    _push_weights(engine, sampler)
    mean = lambda k: sum(m[k] for m in ms) / len(ms)  # noqa: E731
    is_keys = [k for k in ms[0] if k.startswith("is_")]  # rollout-correction figures
    return {
        "phase": "grpo",
        "step": step,
        "reward": sum(rewards) / len(rewards),
        "reward_std": float(torch.tensor(rewards).std()),
        "accuracy": sum(r == 1.0 for r in rewards) / len(rewards),
        **{
            k: mean(k)
            for k in (
                "kl",
                "entropy",
                "clip_frac",
                "dual_clip_frac",
                "approx_kl_old",
                "loss",
                "grad_norm",
            )
        },
        **{k: max(m[k] for m in ms) if k.endswith("_max") else mean(k) for k in is_keys},
        "lr": rl.lr,
        "response_len": sum(len(c) for c in ro.completions) / len(ro.completions),
        "rollout_logprob_err": float(mismatch),
        "step_time_s": time.perf_counter() - t0,
    }


def run(cfg: Config, rl: RLConfig, *, stream: IO | None = None) -> dict:
    """Warm-up + GRPO; returns a summary (reward per step, held-out evaluation before/after)."""
    rl.validate()
    stream = stream or sys.stdout
    start = time.perf_counter()
    # --lora: the warm-up trains the whole model (the base a LoRA run starts from), GRPO then
    # trains adapters on it with the base frozen
    base_cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, lora=LoraConfig()))
    engine = Engine(base_cfg, temperature=rl.temperature)
    ctx, out_dir = engine.ctx, cfg.train.out_dir
    ref_dir = os.path.join(out_dir, "reference")
    if ctx.rank == 0:  # before the warm-up: a link planted where the reference goes is refused
        safe_write.refuse_links(ref_dir)
    log = _Log(out_dir, ctx.rank == 0, stream)
    if ctx.rank == 0:
        safe_write.write_file(
            os.path.join(out_dir, "config.toml"),
            dump_toml(cfg)
            + "[rl]\n"
            + "".join(f"{k} = {json.dumps(v)}\n" for k, v in dataclasses.asdict(rl).items()),
            doing="write the config",
        )
    task = make_task(rl.task, rl.digits, rl.partial)
    g = torch.Generator().manual_seed(rl.seed)
    eval_set = task.sample(rl.eval_problems, torch.Generator().manual_seed(rl.seed + 1_000_003))
    sampler = (
        Sampler(
            build_model(engine.arch, dataclasses.replace(cfg.primitives, moe_comm="local")).to(
                engine.device
            )
        )
        if ctx.rank == 0
        else None
    )  # the rollout side: a full copy on rank 0

    for step in range(1, rl.warmup_steps + 1):  # 1. supervised warm-up
        m = engine.train_step(
            supervised_batch(task.sample(rl.warmup_batch, g), rl.seq_len),
            TokenNLL(),
            lr=rl.warmup_lr,
        )
        log(
            {"phase": "warmup", "step": step, "loss": m["loss"], "grad_norm": m["grad_norm"]},
            f"warmup {step}/{rl.warmup_steps}  loss {m['loss']:.4f}"
            if step % 10 == 0 or step == 1
            else None,
        )
    engine.export_hf(ref_dir, root=out_dir)  # a link planted at reference/ is refused
    reference = Engine(
        base_cfg, hf_path=ref_dir, temperature=rl.temperature
    )  # KL is tracked even at kl_coef = 0
    if cfg.model.lora.rank:  # the policy: adapters (B = 0: equal to the base) on the warmed-up base
        del engine
        engine = Engine(cfg, hf_path=ref_dir, temperature=rl.temperature)
    _push_weights(engine, sampler)
    before = (
        _broadcast(_evaluate(sampler, task, eval_set, rl) if sampler else None, ctx)
        if eval_set
        else None
    )
    if before:
        log(
            {"phase": "eval", "step": 0, **before},
            f"eval after warm-up: reward {before['reward']:.3f}  "
            f"greedy accuracy {before['greedy_accuracy']:.3f}",
        )

    loss_fn, rewards_per_step = rl.loss(), []
    for step in range(1, rl.steps + 1):  # 2. GRPO
        rec = _grpo_step(step, engine, reference, sampler, task, rl, loss_fn, g)
        rewards_per_step.append(rec["reward"])
        log(
            rec,
            f"grpo {step}/{rl.steps}  reward {rec['reward']:.3f}  acc {rec['accuracy']:.3f}  "
            f"kl {rec['kl']:.4f}  entropy {rec['entropy']:.3f}  clip {rec['clip_frac']:.3f}  "
            f"({rec['step_time_s']:.1f}s)",
        )
    after = (
        _broadcast(_evaluate(sampler, task, eval_set, rl) if sampler else None, ctx)
        if eval_set
        else None
    )
    if after:
        log({"phase": "eval", "step": rl.steps, **after}, None)
    k = max(1, len(rewards_per_step) // 10)
    summary = {
        "rewards": rewards_per_step,
        "eval_before": before,
        "eval_after": after,
        "reward_first": sum(rewards_per_step[:k]) / k if rewards_per_step else None,
        "reward_last": sum(rewards_per_step[-k:]) / k if rewards_per_step else None,
        "wall_time_s": time.perf_counter() - start,
    }
    if ctx.rank == 0 and rewards_per_step:
        ev = (
            (
                f"; held-out reward {before['reward']:.3f} -> {after['reward']:.3f}, greedy accuracy "
                f"{before['greedy_accuracy']:.3f} -> {after['greedy_accuracy']:.3f}"
            )
            if eval_set
            else ""
        )
        stream.write(
            f"done: mean reward {summary['reward_first']:.3f} -> {summary['reward_last']:.3f} "
            f"(first/last {k} steps){ev}; {summary['wall_time_s']:.0f}s; metrics in {log.path}\n"
        )
    log.close()
    return summary
