"""DeepSeek Sparse Attention under context parallelism: bytes a rank receives from the other CP
ranks per layer step, selected-fetch (the default) against the latents' all-gather and against
dense ring attention, measured on a small case and by formula at long lengths.

Measured: one ``SparseLatentAttention`` layer at DeepSeek-V3.2's attention dims (128 heads, kv
latent 512, rope 64, nope / value 128, q LoRA 1536, indexer 64 heads x 128; the hidden size is
shrunk, it does not enter what crosses the group) on ``--cp`` gloo ranks, bf16, ``--seq`` tokens
(zigzag shards), top ``--topk`` keys, random weights, forward + backward. Every collective is
wrapped and what the rank receives from *other* ranks is counted (all-gather: (cp - 1) inputs;
all-to-all: the received splits but the rank's own; the reduce-scatter of the backward, an
all-reduce on gloo: counted as the reduce-scatter it stands for, (cp - 1) / cp of the buffer).
Two runs: ``dsa_impl = blockwise`` (fetch only the selected latents, ``dsa_cp.py``) and
``dsa_impl = reference`` (all-gathers the row's latents and indexer keys, the path before the
fetch; also the dense warm-up stage's). The union fraction is the remote rows fetched over the
remote rows an all-gather brings ((cp - 1) x local tokens).

Formula (``plan/dsa_terms.py::dsa_cp_traffic``), per local token, at union 1 (the planner's
bound) and at the measured union: fetch, all-gather, MLA's latent ring (C + R per hop), and the
expanded-head ring (K and padded V of 128 heads: 2 x N x (Dn + R) per hop; what a GQA-style ring
moves for these heads); forward, backward twice the ring's (K/V there and their gradients back).

    python benchmarks/dsa_cp_bytes.py [--cp 2] [--seq 1024] [--topk 64]
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bumblebee.models import arch_from_hf_dict
from bumblebee.models.deepseek_v32 import PRESETS
from bumblebee.plan.dsa_terms import dsa_cp_traffic
from bumblebee.plan.layout import Layout
from bumblebee.primitives.attention.sparse_mla import SparseLatentAttention
from bumblebee.primitives.cp.zigzag import build_cp_shards, shard_sequence
from bumblebee.primitives.recompute import NoRecompute
from bumblebee.primitives.rope import rope_cos_sin

HIDDEN, N, C, R, DN, DV, QR, HI, DI = 256, 128, 512, 64, 128, 128, 1536, 64, 128


def counting(cp, rank, phase, store):
    def received(name, args, kwargs):
        if name == "all_gather":
            return args[1].numel() * args[1].element_size() * (cp - 1)
        if name == "all_reduce":  # GatherSequence's backward on gloo: stands for a reduce-scatter
            return args[0].numel() * args[0].element_size() * (cp - 1) / cp
        out, splits = args[0], (args[2] if len(args) > 2 else None)
        row = out.element_size() * (out[0].numel() if out.dim() else 1)
        if splits is None:
            return row * out.shape[0] * (cp - 1) / cp
        return row * (sum(splits) - splits[rank])

    def wrap(fn):
        def inner(*args, **kwargs):
            n = received(fn.__name__, args, kwargs)
            store[phase[0]] = store.get(phase[0], 0) + n
            return fn(*args, **kwargs)

        return inner

    return wrap


def rank_main(rank, cp, seq, topk, impl, path, queue):
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=cp)
    torch.manual_seed(0)
    layer = SparseLatentAttention(
        HIDDEN, N, index_heads=HI, index_dim=DI, index_topk=topk, index_rope_interleave=False,
        q_lora_rank=QR, kv_lora_rank=C, qk_nope_head_dim=DN, qk_rope_head_dim=R, v_head_dim=DV,
        eps=1e-6, scale=(DN + R) ** -0.5, rope_interleave=True, attend=None, impl=impl,
        recompute=NoRecompute(),
    ).to(torch.bfloat16)  # fmt: skip
    pos = torch.arange(seq)[None]
    layout = build_cp_shards(shard_sequence(pos, cp, rank), dist.group.WORLD)
    x = shard_sequence(torch.randn(1, seq, HIDDEN), cp, rank).to(torch.bfloat16)
    x.requires_grad_()
    cos, sin = rope_cos_sin(shard_sequence(pos, cp, rank), R, 10000.0, torch.bfloat16)
    phase, store = ["forward"], {}
    names = ("all_gather", "all_reduce", "all_to_all_single")
    real = {n: getattr(dist, n) for n in names}
    for n, fn in real.items():
        setattr(dist, n, counting(cp, rank, phase, store)(fn))
    out = layer(x, cos, sin, layout)
    phase[0] = "backward"
    out.float().sum().backward()
    for n, fn in real.items():
        setattr(dist, n, fn)
    queue.put((rank, {k: v / x.shape[1] for k, v in store.items()}))
    dist.destroy_process_group()


def measure(cp, seq, topk, impl):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    path = os.path.join(tempfile.mkdtemp(), "store")
    procs = [
        ctx.Process(target=rank_main, args=(r, cp, seq, topk, impl, path, queue)) for r in range(cp)
    ]
    for p in procs:
        p.start()
    got = dict(queue.get() for _ in procs)
    for p in procs:
        p.join()
    return got


def formula_rows(union: float):
    spec = arch_from_hf_dict(PRESETS["deepseek-v3.2"]).to_spec()
    dense_hop = 2 * N * (DN + R) * 2
    print(f"formula (DeepSeek-V3.2, bf16, KiB per local token; fetch at union {union:.2f}):")
    print(
        "  seq     cp  fetch fwd/bwd   all-gather fwd/bwd   latent ring fwd/bwd   dense ring fwd/bwd"
    )
    for seq in (8192, 32768, 131072):
        for cp in (2, 4, 8):
            t = seq // cp
            m = dsa_cp_traffic(spec, Layout(cp=cp), t, union)
            k = 1024 * t
            ring = (cp - 1) * dense_hop / 1024
            print(
                f"  {seq:6d} {cp:3d}  {m['forward'] / k:6.2f}/{m['backward'] / k:6.2f}"
                f"     {m['allgather'] / k:6.2f}/{m['allgather'] / k:6.2f}"
                f"        {m['latent_ring'] / k:6.2f}/{2 * m['latent_ring'] / k:6.2f}"
                f"         {ring:7.1f}/{2 * ring:7.1f}"
            )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--topk", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(1)
    t = args.seq // args.cp
    print(f"measured: cp {args.cp}, {args.seq} tokens, top-{args.topk}, bf16, KiB per local token")
    union = []
    for impl, name in (("blockwise", "selected-fetch"), ("reference", "all-gather")):
        got = measure(args.cp, args.seq, args.topk, impl)
        for r in sorted(got):
            fwd, bwd = got[r].get("forward", 0), got[r].get("backward", 0)
            print(f"  {name:15s} rank {r}: forward {fwd / 1024:.2f}, backward {bwd / 1024:.2f}")
            if impl == "blockwise":  # remote rows = (forward - indexer keys - counts) / (row + id)
                keys = (args.cp - 1) * DI * 2
                rows = (fwd - keys - 8 * (args.cp - 1) / t) / ((C + R) * 2 + 4)
                union.append(rows / (args.cp - 1))
    u = sum(union) / len(union)
    print(
        f"  union fraction (remote rows fetched / an all-gather's): {', '.join(f'{x:.3f}' for x in union)}"
    )
    formula_rows(1.0)
    formula_rows(u)


if __name__ == "__main__":
    main()
