"""FSDP2's collectives for one unit, with fewer transient copies than its defaults
(``FSDPModule.set_custom_reduce_scatter`` / ``set_custom_all_gather``).

Reduce-scatter, every backend (``UnitReduceScatter``): FSDP2's ``foreach_reduce`` allocates
the reduce-scatter input (the unit's unsharded gradients in the reduce dtype), then an
output of 1/world of it, reduce-scatters, and then either makes views of the output the
sharded ``.grad`` (no gradient yet) or does ``.grad += output`` and drops it (gradient
accumulation). In the second case, when every trainable parameter of the unit already has
its sharded gradient (micro-batches 2..n of ``grad_accum = "sharded"``), the output is this
rank's chunk of the input buffer: an in-place reduce-scatter (same reduction, same bits),
so the transient sharded copy of the unit is not allocated. The input buffer is kept by
FSDP until the next unit's reduction either way. Otherwise (first micro-batch,
``grad_accum = "unsharded"``) it allocates as FSDP does.

Gloo (CPU runs): gloo's ``all_gather_into_tensor`` stages the whole output in a temporary
and its ``reduce_scatter_tensor`` ~1.25x the whole input, so every unit cost one or two
extra full-size copies of its parameters or gradients at the moment it was gathered or
reduced (skills/sharding/fsdp2.md, "On gloo", has the measurements); for a [vocab, hidden]
table these were the largest thing alive in the step. NCCL works in place. On gloo:

- all-gather (``InPlaceAllGather``): FSDP has already copied this rank's shard into its
  slot of the flat output; every rank broadcasts its slot into the others' outputs (the
  bytes of an all-gather, nothing staged; an exact copy);
- reduce-scatter: an in-place all-reduce of FSDP's flat input buffer, then this rank's
  slot is the output (copied out unless the output already is that slot). Twice the bytes
  of a reduce-scatter, yet faster than gloo's own on one host; every rank's slot is the ring sum
  gloo's all-reduce computes once per element.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

# the interfaces ``set_custom_all_gather`` / ``set_custom_reduce_scatter`` take; torch defines
# them only in this private module
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from bumblebee.primitives import emulation
from bumblebee.primitives.collectives import reduce_scatter_single


class UnitReduceScatter(ReduceScatter):
    """One unit's reduce-scatter. ``slots``: (module, parameter name) of the unit's own
    parameters (read at each call: parameters are replaced after a meta-device
    ``to_empty``); ``mesh``: the unit's 1-D mesh; ``gloo``: use the in-place all-reduce."""

    def __init__(self, slots: list, mesh, gloo: bool):
        self.slots, self.world, self.rank, self.gloo = (
            slots,
            mesh.size(),
            mesh.get_local_rank(),
            gloo,
        )
        self._input = None  # the input buffer between the two allocate calls of one reduction
        self._in_place = False  # the last output allocated is a chunk of its input

    def _accumulating(self) -> bool:
        params = [getattr(m, name) for m, name in self.slots]
        params = [p for p in params if p is not None and p.requires_grad]
        return bool(params) and all(p.grad is not None for p in params)

    def allocate(self, size, *, dtype, device) -> torch.Tensor:
        # foreach_reduce allocates twice per reduction: the input, then the output
        inp, self._input, self._in_place = self._input, None, False
        if inp is None:
            self._input = torch.empty(*size, dtype=dtype, device=device)
            return self._input
        numel = math.prod(size)
        if (
            self.world > 1
            and inp.dtype == dtype
            and inp.numel() == numel * self.world
            and inp.device == torch.device(device)
            and self._accumulating()
        ):
            # this rank's chunk of the input, as a tensor of its own storage (offset 0: FSDP views
            # the output with absolute storage offsets); it keeps the input's memory alive
            nbytes = numel * inp.element_size()
            chunk = inp.untyped_storage()[self.rank * nbytes : (self.rank + 1) * nbytes]
            self._in_place = True
            return torch.empty(0, dtype=dtype, device=device).set_(chunk, 0, tuple(size))
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        if self.gloo:
            dist.all_reduce(input_tensor, op=op, group=group)
            if not self._in_place:
                output_tensor.copy_(input_tensor.view(group.size(), -1)[group.rank()])
            return None  # done: FSDP waits only on a returned Work
        if self._in_place:
            # FSDP adds the output into .grad on this (reduce-scatter) stream after recording the
            # event it frees the input on: keep the input's memory from reuse until that add ran
            emulation.record_stream(input_tensor)
        return reduce_scatter_single(
            output=output_tensor, input=input_tensor, group=group, op=op, async_op=async_op
        )


class InPlaceAllGather(AllGather):
    """Gloo's all-gather as one broadcast per rank into FSDP's flat output."""

    def allocate(self, size, *, dtype, device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        world, rank = group.size(), group.rank()
        slots = output_tensor.view(world, -1)
        if (
            input_tensor.data_ptr() != slots[rank].data_ptr()
        ):  # FSDP copies in place; be safe otherwise
            slots[rank].copy_(input_tensor.view(-1))
        for src in range(world):
            dist.broadcast(slots[src], src=dist.get_global_rank(group, src), group=group)
        return None


def own_slots(unit, units) -> list:
    """(module, name) of the parameters that FSDP unit ``unit`` manages: its subtree minus
    the subtrees of the units nested in it."""
    nested = {
        id(m)
        for u in units
        if u is not unit and any(u is m for m in unit.modules())
        for m in u.modules()
    }
    return [(m, name) for m in unit.modules() if id(m) not in nested for name in m._parameters]


def _gloo(mesh) -> bool:
    return not emulation.nccl_branch(mesh.get_group())


def set_unit_comms(unit, units, mesh) -> None:
    """Give FSDP unit ``unit`` (one of ``units``, on 1-D ``mesh``) these collectives."""
    gloo = _gloo(mesh)
    unit.set_custom_reduce_scatter(UnitReduceScatter(own_slots(unit, units), mesh, gloo))
    if gloo:
        unit.set_custom_all_gather(InPlaceAllGather())
