"""Moving whole sequence chunks between context-parallel ranks: zigzag <-> contiguous
sharding, and the point-to-point exchange it is built on.

Both layouts cut each row into 2C chunks of n = T / 2C tokens (C cp ranks):

- zigzag (``layout.py``, what the residual stream and full attention use): rank r
  holds chunks r and 2C-1-r, so causal attention work is balanced;
- contiguous: rank r holds chunks 2r and 2r+1, i.e. tokens [2rn, 2(r+1)n), the
  shard a left-to-right recurrence wants (one segment per rank).

A conversion sends only the chunks whose owner changes, directly to their new
owner (one P2P message per pair of ranks, chunks bundled); it is a permutation,
so its backward is the inverse conversion of the gradient. Chunk j stays put
only when its zigzag owner is j // 2: chunk 0, plus the one late chunk j >= C
with 2C-1-j = j // 2 when it exists (chunk 2 of C = 2). So most tokens move:
per rank and per conversion at most Tl = 2n tokens x D x dtype bytes are sent
(and as many received); ``moved_fraction(C)`` gives the exact share of all
tokens (1/2 at C = 2, 3/4 at C = 4).

Legend: B batch, L local tokens (2n), n chunk length, C cp ranks, D trailing dims.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from bumblebee.primitives.cp.zigzag import CPShards


def exchange(
    group, sends: dict[int, torch.Tensor], recvs: dict[int, torch.Tensor], rank: int | None = None
) -> None:
    """Send ``sends[p]`` to group rank p and receive into the buffer ``recvs[p]`` from p, all
    at once (batched isend/irecv), and wait. At most one message per direction and peer;
    the caller keeps messages to itself local. ``rank``: this rank's place in ``group`` as the
    caller carries it (``CPShards.rank``); read from the group when not given."""
    me = dist.get_rank(group) if rank is None else rank
    assert me not in sends and me not in recvs, "exchange: local moves are the caller's"
    ops = [
        dist.P2POp(dist.isend, t, dist.get_global_rank(group, p), group) for p, t in sends.items()
    ]
    ops += [
        dist.P2POp(dist.irecv, b, dist.get_global_rank(group, p), group) for p, b in recvs.items()
    ]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def zigzag_place(j: int, cp: int) -> tuple[int, int]:
    """(rank, local slot) of chunk j under zigzag sharding."""
    return (j, 0) if j < cp else (2 * cp - 1 - j, 1)


def contiguous_place(j: int, cp: int) -> tuple[int, int]:
    """(rank, local slot) of chunk j under contiguous sharding."""
    return j // 2, j % 2


def moved_fraction(cp: int) -> float:
    """Share of all tokens that change rank in one zigzag <-> contiguous conversion."""
    moved = sum(zigzag_place(j, cp)[0] != contiguous_place(j, cp)[0] for j in range(2 * cp))
    return moved / (2 * cp)


def _move(x_BL, layout: CPShards, src, dst) -> torch.Tensor:
    """Re-shard dim 1 of ``x_BL`` from placement ``src`` to placement ``dst`` (chunk -> (rank, slot))."""
    C, me, n = layout.size, layout.rank, layout.chunk
    if x_BL.shape[1] != 2 * n:
        raise ValueError(
            f"relayout: dim 1 must hold this rank's 2 chunks of {n} tokens, got {x_BL.shape[1]}"
        )
    held = x_BL.split(n, dim=1)
    out: list[torch.Tensor | None] = [None, None]
    outgoing: dict[int, list[int]] = {}  # peer -> chunk ids (ascending) it receives from me
    incoming: dict[int, list[int]] = {}  # peer -> chunk ids (ascending) I receive from it
    for j in range(2 * C):
        (s_rank, s_slot), (d_rank, d_slot) = src(j, C), dst(j, C)
        if s_rank == me and d_rank == me:
            out[d_slot] = held[s_slot]
        elif s_rank == me:
            outgoing.setdefault(d_rank, []).append(j)
        elif d_rank == me:
            incoming.setdefault(s_rank, []).append(j)
    sends = {
        p: torch.cat([held[src(j, C)[1]] for j in js], dim=1).contiguous()
        for p, js in outgoing.items()
    }
    shape = lambda k: (x_BL.shape[0], k * n) + tuple(x_BL.shape[2:])  # noqa: E731
    recvs = {p: x_BL.new_empty(shape(len(js))) for p, js in incoming.items()}
    exchange(layout.group, sends, recvs, layout.rank)
    for p, js in incoming.items():
        for j, part in zip(js, recvs[p].split(n, dim=1)):
            out[dst(j, C)[1]] = part
    return torch.cat(out, dim=1)


class _Relayout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_BL, layout: CPShards, src, dst):
        ctx.layout, ctx.src, ctx.dst = layout, src, dst
        return _move(x_BL, layout, src, dst)

    @staticmethod
    def backward(ctx, grad_BL):
        return _move(grad_BL.contiguous(), ctx.layout, ctx.dst, ctx.src), None, None, None


def zigzag_to_contiguous(x_BL: torch.Tensor, layout: CPShards) -> torch.Tensor:
    """This rank's zigzag shard (chunks r, 2C-1-r) -> its contiguous shard (chunks 2r, 2r+1)."""
    return _Relayout.apply(x_BL, layout, zigzag_place, contiguous_place)


def contiguous_to_zigzag(x_BL: torch.Tensor, layout: CPShards) -> torch.Tensor:
    """Inverse of ``zigzag_to_contiguous``."""
    return _Relayout.apply(x_BL, layout, contiguous_place, zigzag_place)
