"""Packing variable-length documents into fixed-length rows.

A row holds several documents back to back. ``position_ids`` restart at 0 at
every document (this is what marks the boundaries for attention), and
``labels[t]`` is the target of position t: the next token of the same
document where that token is marked for loss, else -100. The tail of a row that
no document fills is padding: a separate pseudo-document with no labels.

Legend: B rows, T tokens per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE = -100


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T] int64
    labels: torch.Tensor  # [B, T] int64, IGNORE where no loss
    position_ids: torch.Tensor  # [B, T] int64, restart per document

    def rows(self, start: int, stop: int) -> Batch:
        return Batch(
            self.input_ids[start:stop], self.labels[start:stop], self.position_ids[start:stop]
        )

    def to(self, device) -> Batch:
        """On CUDA through pinned memory, asynchronously (a pageable copy waits for the stream)."""
        cuda = torch.device(device).type == "cuda"

        def move(t):
            t = t.pin_memory() if cuda else t
            t.bb_staged = True  # perf/syncs.py: an asynchronous copy, not a host sync
            return t.to(device, non_blocking=True)

        return Batch(move(self.input_ids), move(self.labels), move(self.position_ids))

    @property
    def num_valid(self) -> int:
        return int((self.labels != IGNORE).sum())


class RowPacker:
    """Accumulates documents into one row of ``seq_len`` tokens."""

    def __init__(self, seq_len: int, pad_id: int):
        self.seq_len, self.pad_id = seq_len, pad_id
        self.ids: list[int] = []
        self.labels: list[int] = []
        self.pos: list[int] = []

    @property
    def free(self) -> int:
        return self.seq_len - len(self.ids)

    def add(self, tokens: list[int], loss_mask: list[bool]) -> None:
        """Append one document; ``loss_mask[i]`` marks token i as a prediction target."""
        assert len(tokens) <= self.free and len(tokens) == len(loss_mask)
        n = len(tokens)
        self.ids += tokens
        self.labels += [tokens[i + 1] if loss_mask[i + 1] else IGNORE for i in range(n - 1)] + [
            IGNORE
        ]
        self.pos += list(range(n))

    def finish(self) -> tuple[list[int], list[int], list[int]]:
        pad = self.free
        self.ids += [self.pad_id] * pad
        self.labels += [IGNORE] * pad
        self.pos += list(range(pad))
        return self.ids, self.labels, self.pos


def stack_rows(rows: list[tuple[list[int], list[int], list[int]]]) -> Batch:
    ids, labels, pos = zip(*rows)
    t = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    return Batch(t(ids), t(labels), t(pos))
