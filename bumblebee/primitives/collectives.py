"""``torch.distributed``'s equal-size all-gather and reduce-scatter under the name the running
torch gives them, found by ``hasattr``: ``all_gather_single`` / ``reduce_scatter_single`` where
they exist (the newer names; their ``*_tensor`` forms warn as deprecated there), else
``all_gather_into_tensor`` / ``reduce_scatter_tensor`` (torch 2.11 has only these). Same
arguments, same semantics.

Looked up at every call, not at import: ``comm_check.CheckedComm`` swaps the module's attributes
for checked versions while it is active.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group=None, async_op=False):
    """Every rank's ``input`` back to back in ``output`` (world x input's size)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def reduce_scatter_single(
    output: torch.Tensor, input: torch.Tensor, group=None, op=dist.ReduceOp.SUM, async_op=False
):
    """``input`` (world x output's size) reduced over the ranks, this rank's slot in ``output``."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, op=op, group=group, async_op=async_op)
