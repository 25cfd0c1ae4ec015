"""Device meshes with parallel folding, built once and passed explicitly.

Ranks are laid out as (pp, dp_shard, cp, tp), tp fastest. Dense modules see
that mesh. MoE experts see a second mesh over the *same* ranks, (pp, edp, ep)
with ep fastest: inside one pipeline stage, the dp_shard*cp*tp ranks are
refolded into ep groups of consecutive ranks (so an EP group stays inside a
node when it can) and edp replicas of each group. ep therefore need not divide
dp_shard: it only has to divide dp_shard*cp*tp (ep * edp = dp_shard * cp * tp).

The layout itself (sizes only) is resolved and checked without any process group
by ``runtime/resolve.py``, so impossible layouts fail in the launcher with a
one-line reason before a single process starts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from bumblebee.primitives.parallel import ParallelGroups
from bumblebee.primitives.sharding import ShardingGroups
from bumblebee.runtime.resolve import Layout


@dataclass
class ParallelContext:
    """Everything a rank needs to know about the layout; built once per run."""

    layout: Layout
    rank: int
    device: torch.device
    dense: DeviceMesh | None  # (pp, dp_shard, cp, tp)
    dp_cp: DeviceMesh | None  # (pp, dp_cp): ranks that hold the same dense parameters
    experts: DeviceMesh | None  # (pp, edp, ep)

    @property
    def distributed(self) -> bool:
        return self.layout.world > 1

    def _coord(self, mesh: DeviceMesh | None, axis: str) -> int:
        return 0 if mesh is None else mesh.get_local_rank(axis)

    def _group(self, mesh: DeviceMesh | None, axis: str):
        return None if mesh is None else mesh.get_group(axis)

    @property
    def dp_rank(self) -> int:
        return self._coord(self.dense, "dp_shard")

    @property
    def cp_rank(self) -> int:
        return self._coord(self.dense, "cp")

    @property
    def cp_group(self):
        return self._group(self.dense, "cp") if self.layout.cp > 1 else None

    @property
    def ep_rank(self) -> int:
        return self._coord(self.experts, "ep")

    @property
    def ep_group(self):
        return self._group(self.experts, "ep")

    @property
    def dp_cp_group(self):
        return self._group(self.dp_cp, "dp_cp")

    @property
    def edp_group(self):
        return self._group(self.experts, "edp")

    @property
    def pp_rank(self) -> int:
        return self._coord(self.dense, "pp")

    @property
    def pp_group(self):
        """Ranks holding the pipeline stages of the same data (same dp_shard, cp, tp coordinates)."""
        return self._group(self.dense, "pp") if self.layout.pp > 1 else None

    # the views primitives take: a model its EP / CP groups, a sharding primitive its meshes
    @property
    def model_groups(self) -> ParallelGroups:
        return ParallelGroups(ep_group=self.ep_group, cp_group=self.cp_group)

    @property
    def sharding_groups(self) -> ShardingGroups:
        return ShardingGroups(
            dense_mesh=self.dp_cp["dp_cp"] if self.dp_cp is not None else None,
            expert_mesh=self.experts["edp"] if self.experts is not None else None,
            ep_group=self.ep_group,
        )


def single_process(device: torch.device) -> ParallelContext:
    layout = Layout()
    return ParallelContext(layout, 0, device, None, None, None)


def _group_options(device: torch.device):
    """(backend, options) that give a new process group the world group's timeout:
    torch gives sub-groups its own default (30 min) otherwise, whatever
    ``init_process_group`` was told, and a hung rank would hold the job that long."""
    backend = dist.get_backend()
    world = dist.group.WORLD._get_backend(device)
    options = (
        dist.ProcessGroupNCCL.Options() if backend == "nccl" else dist.ProcessGroupGloo._Options()
    )
    options._timeout = world.options._timeout
    return backend, options


def build_context(layout: Layout, device: torch.device, *, fake: bool = False) -> ParallelContext:
    """Create the meshes (collective: every rank calls this with the same layout). Every
    group they create has the world group's collective timeout (train.collective_timeout_s).
    ``fake``: the world group is torch's fake process group (the planner's dry run); its groups
    are fake too and take no options."""
    assert dist.is_initialized() and dist.get_world_size() == layout.world
    if layout.world == 1:
        return single_process(device)
    ranks = torch.arange(layout.world)
    kind = device.type
    L = layout
    opt = ("fake", None) if fake else _group_options(device)

    def mesh(shape, names):
        return DeviceMesh(
            kind, ranks.view(*shape), mesh_dim_names=names, backend_override=(opt,) * len(names)
        )

    dense = mesh((L.pp, L.dp_shard, L.cp, L.tp), ("pp", "dp_shard", "cp", "tp"))
    dp_cp = mesh((L.pp, L.dp_shard * L.cp * L.tp), ("pp", "dp_cp"))
    experts = mesh((L.pp, L.edp, L.ep), ("pp", "edp", "ep"))
    return ParallelContext(layout, dist.get_rank(), device, dense, dp_cp, experts)
