"""The process groups a model's primitives communicate over, passed explicitly.

The runtime builds the device meshes (runtime/mesh.py) and hands a model only
the groups its primitives need. ``None`` means "not parallel along this axis".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelGroups:
    ep_group: object = None  # expert parallel: ranks that split the experts of a layer
    cp_group: object = None  # context parallel: ranks that split the sequence

    @property
    def ep_size(self) -> int:
        return 1 if self.ep_group is None else dist.get_world_size(self.ep_group)

    @property
    def ep_rank(self) -> int:
        return 0 if self.ep_group is None else dist.get_rank(self.ep_group)

    @property
    def cp_size(self) -> int:
        return 1 if self.cp_group is None else dist.get_world_size(self.cp_group)

    @property
    def cp_rank(self) -> int:
        return 0 if self.cp_group is None else dist.get_rank(self.cp_group)


class AllReduceSum(torch.autograd.Function):
    """Differentiable sum over a group: every rank gets the sum, and in backward every
    rank's input gets the sum of all ranks' output gradients."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None
