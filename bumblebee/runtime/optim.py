"""AdamW and the warmup + cosine learning-rate schedule.

Parameters are fp32 (the master copy); bf16 only appears in compute through
autocast (or FSDP2's mixed-precision policy). Weight decay applies to matrices
and stacked expert weights, not to norms.
"""

from __future__ import annotations

import math

import torch


def build_optimizer(model: torch.nn.Module, train_cfg) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": train_cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=train_cfg.lr, betas=(train_cfg.beta1, train_cfg.beta2),
                             eps=train_cfg.eps)


def lr_at(step: int, train_cfg) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup to ``lr`` over
    ``warmup_steps``, then cosine decay to ``min_lr`` at the last step."""
    t = train_cfg
    if t.warmup_steps and step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    span = max(1, t.steps - 1 - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps) / span)
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
