"""The learning-rate schedule: linear warmup, then cosine decay to ``min_lr``.

(The optimizer itself, AdamW over fp32 master parameters, belongs to the
sharding primitive, which decides where its state lives.)
"""

from __future__ import annotations

import math


def lr_at(step: int, train_cfg) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup to ``lr`` over
    ``warmup_steps``, then cosine decay to ``min_lr`` at the last step."""
    t = train_cfg
    if t.warmup_steps and step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    span = max(1, t.steps - 1 - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps) / span)
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1 + math.cos(math.pi * progress))


def set_lr(optimizer, lr: float) -> None:
    """Set the learning rate of every param group (an optimizer or a sharding wrapper)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
