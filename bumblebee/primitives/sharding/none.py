"""No sharding (slot ``sharding``, ``none``): one process holds everything.

Also what ``fsdp2`` and ``zero1`` reduce to on a single process, where there is
nothing to shard, and the interface every sharding primitive implements. A sharding
primitive decides where parameters, gradients and optimizer state live; it does not
choose the optimizer: the runtime builds one (``runtime/optim.py``) over
``param_groups(weight_decay)`` and hands it back to ``step``.
"""

from __future__ import annotations

import torch

from bumblebee.primitives.parallel import ParallelState
from bumblebee.primitives.sharding.common import state_bytes
from bumblebee.primitives.sharding.costs import ShardingCosts
from bumblebee.registry import Need, register


def decay_groups(named_params, weight_decay: float) -> list[dict]:
    """Weight decay on matrices and stacked experts, none on norms (1-D). Frozen parameters
    (``requires_grad`` False: a LoRA base) are left out: no optimizer state for them."""
    decay, no_decay = [], []
    for _, p in named_params:
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


# bf16 parameters, fp32 gradients, fp32 master + two moments, whole; a step syncs fp32 gradients
# (all-reduce: twice their bytes)
COSTS = ShardingCosts(
    param_bytes=2,
    grad_bytes=4,
    optim_bytes=12,
    params_sharded=False,
    optim_sharded=False,
    gathers_per_layer=False,
    sync_bytes_per_param=2 * 4,
    explain="2+4+12 B x {full:.3f}B ({where})",
)


@register(
    "sharding",
    "none",
    reference=True,
    summary="single process: nothing sharded",
    costs=COSTS,
    needs=(
        Need(
            "a single process (world size is {world}); use 'fsdp2' or 'zero1'",
            lambda f: f.world == 1,
        ),
    ),
)
class NoSharding:
    def __init__(self, groups: ParallelState, train_cfg):
        self.groups, self.train_cfg = groups, train_cfg

    def wrap(self, model):
        self.model = model
        return model

    def param_groups(self, weight_decay: float) -> list[dict]:
        """The tensors the optimizer updates, with their weight decay."""
        return decay_groups(self.model.named_parameters(), weight_decay)

    def optimizer_param(self, name: str, optimizer) -> tuple[torch.Tensor, int | None]:
        """The optimizer's parameter holding parameter ``name``'s state, and where that state
        starts in the flattened parameter (None: it covers this rank's whole local tensor)."""
        return dict(self.model.named_parameters())[name], None

    def set_grad_sync(self, enabled: bool) -> None:
        pass

    def reduce_grads(self) -> None:
        pass

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    def after_load(self) -> None:
        """Called once the parameters hold their values (initialized, or read from a checkpoint)."""

    def reshard(self) -> None:
        """Put every parameter back in the form the optimizer owns (before the state is read
        for a checkpoint); a forward without backward may leave it otherwise (fsdp2)."""

    def step(self, optimizer) -> None:
        optimizer.step()

    def zero_grad(self, optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)

    def state_bytes(self, optimizer) -> dict[str, int]:
        return state_bytes(self.model, optimizer)
