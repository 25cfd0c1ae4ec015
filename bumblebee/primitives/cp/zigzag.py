"""Load-balanced (zigzag) sequence sharding for context parallelism.

Each row of T tokens is cut into 2C chunks of T/(2C); CP rank r holds chunks r
and 2C-1-r, in that order. Under a causal mask the work of chunk i grows with i,
so pairing an early chunk with a late one gives every rank the same amount of
attention work. Inputs, labels and position ids are sharded with the same index
map; position ids restart per document, so the global document structure is
rebuilt on every rank from the all-gathered position ids (cheap: T integers).

Legend: B rows, T global tokens, Tl = T / C local tokens, C cp ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from bumblebee.primitives.packed import DeviceCache, DocLayout, cached, doc_layout


def zigzag_index(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global positions [Tl] held by ``rank``: chunk ``rank`` then chunk ``2*cp-1-rank``."""
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2 x cp = {2 * cp}")
    n = seq_len // (2 * cp)
    early = torch.arange(rank * n, (rank + 1) * n, device=device)
    late = torch.arange((2 * cp - 1 - rank) * n, (2 * cp - rank) * n, device=device)
    return torch.cat([early, late])


def shard_sequence(x_BT: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """This rank's zigzag shard of dim 1 of ``x_BT``."""
    return x_BT[:, zigzag_index(x_BT.shape[1], cp, rank, x_BT.device)]


def unshard_sequence(parts: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of ``shard_sequence``: per-rank shards (rank order) -> the global dim 1."""
    cp = len(parts)
    T = sum(p.shape[1] for p in parts)
    out = parts[0].new_empty((parts[0].shape[0], T) + tuple(parts[0].shape[2:]))
    for r, p in enumerate(parts):
        out[:, zigzag_index(T, cp, r, p.device)] = p
    return out


@dataclass(frozen=True)
class CPShards:
    """The sequence as the CP group holds it: what a CP attention implementation needs to know
    (named apart from ``runtime.resolve.Layout``, the parallel degrees)."""

    group: object
    size: int
    rank: int
    seq_len: int  # global T
    doc_BT: torch.Tensor  # global document id of every token [B, T]
    index_L: torch.Tensor  # global positions of the local tokens [Tl]
    docs: DocLayout | None = (
        None  # the same documents as host ints (kernel plans without device syncs)
    )
    _cache: DeviceCache = field(
        default_factory=DeviceCache, compare=False, repr=False
    )  # derived once

    def cached(self, key, device, build):
        """``build()`` once per (key, device): every layer and pass of the micro-batch shares it."""
        return cached(self, key, device, build)

    @property
    def chunk(self) -> int:
        return self.seq_len // (2 * self.size)

    def rank_index(self, r: int) -> torch.Tensor:
        return zigzag_index(self.seq_len, self.size, r, self.index_L.device)


def build_cp_shards(
    position_ids_local_BT: torch.Tensor, group, size: int | None = None, rank: int | None = None
) -> CPShards:
    """All-gather the local position ids and rebuild the global document layout. ``size`` /
    ``rank``: the group's, when the caller carries them (a model's ``ParallelState``)."""
    C = dist.get_world_size(group) if size is None else size
    r = dist.get_rank(group) if rank is None else rank
    parts = [torch.empty_like(position_ids_local_BT) for _ in range(C)]
    dist.all_gather(parts, position_ids_local_BT.contiguous(), group=group)
    global_pos = unshard_sequence(parts)
    T = global_pos.shape[1]
    docs = doc_layout(global_pos)
    doc = docs.doc_ids(position_ids_local_BT.device)
    return CPShards(group, C, r, T, doc, zigzag_index(T, C, r, position_ids_local_BT.device), docs)
