"""DeepSeek Sparse Attention under context parallelism: bytes each rank hands to the collectives
per layer step (forward + backward), beside what a dense ring of expanded heads would send.

One ``SparseLatentAttention`` layer at DeepSeek-V3.2's attention dims (128 heads, kv latent 512,
rope 64, nope / value 128, q LoRA 1536, indexer 64 heads x 128; the hidden size is shrunk, it
does not enter what crosses the group) on ``--cp`` gloo ranks, bf16, ``--seq`` tokens (zigzag
shards). Every tensor given to ``all_gather`` / ``all_reduce`` / ``reduce_scatter_single`` is
counted; the totals are divided by the rank's tokens. The DSA layer all-gathers the row's latents
[C + R] and indexer keys [Di] (forward) and returns their gradients (backward: a reduce-scatter
on NCCL; gloo has none, so an all-reduce of every rank's slices, counted as run). The dense
reference is MLA's expanded-head ring (``benchmarks/mla_cp_bytes.py``): K and padded V,
2 x N x (Dn + R) values per token and hop, cp - 1 hops forward, twice that backward (K/V and
their gradients).

    python benchmarks/dsa_cp_bytes.py [--cp 2] [--seq 1024]
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bumblebee.primitives.attention.sparse_mla import SparseLatentAttention
from bumblebee.primitives.cp.zigzag import build_cp_shards, shard_sequence
from bumblebee.primitives.recompute import NoRecompute
from bumblebee.primitives.rope import rope_cos_sin

HIDDEN, N, C, R, DN, DV, QR, HI, DI = 256, 128, 512, 64, 128, 128, 1536, 64, 128


def count(phase, store):
    def wrap(fn):
        def inner(*args, **kwargs):
            src = args[1] if fn.__name__ == "all_gather" else args[0]
            if fn.__name__ == "reduce_scatter_single":
                src = args[1]
            store[phase[0]] = store.get(phase[0], 0) + src.numel() * src.element_size()
            return fn(*args, **kwargs)

        return inner

    return wrap


def rank_main(rank, cp, seq, path, queue):
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=cp)
    torch.manual_seed(0)
    layer = SparseLatentAttention(
        HIDDEN, N, index_heads=HI, index_dim=DI, index_topk=256, index_rope_interleave=False,
        q_lora_rank=QR, kv_lora_rank=C, qk_nope_head_dim=DN, qk_rope_head_dim=R, v_head_dim=DV,
        eps=1e-6, scale=(DN + R) ** -0.5, rope_interleave=True, attend=None,
        recompute=NoRecompute(),
    ).to(torch.bfloat16)  # fmt: skip
    pos = torch.arange(seq)[None]
    layout = build_cp_shards(shard_sequence(pos, cp, rank), dist.group.WORLD)
    x = shard_sequence(torch.randn(1, seq, HIDDEN), cp, rank).to(torch.bfloat16)
    x.requires_grad_()
    cos, sin = rope_cos_sin(shard_sequence(pos, cp, rank), R, 10000.0, torch.bfloat16)
    phase, store = ["forward"], {}
    real = {n: getattr(dist, n) for n in ("all_gather", "all_reduce", "reduce_scatter_single")}
    for n, fn in real.items():
        setattr(dist, n, count(phase, store)(fn))
    out = layer(x, cos, sin, layout)
    phase[0] = "backward"
    out.float().sum().backward()
    for n, fn in real.items():
        setattr(dist, n, fn)
    queue.put((rank, {k: v / x.shape[1] for k, v in store.items()}))
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--seq", type=int, default=1024)
    args = ap.parse_args()
    torch.set_num_threads(1)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    path = os.path.join(tempfile.mkdtemp(), "store")
    procs = [
        ctx.Process(target=rank_main, args=(r, args.cp, args.seq, path, queue))
        for r in range(args.cp)
    ]
    for p in procs:
        p.start()
    got = dict(queue.get() for _ in procs)
    for p in procs:
        p.join()
    dense_hop = 2 * N * (DN + R) * 2  # K + padded V per token and hop, bf16
    print(f"cp {args.cp}, {args.seq} tokens, bf16, bytes per local token handed to collectives:")
    for r in sorted(got):
        print(f"  rank {r}: " + ", ".join(f"{k} {v / 1024:.2f} KiB" for k, v in got[r].items()))
    print(
        f"  dense expanded-head ring (K + padded V): forward {(args.cp - 1) * dense_hop / 1024:.1f} KiB,"
        f" backward {2 * (args.cp - 1) * dense_hop / 1024:.1f} KiB"
    )


if __name__ == "__main__":
    main()
