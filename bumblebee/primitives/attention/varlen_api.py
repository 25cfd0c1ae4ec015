"""torch's flash operators over packed sequences (``torch.ops.torch_attn._varlen_attn`` and its
backward), called the same way on every supported torch.

torch 2.13's forward operator takes an ``enable_gqa`` flag after ``window_size`` (and more after
it); torch 2.11's ends at ``window_size`` and takes grouped K/V as they are (flash attention
needs only query heads a multiple of K/V heads). Which one is installed is read from the
operator's schema (``external_calls.VARLEN_ATTN_OP.take``), not from a version string. The
public ``varlen_attn`` differs the same way: ``gqa_keyword``.

Legend: S packed query tokens, Sk packed key tokens, N query heads, K kv heads, D head dim.
"""

from __future__ import annotations

import torch

from bumblebee.primitives.external_calls import (
    VARLEN_ATTN,
    VARLEN_ATTN_BACKWARD_OP,
    VARLEN_ATTN_OP,
)


def gqa_keyword(heads_q: int, heads_k: int) -> dict[str, bool]:
    """The ``enable_gqa`` keyword for ``varlen_attn`` where the installed torch takes it."""
    return VARLEN_ATTN.take(enable_gqa=heads_q != heads_k)


def forward(q_SND, k_SKD, v_SKD, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale,
            window_size) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(o [S, N, D], lse fp32 [N, S]) of the flash forward operator."""
    o, lse, _ = VARLEN_ATTN_OP.call(
        VARLEN_ATTN_OP.load(), q_SND, k_SKD, v_SKD, cu_q, cu_k, max_q, max_k, causal, scale,
        list(window_size), **VARLEN_ATTN_OP.take(enable_gqa=k_SKD.shape[1] != q_SND.shape[1]),
    )  # fmt: skip
    return o, lse


def backward(do_SND, q_SND, k_SKD, v_SKD, o_SND, lse, cu_q, cu_k, max_q: int, max_k: int,
             causal: bool, scale, window_size):  # fmt: skip
    """(dq, dk, dv) of the flash backward operator, from the final (output, LSE) given."""
    rng = torch.zeros(2, dtype=torch.uint64, device=q_SND.device)  # no dropout: unused
    return VARLEN_ATTN_BACKWARD_OP.call(
        VARLEN_ATTN_BACKWARD_OP.load(), do_SND, q_SND, k_SKD, v_SKD, o_SND, lse, cu_q, cu_k,
        max_q, max_k, causal, rng, scale, list(window_size),
    )  # fmt: skip
