"""No sharding (slot ``sharding``, ``none``): one process holds everything.

Also what ``fsdp2`` and ``zero1`` reduce to on a single process, where there is
nothing to shard.
"""

from __future__ import annotations

import torch

from bumblebee.primitives.sharding.common import ShardingGroups, state_bytes
from bumblebee.registry import register


def adamw(param_groups, train_cfg, **kwargs) -> torch.optim.AdamW:
    return torch.optim.AdamW(param_groups, lr=train_cfg.lr, betas=(train_cfg.beta1, train_cfg.beta2),
                             eps=train_cfg.eps, **kwargs)


def decay_groups(named_params, weight_decay: float) -> list[dict]:
    """Weight decay on matrices and stacked experts, none on norms (1-D)."""
    decay, no_decay = [], []
    for _, p in named_params:
        (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


@register("sharding", "none", reference=True, summary="single process: nothing sharded")
class NoSharding:
    def __init__(self, groups: ShardingGroups, train_cfg):
        self.groups, self.train_cfg = groups, train_cfg

    def wrap(self, model):
        self.model = model
        self.optimizer = adamw(decay_groups(model.named_parameters(), self.train_cfg.weight_decay), self.train_cfg)
        return model

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def set_grad_sync(self, enabled: bool) -> None:
        pass

    def reduce_grads(self) -> None:
        pass

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def state_bytes(self) -> dict[str, int]:
        return state_bytes(self.model, self.optimizer)
