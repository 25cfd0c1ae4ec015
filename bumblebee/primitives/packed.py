"""Packed-document layout of a batch, derived once per forward from ``position_ids``.

Several documents share one row; a document starts wherever the position id
does not continue the previous one (``pos[t] != pos[t-1] + 1``, in particular
where it restarts at 0). Attention and linear attention use this layout so that
no token sees across a document boundary.

Legend: B batch, T tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DocLayout:
    """Per-row document boundaries: ``bounds[b] = [0, s1, s2, ..., T]`` (host ints)."""

    bounds: tuple[tuple[int, ...], ...]
    seq_len: int

    @property
    def single_doc(self) -> bool:
        return all(len(b) == 2 for b in self.bounds)

    def doc_ids(self, device) -> torch.Tensor:
        """[B, T] int: index of the document each token belongs to (within its row)."""
        rows = []
        for b in self.bounds:
            lengths = torch.tensor([e - s for s, e in zip(b[:-1], b[1:])]).to(device)
            # output_size: the shape is known on the host (no sync; fake tensors can run it)
            rows.append(torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths,
                                                output_size=self.seq_len))
        return torch.stack(rows)


def doc_layout(position_ids_BT: torch.Tensor) -> DocLayout:
    B, T = position_ids_BT.shape
    starts = torch.ones(B, T, dtype=torch.bool, device=position_ids_BT.device)
    if T > 1:
        starts[:, 1:] = position_ids_BT[:, 1:] != position_ids_BT[:, :-1] + 1
    bounds = []
    for row in starts.cpu():
        idx = torch.nonzero(row).flatten().tolist()
        bounds.append(tuple(idx) + (T,))
    return DocLayout(bounds=tuple(bounds), seq_len=T)


def default_position_ids(input_ids_BT: torch.Tensor) -> torch.Tensor:
    B, T = input_ids_BT.shape
    return torch.arange(T, device=input_ids_BT.device).expand(B, T)
