"""One hop of a context-parallel ring: send tensors to the next CP rank, receive the previous
rank's (shared by ``ring.py`` and ``ring_flash.py``)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from bumblebee.primitives.cp.zigzag import CPShards


def ring_pass(tensors: list[torch.Tensor], layout: CPShards):
    """Start sending ``tensors`` to the next rank and receiving the previous rank's.
    Returns (received buffers, a wait() callable). Buffers are contiguous whatever the inputs'
    strides: NCCL writes a message's bytes in memory order, so a buffer shaped like a strided
    view (``empty_like`` keeps the strides of a dense permuted view) would get them scrambled."""
    return exchange(tensors, layout, 1)


def exchange(tensors: list[torch.Tensor], layout: CPShards, offset: int):
    """``ring_pass`` over ``offset`` ranks: send to rank + offset, receive rank - offset's,
    directly (the window ring fetches only the blocks some rank needs, ring.py)."""
    g = layout.group
    nxt = dist.get_global_rank(g, (layout.rank + offset) % layout.size)
    prv = dist.get_global_rank(g, (layout.rank - offset) % layout.size)
    bufs = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), nxt, g) for t in tensors]
    ops += [dist.P2POp(dist.irecv, b, prv, g) for b in bufs]
    works = dist.batch_isend_irecv(ops)
    return bufs, lambda: [w.wait() for w in works]


def backward_hop(
    step: int, layout: CPShards, blocks: list[torch.Tensor], grads: list[torch.Tensor]
):
    """The backward ring's hop after ``step``: pass the blocks (K/V, or MLA latents) on with the
    gradient accumulators every rank adds to. After the last hop only the accumulators travel,
    and each block's gradients are back with the block's owner. Returns (blocks, grads)."""
    last = step + 1 == layout.size
    received, wait = ring_pass(grads if last else blocks + grads, layout)
    wait()
    return (blocks, received) if last else (received[: len(blocks)], received[len(blocks) :])
