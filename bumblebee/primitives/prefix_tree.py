"""Shared-prefix (tree) document layout: a document may continue another one of its row.

A GRPO group shares its prompt, agentic trajectories share long prefixes. Packed as a tree,
the shared part is one document and each branch is a document of its own that *continues* it
(its parent): attention lets the branch's queries see the parent chain's keys, linear attention
starts the branch from the parent's final state. Every token is computed once however many
branches share it, and autograd sums a shared token's gradient over the branches.

The tree is data: a per-token ``attach`` tensor (``[B, T]`` int64) holds, for each token,
``1 + the column where its document's parent starts`` (0: no parent, the ordinary packed
document; zero-filled padding stays valid). Documents start where the position ids do not
continue (as in ``packed.doc_layout``) or where ``attach`` changes, so a first branch whose
positions continue its parent's is still a document of its own. A branch's position ids
continue its parent's (the parent's last position + 1), its parent lies earlier in the row.

Legend: B batch, T tokens, D documents of a row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bumblebee.primitives.packed import DocLayout, to_device


@dataclass(frozen=True)
class TreeLayout(DocLayout):
    """A ``DocLayout`` whose documents may continue an earlier one: ``parents[b][d]`` is the
    index of document d's parent in row b, or -1."""

    parents: tuple[tuple[int, ...], ...] = ()

    def chain(self, b: int, d: int) -> list[int]:
        """Documents whose tokens document d of row b sees, root first, d last."""
        out = [d]
        while self.parents[b][out[-1]] >= 0:
            out.append(self.parents[b][out[-1]])
        return out[::-1]

    def key_ranges(self, b: int, d: int) -> list[tuple[int, int]]:
        """Column ranges [s, e) of the chain of document d: its keys, in order."""
        bounds = self.bounds[b]
        return [(bounds[a], bounds[a + 1]) for a in self.chain(b, d)]

    def visible(self, device) -> torch.Tensor:
        """[B, D, D] bool: ``out[b, d, a]``: document d of row b sees document a's tokens."""
        return self.cached("tree_visible", device, lambda: self._visible(device))

    def _visible(self, device) -> torch.Tensor:
        D = max(len(b) - 1 for b in self.bounds)
        vis = torch.zeros(len(self.bounds), D, D, dtype=torch.bool)
        for b, bounds in enumerate(self.bounds):
            for d in range(len(bounds) - 1):
                vis[b, d, self.chain(b, d)] = True
        return vis.to(device)


def tree_layout(position_ids_BT: torch.Tensor, attach_BT: torch.Tensor) -> TreeLayout:
    """The layout of ``position_ids`` and ``attach`` (see the module doc); checks that a branch
    continues its parent: parent earlier in the row, positions going on from its last one."""
    if attach_BT.shape != position_ids_BT.shape:
        raise ValueError(
            f"attach {tuple(attach_BT.shape)} must match position_ids {tuple(position_ids_BT.shape)}"
        )
    B, T = position_ids_BT.shape
    pos, att = position_ids_BT.cpu(), attach_BT.cpu()
    starts = torch.ones(B, T, dtype=torch.bool)
    if T > 1:
        starts[:, 1:] = (pos[:, 1:] != pos[:, :-1] + 1) | (att[:, 1:] != att[:, :-1])
    bounds, parents = [], []
    for b in range(B):
        row = tuple(torch.nonzero(starts[b]).flatten().tolist()) + (T,)
        index = {s: d for d, s in enumerate(row[:-1])}
        par = []
        for d, s in enumerate(row[:-1]):
            col = int(att[b, s]) - 1
            if col < 0:
                par.append(-1)
                continue
            p = index.get(col)
            if p is None or p >= d:
                raise ValueError(
                    f"row {b}: the document at column {s} attaches to column {col}, which does "
                    "not start an earlier document"
                )
            if int(pos[b, s]) != int(pos[b, row[p + 1] - 1]) + 1:
                raise ValueError(
                    f"row {b}: the document at column {s} starts at position {int(pos[b, s])}, "
                    f"its parent ends at {int(pos[b, row[p + 1] - 1])}: a branch continues it"
                )
            par.append(p)
        bounds.append(row)
        parents.append(tuple(par))
    return TreeLayout(bounds=tuple(bounds), seq_len=T, parents=tuple(parents))


def gather_index(layout: TreeLayout, device):
    """For varlen kernels: (flat [B x T] index of every document's keys -- its chain -- laid
    back to back, int32 cumulative query and key boundaries, longest query and key runs),
    built once per layout and device."""

    def build():
        T, idx, cu_q, cu_k = layout.seq_len, [], [0], [0]
        for b, bounds in enumerate(layout.bounds):
            for d in range(len(bounds) - 1):
                for s, e in layout.key_ranges(b, d):
                    idx.extend(range(b * T + s, b * T + e))
                cu_q.append(b * T + bounds[d + 1])
                cu_k.append(len(idx))
        longest_q = max(e - s for s, e in zip(cu_q[:-1], cu_q[1:]))
        longest_k = max(e - s for s, e in zip(cu_k[:-1], cu_k[1:]))
        return (
            to_device(idx, device),
            to_device(cu_q, device, torch.int32),
            to_device(cu_k, device, torch.int32),
            longest_q,
            longest_k,
        )

    return layout.cached("tree_gather", device, build)
