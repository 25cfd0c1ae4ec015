"""What every sharding implementation shares: how to tell
expert parameters from dense ones, the global gradient norm and clipping.

Gradient convention (all implementations): the training loss on each rank is its
*share* of the global mean (summed token losses / global token count), so the
true gradient is the SUM of the ranks' local gradients -- never an average.
Dense parameters are summed over the ``dense`` group (all ranks holding the same
dense parameters: dp_shard x cp); expert parameters over the ``expert`` group
(edp: ranks holding the same experts).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from bumblebee.primitives.parallel import ParallelState


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _all_reduce(x: torch.Tensor, group, size: int) -> torch.Tensor:
    if group is not None and size > 1:
        dist.all_reduce(x, group=group)
    return x


def clip_grad_norm(
    named_params,
    groups: ParallelState,
    max_norm: float,
    is_expert_param,
    *,
    dense_sharded: bool,
    expert_sharded: bool,
) -> torch.Tensor:
    """Global L2 norm of all gradients, then scale them by min(1, max_norm / (norm + 1e-6))
    (the same rule as ``torch.nn.utils.clip_grad_norm_``). ``*_sharded`` says whether each rank
    holds a disjoint shard of those gradients (sum the squares over the group) or a replica;
    ``is_expert_param(name)`` tells routed-expert parameters (the model's protocol)."""
    dense_sq = expert_sq = None
    grads = []
    for name, p in named_params:
        if p.grad is None:
            continue
        g = local(p.grad)
        grads.append(g)
        sq = g.detach().float().pow(2).sum()
        if is_expert_param(name):
            expert_sq = sq if expert_sq is None else expert_sq + sq
        else:
            dense_sq = sq if dense_sq is None else dense_sq + sq
    device = grads[0].device if grads else torch.device("cpu")
    dense_sq = torch.zeros((), device=device) if dense_sq is None else dense_sq
    expert_sq = torch.zeros((), device=device) if expert_sq is None else expert_sq
    if dense_sharded:
        _all_reduce(dense_sq, groups.dense_group, groups.dense_size)
    if expert_sharded:
        _all_reduce(expert_sq, groups.expert_group, groups.expert_size)
    _all_reduce(expert_sq, groups.ep_group, groups.ep_size)  # different experts on every ep rank
    total = (dense_sq + expert_sq).sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return total


def state_bytes(model: torch.nn.Module, optimizer) -> dict[str, int]:
    """Bytes this rank holds for parameters, gradients and optimizer state."""
    params = sum(local(p).numel() * local(p).element_size() for p in model.parameters())
    grads = sum(
        local(p.grad).numel() * local(p.grad).element_size()
        for p in model.parameters()
        if p.grad is not None
    )
    opt = 0
    for state in optimizer.state.values():
        for v in state.values():
            if torch.is_tensor(v):
                opt += local(v).numel() * local(v).element_size()
    return {"params": params, "grads": grads, "optimizer": opt}


@torch.no_grad()
def full_named_parameters(model: torch.nn.Module, ep_group=None, ep: int | None = None):
    """Yield (name, full tensor) for every parameter of a possibly sharded model: FSDP
    shards are all-gathered, and expert tensors (``model.is_expert_param``) are
    concatenated over the ep group. Collective: every rank must iterate it to the end."""
    if ep is None:  # a caller without the parallel state (``ep``: the group's size)
        ep = 1 if ep_group is None else dist.get_world_size(ep_group)
    for name, p in model.named_parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        if ep > 1 and model.is_expert_param(name):
            parts = [torch.empty_like(t) for _ in range(ep)]
            dist.all_gather(parts, t.contiguous(), group=ep_group)
            t = torch.cat(parts)
        yield name, t


def row_extent(t: torch.Tensor, is_expert: bool = False, ep_rank: int = 0, ep: int = 1):
    """Which rows of dim 0 of the *global* tensor this rank's ``t`` holds: (global shape, first
    row, local tensor). Every layout owns whole rows: an FSDP2 DTensor is sharded on dim 0 in
    ``torch.chunk`` sizes over a 1-D mesh, and expert parallelism owns a block of experts (the
    global expert tensor has all ``E = local E x ep`` experts); a plain tensor is all of it."""
    shape, lo, part = tuple(t.shape), 0, t
    if isinstance(t, DTensor):
        w, r = t.device_mesh.size(), t.device_mesh.get_local_rank()
        chunk = -(-shape[0] // w) if shape else 0
        part = t.to_local()
        lo = min(shape[0], r * chunk) if shape else 0
    if ep > 1 and is_expert:
        lo += ep_rank * shape[0]
        shape = (shape[0] * ep, *shape[1:])
    return shape, lo, part
