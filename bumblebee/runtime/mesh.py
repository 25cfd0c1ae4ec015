"""Device meshes with parallel folding, built once and passed explicitly.

Ranks are laid out as (pp, dp_shard, cp, tp), tp fastest. Dense modules see
that mesh. MoE experts see a second mesh over the *same* ranks, (pp, edp, ep)
with ep fastest: inside one pipeline stage, the dp_shard*cp*tp ranks are
refolded into ep groups of consecutive ranks (so an EP group stays inside a
node when it can) and edp replicas of each group. ep therefore need not divide
dp_shard: it only has to divide dp_shard*cp*tp (ep * edp = dp_shard * cp * tp).

The layout itself (sizes only) is resolved and checked without any process group
by ``runtime/resolve.py``, so impossible layouts fail in the launcher with a
one-line reason before a single process starts. ``build_context`` returns the one
``ParallelState`` (primitives/parallel.py: primitives may not import runtime).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from bumblebee.primitives.parallel import Layout, ParallelState


def single_process(device: torch.device) -> ParallelState:
    return ParallelState(device=device)


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


def build_context(layout: Layout, device: torch.device, *, fake: bool = False) -> ParallelState:
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
    return ParallelState(
        layout=layout,
        rank=dist.get_rank(),
        device=device,
        dense=dense,
        dp_cp=dp_cp,
        experts=experts,
        dp_rank=dense.get_local_rank("dp_shard"),
        cp_rank=dense.get_local_rank("cp"),
        ep_rank=experts.get_local_rank("ep"),
        pp_rank=dense.get_local_rank("pp"),
        dp_cp_rank=dp_cp.get_local_rank("dp_cp"),
        edp_rank=experts.get_local_rank("edp"),
        ep_group=experts.get_group("ep"),
        cp_group=dense.get_group("cp") if L.cp > 1 else None,
        pp_group=dense.get_group("pp") if L.pp > 1 else None,
        dp_group=dense.get_group("dp_shard"),
        dp_cp_group=dp_cp.get_group("dp_cp"),
        edp_group=experts.get_group("edp"),
    )
