"""Tensors a family's checkpoints store under another name and layout (the family table's
``hf_stored``), declared instead of coded: a name suffix on each side and how the layout differs.

Every transform keeps dim 0 (experts of a stacked tensor, rows of a matrix), so a rank still reads
only its rows of the stored tensor and converts them (models/hf_read.py), and an export converts
each tensor as it streams out (models/hf_write.py). Both directions are exact (transposes and
permutations only), so a round trip is bit for bit.

- ``transpose``: stored with its last two dims swapped (``x @ W`` instead of nn.Linear's
  ``x @ W^T``);
- ``interleave`` (a negative dim of bumblebee's layout): the two halves bumblebee keeps apart
  along that dim (e.g. gate rows then up rows of a fused expert projection) are stored
  interleaved (gate 0, up 0, gate 1, up 1, ...).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StoredAs:
    ours: str  # bumblebee name suffix, e.g. "mlp.experts.w_gate_up"
    theirs: str  # checkpoint name suffix, e.g. "mlp.experts.gate_up_proj"
    transpose: bool = False
    interleave: int | None = None

    def checkpoint_name(self, name: str) -> str | None:
        """The checkpoint name of bumblebee tensor ``name`` (None: not this entry's)."""
        return _swap(name, self.ours, self.theirs)

    def model_name(self, stored: str) -> str | None:
        """The bumblebee name of checkpoint tensor ``stored`` (None: not this entry's)."""
        return _swap(stored, self.theirs, self.ours)

    def stored_shape(self, shape: tuple) -> tuple:
        shape = tuple(shape)
        return shape[:-2] + (shape[-1], shape[-2]) if self.transpose else shape

    def to_checkpoint(self, t: torch.Tensor) -> torch.Tensor:
        if self.interleave is not None:
            d = self.interleave
            t = torch.stack(t.chunk(2, dim=d), dim=d).flatten(d - 1, d)
        return (t.transpose(-1, -2) if self.transpose else t).contiguous()

    def from_checkpoint(self, t: torch.Tensor) -> torch.Tensor:
        if self.transpose:
            t = t.transpose(-1, -2)
        if self.interleave is not None:
            d = self.interleave
            pairs = t.unflatten(d, (t.shape[d] // 2, 2))
            t = torch.cat([pairs.select(d, 0), pairs.select(d, 1)], dim=d)
        return t.contiguous()


def _swap(name: str, old: str, new: str) -> str | None:
    if name == old or name.endswith("." + old):
        return name[: len(name) - len(old)] + new
    return None


def stored_entry(entries, name: str) -> StoredAs | None:
    """The entry of ``entries`` that bumblebee tensor ``name`` is stored under (None: as is)."""
    return next((e for e in entries if e.checkpoint_name(name) is not None), None)


def model_name(entries, stored: str) -> str:
    """Checkpoint name -> bumblebee name under ``entries`` (unchanged when none matches)."""
    return next((n for e in entries if (n := e.model_name(stored)) is not None), stored)
