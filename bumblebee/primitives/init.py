"""Layout-independent random initialization, one block of rows at a time.

A model is built on the meta device, split (pipeline stage, expert slice, FSDP2 shard)
and only then given memory, so a rank never holds more than its own share. Its random
initial values must nevertheless be the same full tensors whatever the layout, or the
"same loss on any layout" invariant breaks. This module makes every value a function
of (seed, parameter name, position) only:

- a tensor of global shape [R, ...] is cut along dim 0 into fixed blocks of
  ``rows_per_block(shape)`` rows (about 4 M elements, at least one row); the cut depends
  on the global shape alone;
- block b is filled by a fresh CPU generator seeded with a hash of (seed, name, b)
  (counter-based in spirit: no block depends on another block's draws);
- a rank owning rows [lo, hi) (every layout owns whole rows of dim 0: an FSDP2 shard,
  a block of experts) generates only the blocks overlapping them and copies the
  overlap, so the transient is one block (<= 16 MB in fp32), never the tensor.

Values are generated on the CPU in fp32 and copied to the tensor's device and dtype,
so CPU and CUDA runs start from the same weights too.

A fill rule is ``fill(block, generator)`` writing iid values in place: ``normal``,
``const``, ``log_uniform``.
"""

from __future__ import annotations

import hashlib
import math

import torch

BLOCK_ELEMENTS = 1 << 22


def normal(std: float):
    def fill(t: torch.Tensor, g: torch.Generator) -> None:
        t.normal_(0.0, std, generator=g)

    return fill


def const(value: float):
    def fill(t: torch.Tensor, g: torch.Generator) -> None:
        t.fill_(value)

    return fill


def log_uniform(lo: float, hi: float):
    """log(U(lo, hi)) (e.g. Gated DeltaNet's A_log: A = exp(A_log) ~ U(0.01, 16))."""

    def fill(t: torch.Tensor, g: torch.Generator) -> None:
        t.uniform_(lo, hi, generator=g).log_()

    return fill


def rows_per_block(shape: tuple[int, ...]) -> int:
    return max(1, BLOCK_ELEMENTS // max(1, math.prod(shape[1:])))


def block_seed(seed: int, name: str, block: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{name}:{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@torch.no_grad()
def fill_rows(
    local: torch.Tensor,
    shape: tuple[int, ...],
    lo: int,
    fill,
    seed: int,
    name: str,
    *,
    on_device: bool = False,
) -> None:
    """Write rows [lo, lo + local.shape[0]) of the global tensor ``name`` (global ``shape``) into
    ``local``, each block of rows drawn from its own generator (see the module docstring).
    ``on_device``: draw on ``local``'s device (another device's generator gives other values, so
    only runs initialized on one device type share weights; a real-width CPU draw takes minutes)."""
    if local.numel() == 0:
        return
    dev = local.device if on_device else torch.device("cpu")
    if len(shape) == 0:  # a scalar: one block of one element
        block = torch.empty((), dtype=torch.float32, device=dev)
        fill(block, torch.Generator(device=dev).manual_seed(block_seed(seed, name, 0)))
        local.copy_(block)
        return
    hi = lo + local.shape[0]
    per = rows_per_block(shape)
    for b in range(lo // per, (hi - 1) // per + 1):
        b_lo, b_hi = b * per, min((b + 1) * per, shape[0])
        block = torch.empty((b_hi - b_lo, *shape[1:]), dtype=torch.float32, device=dev)
        fill(block, torch.Generator(device=dev).manual_seed(block_seed(seed, name, b)))
        s, e = max(lo, b_lo), min(hi, b_hi)
        local[s - lo : e - lo].copy_(block[s - b_lo : e - b_lo])
