"""A rank's parallel state -- layout sizes, coordinates, process groups -- passed explicitly.

The runtime builds the device meshes (runtime/mesh.py) into one ``ParallelState``; models and
sharding primitives read their groups and sizes from it. ``None`` means "not parallel along
this axis".
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist


@dataclass(frozen=True, kw_only=True)
class Layout:
    """The sizes of the parallel dimensions. Ranks are (pp, dp_shard, cp, tp), tp fastest;
    experts fold ep over the dp_shard x cp x tp ranks of a stage (edp replicas of each)."""

    pp: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1

    @property
    def world(self) -> int:
        return self.pp * self.dp_shard * self.cp * self.tp

    @property
    def edp(self) -> int:
        """Replicas of each expert shard (expert data parallel)."""
        return self.dp_shard * self.cp * self.tp // self.ep

    @property
    def dp_cp(self) -> int:
        return self.dp_shard * self.cp

    def short(self) -> str:
        return f"tp={self.tp} pp={self.pp} ep={self.ep} cp={self.cp} dp_shard={self.dp_shard}"

    def describe(self) -> str:
        return (
            f"world={self.world}: pp={self.pp} dp_shard={self.dp_shard} cp={self.cp} tp={self.tp}; "
            f"experts: ep={self.ep} edp={self.edp}"
        )


@dataclass(frozen=True, kw_only=True)
class ParallelState:
    """A rank's parallel state, built once per run (``runtime/mesh.build_context``) and passed
    explicitly: the layout's sizes, this rank's coordinates and the process groups. Sizes come
    from the layout, never read back from a group. ``None`` group: not parallel along that
    axis (one process; cp = 1; pp = 1). Models take it for their EP / CP groups, sharding
    primitives for their meshes."""

    layout: Layout = Layout()
    rank: int = 0
    device: object = None  # torch.device of this rank's compute
    # meshes over the same ranks: (pp, dp_shard, cp, tp), (pp, dp_cp) and (pp, edp, ep)
    dense: object = None
    dp_cp: object = None
    experts: object = None
    dp_rank: int = 0
    cp_rank: int = 0
    ep_rank: int = 0
    pp_rank: int = 0
    dp_cp_rank: int = 0  # along the dense parameters' group
    edp_rank: int = 0  # along the expert parameters' group
    ep_group: object = None  # ranks that split the experts of a layer
    cp_group: object = None  # ranks that split the sequence (None when cp = 1)
    pp_group: object = None  # ranks holding the stages of the same data (None when pp = 1)
    dp_group: object = None  # ranks whose batches differ (the dp_shard axis)
    dp_cp_group: object = None  # ranks holding the same dense parameters
    edp_group: object = None  # ranks holding the same experts

    @property
    def distributed(self) -> bool:
        return self.layout.world > 1

    @property
    def ep_size(self) -> int:
        return self.layout.ep

    @property
    def cp_size(self) -> int:
        return self.layout.cp

    # what a sharding primitive shards over: dense parameters over dp_shard x cp (x tp),
    # expert parameters over edp, different experts over ep. Sliced once: slicing a mesh reads
    # its rank tensor on the host, and the step asks for these every step.
    @cached_property
    def dense_mesh(self):
        return None if self.dp_cp is None else self.dp_cp["dp_cp"]

    @cached_property
    def expert_mesh(self):
        return None if self.experts is None else self.experts["edp"]

    @property
    def dense_group(self):
        return None if self.dp_cp is None else self.dense_mesh.get_group()

    @property
    def expert_group(self):
        return None if self.experts is None else self.expert_mesh.get_group()

    @property
    def dense_size(self) -> int:
        return self.layout.dp_cp * self.layout.tp

    @property
    def expert_size(self) -> int:
        return self.layout.edp

    @property
    def dense_rank(self) -> int:
        return self.dp_cp_rank

    @property
    def expert_rank(self) -> int:
        return self.edp_rank


def ParallelGroups(ep_group=None, cp_group=None) -> ParallelState:
    """The state of a model split over bare process groups (tests, benchmarks, the planner's
    dry run): sizes and coordinates read once, here, from the groups."""
    ep = 1 if ep_group is None else dist.get_world_size(ep_group)
    cp = 1 if cp_group is None else dist.get_world_size(cp_group)
    return ParallelState(
        layout=Layout(dp_shard=max(ep, 1), cp=cp, ep=ep),
        ep_group=ep_group,
        cp_group=cp_group,
        ep_rank=0 if ep_group is None else dist.get_rank(ep_group),
        cp_rank=0 if cp_group is None else dist.get_rank(cp_group),
    )


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
