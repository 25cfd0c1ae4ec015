"""``RLConfig``: the settings of ``bumblebee rl`` (``--set rl.key=value`` or an ``[rl]`` table in
the config file), each checked before the warm-up runs; ``loss()`` builds the GRPO policy loss."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from bumblebee.config import ConfigError
from bumblebee.config_checks import check_int_range
from bumblebee.rl.engine import check_temperature
from bumblebee.rl.losses import AGGREGATIONS, IS_LEVELS, KL_ESTIMATORS, PolicyLoss
from bumblebee.rl.toy import TASKS


@dataclass(kw_only=True)
class RLConfig:
    task: str = "reverse"  # reverse | add
    digits: int = 3  # reverse: 1..digits+1 letters; add: operands of 1..digits digits
    partial: float = 0.0  # reward for a wrong answer: partial x fraction of characters right
    warmup_steps: int = 60  # supervised steps before RL
    warmup_batch: int = 64  # problems per warm-up step
    warmup_lr: float = 3e-3
    steps: int = 100  # GRPO steps
    prompts_per_step: int = 32
    group_size: int = 8
    max_new_tokens: int = 6
    temperature: float = 1.0
    lr: float = 3e-4
    updates_per_step: int = 2  # PPO mini-batches per rollout batch
    clip_low: float = 0.2
    clip_high: float = 0.28  # "clip-higher" (asymmetric upper bound)
    dual_clip: float = 3.0  # 0 disables
    kl_coef: float = 0.01
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    agg: str = "token-mean"
    # rollout correction on pi_train / pi_rollout (losses.rollout_correction); 0 disables
    tis: float = 0.0  # truncated importance sampling cap C: weight min(rho, C)
    mis: float = 0.0  # masked importance sampling cap C: weight rho, 0 where rho > C
    is_level: str = "token"  # token | sequence (rho of a sequence: product of its token ratios)
    seq_len: int = 128  # row length rollouts are packed into
    eval_problems: int = 128  # held-out problems, evaluated after the warm-up and at the end
    eval_samples: int = 4  # samples per held-out problem for the evaluation reward
    seed: int = 0

    def validate(self) -> None:
        if self.task not in TASKS:
            raise ConfigError(f"rl.task must be one of {', '.join(TASKS)}, got {self.task!r}")
        for name in (
            "digits",
            "warmup_batch",
            "prompts_per_step",
            "group_size",
            "max_new_tokens",
            "updates_per_step",
            "seq_len",
            "eval_samples",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"rl.{name} must be >= 1, got {getattr(self, name)}")
        for name in (
            "warmup_steps",
            "steps",
            "eval_problems",
            "kl_coef",
            "entropy_coef",
            "partial",
            "tis",
            "mis",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"rl.{name} must be >= 0, got {getattr(self, name)}")
        if self.lr <= 0 or self.warmup_lr <= 0:
            raise ConfigError("rl.lr and rl.warmup_lr must be > 0")
        if self.dual_clip and self.dual_clip <= 1:
            raise ConfigError(f"rl.dual_clip must be > 1 (or 0 to disable), got {self.dual_clip}")
        if self.agg not in AGGREGATIONS or self.kl_estimator not in KL_ESTIMATORS:
            raise ConfigError(
                f"rl.agg must be one of {AGGREGATIONS} and rl.kl_estimator one of {KL_ESTIMATORS}"
            )
        for name in ("tis", "mis"):
            if getattr(self, name) and getattr(self, name) <= 1:
                raise ConfigError(
                    f"rl.{name} must be > 1 (or 0 to disable), got {getattr(self, name)}"
                )
        if self.tis and self.mis:
            raise ConfigError("set at most one of rl.tis and rl.mis")
        if self.is_level not in IS_LEVELS:
            raise ConfigError(f"rl.is_level must be one of {IS_LEVELS}, got {self.is_level!r}")
        if self.group_size < 2:
            raise ConfigError("rl.group_size must be >= 2 (GRPO normalizes within a group)")
        self.validate_ranges()

    def validate_ranges(self) -> None:
        """Finite numbers, PPO clip bounds, and a task that fits the row length: everything
        that would otherwise fail only after the warm-up has run."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"rl.{f.name} must be a finite number, got {value}")
        check_int_range("rl", self)
        check_temperature(self.temperature, "rl.temperature")
        if not 0 <= self.clip_low < 1 or self.clip_high < 0:
            raise ConfigError(
                f"rl.clip_low must be in [0, 1) and rl.clip_high >= 0 (the ratio is clipped to "
                f"[1 - clip_low, 1 + clip_high]), got {self.clip_low}, {self.clip_high}"
            )
        if self.partial > 1:
            raise ConfigError(
                f"rl.partial must be in [0, 1] (a wrong answer's reward), got {self.partial}"
            )
        task = TASKS[self.task]
        if self.digits > task.max_digits:
            raise ConfigError(
                f"rl.digits must be <= {task.max_digits} for task {self.task!r}, got {self.digits}"
            )
        prompt, answer = task.longest(self.digits)
        need = max(prompt + answer, prompt + self.max_new_tokens)
        if self.seq_len < need:
            raise ConfigError(
                f"rl.seq_len = {self.seq_len} is shorter than the longest {self.task!r} sequence with "
                f"digits = {self.digits}: {prompt} prompt + max({answer} answer, {self.max_new_tokens} "
                f"max_new_tokens) = {need} tokens"
            )
        if self.max_new_tokens < answer:
            raise ConfigError(
                f"rl.max_new_tokens = {self.max_new_tokens} cannot produce the longest answer of "
                f"{answer} tokens (with its end token): its reward would always be 0"
            )
        try:
            self.loss()
        except ValueError as e:
            raise ConfigError(f"rl: {e}") from None

    def loss(self) -> PolicyLoss:
        return PolicyLoss(
            clip_low=self.clip_low,
            clip_high=self.clip_high,
            dual_clip=self.dual_clip or None,
            kl_coef=self.kl_coef,
            kl_estimator=self.kl_estimator,
            entropy_coef=self.entropy_coef,
            agg=self.agg,
            tis=self.tis or None,
            mis=self.mis or None,
            is_level=self.is_level,
        )
