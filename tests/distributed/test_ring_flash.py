"""The CUDA ring's glue on CPU: ``ring_flash`` (per-step varlen calls with per-step
cu_seqlens, host-side pair selection, LSE merge, backward with the final O and LSE) run
with ``reference_block_kernel`` -- the flash ops' contract in fp32 PyTorch -- equals the
all-gather reference on 2 and 4 ranks, for documents crossing zigzag chunk borders, GQA,
two rows. Also: the CPU ring's forward keeps fp32 scores under bf16 autocast (forward and
backward agree)."""

import contextlib

import torch
import torch.distributed as dist
from dist_utils import run_distributed

from bumblebee.primitives.cp.allgather import allgather_attention
from bumblebee.primitives.cp.ring import RingAttention
from bumblebee.primitives.cp.ring_flash import (
    reference_block_kernel,
    ring_flash_attention,
    step_pairs,
)
from bumblebee.primitives.cp.zigzag import build_cp_shards, shard_sequence

T, N, K, D = 48, 4, 2, 8
DOCS = [[5, 20, 7, 16], [47, 1]]  # per row; pieces cross chunk borders at cp = 2 and 4


def positions():
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in DOCS])


def _inputs():
    g = torch.Generator().manual_seed(0)
    B = len(DOCS)
    return (
        torch.randn(B, N, T, D, generator=g),
        torch.randn(B, K, T, D, generator=g),
        torch.randn(B, K, T, D, generator=g),
        torch.randn(B, N, T, D, generator=g),
    )


def _ranks(rank, world):
    q, k, v, do = _inputs()
    shard = lambda x: shard_sequence(x.transpose(1, 2), world, rank).transpose(1, 2).contiguous()  # noqa: E731
    layout = build_cp_shards(shard_sequence(positions(), world, rank), dist.group.WORLD)
    out = {}
    for name, fn in (
        ("allgather", allgather_attention),
        ("ring_flash", lambda *a: ring_flash_attention(*a, kernel=reference_block_kernel())),
    ):
        xs = [shard(x).requires_grad_() for x in (q, k, v)]
        o = fn(*xs, layout, 0.35)
        o.backward(shard(do))
        out[name] = [o.detach()] + [x.grad for x in xs]
    calls = sum(len(step_pairs(layout, (rank - s) % world)) for s in range(world))
    return out, calls


def test_ring_flash_glue_matches_allgather():
    for world in (2, 4):
        for rank, (out, calls) in enumerate(run_distributed(_ranks, world)):
            for what, a, b in zip(("o", "dq", "dk", "dv"), out["ring_flash"], out["allgather"]):
                err = ((a - b).norm() / b.norm()).item()
                assert err < 1e-5, f"cp={world} rank {rank} {what}: relative error {err:.1e}"
            assert calls <= 3 * world, calls  # at most 3 of the 4 chunk pairs per step need a call


def _autocast_ranks(rank, world):
    q, k, v, _ = _inputs()
    shard = lambda x: shard_sequence(x.transpose(1, 2), world, rank).transpose(1, 2).contiguous()  # noqa: E731
    layout = build_cp_shards(shard_sequence(positions(), world, rank), dist.group.WORLD)
    xs = [shard(x).to(torch.bfloat16) for x in (q, k, v)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o_auto = RingAttention.apply(*xs, layout, 0.35)
    o_fp32 = allgather_attention(*(x.float() for x in xs), layout, 0.35)
    ref = o_fp32.to(torch.bfloat16).float()  # the same final rounding
    return ((o_auto.float() - ref).norm() / ref.norm()).item()


def test_ring_forward_scores_fp32_under_autocast():
    for err in run_distributed(_autocast_ranks, 2):
        assert err < 1e-3, err  # bf16 scores (the old forward) give ~5e-3


def _one_row_ranks(rank, world, checked):
    """One row per micro-batch, K/V as the model hands them over: [B, L, H, D] projections with
    partial RoPE (rotated dims concatenated to the rest), transposed to [B, H, L, D]; for one row
    the flattened blocks are strided views, and the ring must still send and receive them whole."""
    from bumblebee.primitives.comm_check import CheckedComm

    g = torch.Generator().manual_seed(1)
    pos = torch.cat([torch.arange(n) for n in (9, 30, 9)])[None]
    L = 48 // world
    layout = build_cp_shards(shard_sequence(pos, world, rank), dist.group.WORLD)

    def heads(H):  # [1, L, H, D] -> cat(rotated half, pass half) -> [1, H, L, D], non-contiguous
        x = torch.randn(1, 48, H, D, generator=g)
        x = shard_sequence(x, world, rank)
        return torch.cat([x[..., : D // 2].flip(-1), x[..., D // 2 :]], -1).transpose(1, 2)

    q, k, v = heads(N), heads(K), heads(K)
    do = torch.randn(1, N, L, D, generator=g)
    assert not k.is_contiguous()
    out = {}
    for name, fn in (
        ("allgather", allgather_attention),
        ("ring_flash", lambda *a: ring_flash_attention(*a, kernel=reference_block_kernel())),
    ):
        xs = [x.detach().requires_grad_() for x in (q, k, v)]
        with CheckedComm() if checked else contextlib.nullcontext():
            o = fn(*(x.clone() for x in xs), layout, 0.35)  # clone keeps the strides
        o.backward(do)
        out[name] = [o.detach()] + [x.grad for x in xs]
    return max(
        ((a - b).norm() / b.norm()).item() for a, b in zip(out["ring_flash"], out["allgather"])
    )


def test_ring_one_row_strided_kv():
    # planted: ring_comm's receive buffers as torch.empty_like(strided block) -> gloo raises
    # "input tensor has to be contiguous"; CheckedComm names the buffer (NCCL would scramble it)
    for checked in (False, True):
        for err in run_distributed(_one_row_ranks, 2, checked):
            assert err < 1e-5, err
