"""FSDP2's all-gather and reduce-scatter in place, for the gloo backend (CPU runs).

Gloo's ``all_gather_into_tensor`` stages the whole output in a temporary and its
``reduce_scatter_tensor`` ~1.25x the whole input, so on CPU every FSDP2 unit costs one
or two extra full-size copies of its parameters or gradients at the moment it is gathered
or reduced (measured on 4 ranks, one 594 MiB fp32 tensor: +594 MiB resident for the
all-gather, +746 MiB for the reduce-scatter). For a [vocab, hidden] table these
temporaries were the largest thing alive in the step. NCCL works in place; these two
classes give gloo the same footprint through ``FSDPModule.set_custom_all_gather`` /
``set_custom_reduce_scatter``:

- all-gather: FSDP has already copied this rank's shard into its slot of the flat output;
  every rank broadcasts its slot into the others' outputs (same bytes on the wire as an
  all-gather, nothing staged; an exact copy);
- reduce-scatter: an in-place all-reduce of FSDP's flat input buffer (which FSDP frees
  right after), then this rank's slot is copied out. Twice the bytes of a reduce-scatter,
  yet faster than gloo's own reduce-scatter on one host (same tensor: 0.97 s vs 1.93 s).
  Every rank's slot is the same ring sum gloo's all-reduce computes once per element.

``benchmarks/startup_memory.py`` shows the effect per rank. Never used with NCCL.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter


class _Alloc:
    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class InPlaceAllGather(_Alloc, AllGather):
    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        world, rank = group.size(), group.rank()
        slots = output_tensor.view(world, -1)
        if input_tensor.data_ptr() != slots[rank].data_ptr():  # FSDP copies in place; be safe otherwise
            slots[rank].copy_(input_tensor.view(-1))
        for src in range(world):
            dist.broadcast(slots[src], src=dist.get_global_rank(group, src), group=group)
        return None  # done: FSDP waits only on a returned Work


class InPlaceReduceScatter(_Alloc, ReduceScatter):
    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        dist.all_reduce(input_tensor, op=op, group=group)
        output_tensor.copy_(input_tensor.view(group.size(), -1)[group.rank()])
        return None


def use_in_place_comms(unit, mesh) -> bool:
    """Give ``unit`` (an FSDP2 module on ``mesh``) the in-place collectives when its group is
    gloo; returns whether it did."""
    group = mesh.get_group()
    if dist.get_backend(group) != "gloo":
        return False
    unit.set_custom_all_gather(InPlaceAllGather())
    unit.set_custom_reduce_scatter(InPlaceReduceScatter())
    return True
