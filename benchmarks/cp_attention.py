"""Context-parallel attention: per-rank peak memory and forward+backward time of one
attention call, cp = 1 (single-process causal SDPA) vs cp = 2 / 4 with ``allgather``
(the reference) and ``ring``, over gloo on this machine.

    python benchmarks/cp_attention.py                      # 16K, 32K, 64K tokens
    python benchmarks/cp_attention.py --seq 4096 8192      # quick

Shapes follow the tiny preset's attention scaled up: 4 query heads, 2 KV heads,
head dim 64, one sequence of packed 8K-token documents (a single document when
the sequence is shorter). Memory is the peak of live tensors inside the call
(perf.memory.MemoryTracker), inputs excluded.
"""

from __future__ import annotations

import argparse
import os
import time
import uuid

import torch
import torch.distributed as dist
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from bumblebee import registry
from bumblebee.perf.memory import MemoryTracker
from bumblebee.primitives.cp.zigzag import build_cp_shards, shard_sequence
from bumblebee.primitives.packed import doc_layout

HEADS, KV_HEADS, DIM, DOC = 4, 2, 64, 8192


def inputs(seq: int):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, HEADS, seq, DIM, generator=g)
    k = torch.randn(1, KV_HEADS, seq, DIM, generator=g)
    v = torch.randn(1, KV_HEADS, seq, DIM, generator=g)
    pos = (torch.arange(seq) % min(DOC, seq))[None]
    return q, k, v, pos


def timed(fn, *args):
    """(seconds, peak bytes) of forward + backward; the best of 2 runs after a warm-up."""
    best, peak = float("inf"), 0
    for i in range(3):
        leaves = [a.detach().requires_grad_() for a in args[:3]]
        start = time.perf_counter()
        with MemoryTracker("cpu") as mem:
            out = fn(*leaves, *args[3:])
            out.backward(torch.ones_like(out))
        elapsed = time.perf_counter() - start
        if i:
            best, peak = min(best, elapsed), max(peak, mem.peak_bytes)
    return best, peak


def single(seq: int):
    q, k, v, pos = inputs(seq)
    attend = registry.get("attention", "varlen").factory
    return timed(attend, q, k, v, doc_layout(pos), DIM**-0.5)


def worker(seqs, impls):
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    C, r = dist.get_world_size(), dist.get_rank()
    out = {}
    for seq in seqs:
        q, k, v, pos = inputs(seq)
        # shard along the token dim (dim 2 of [B, heads, T, D])
        q, k, v = (
            shard_sequence(x.transpose(1, 2), C, r).transpose(1, 2).contiguous() for x in (q, k, v)
        )
        layout = build_cp_shards(shard_sequence(pos, C, r), dist.group.WORLD)
        for impl in impls:
            out[(seq, impl)] = timed(
                registry.get("cp_attention", impl).factory, q, k, v, layout, DIM**-0.5
            )
    dist.destroy_process_group()
    return out


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--seq", type=int, nargs="+", default=[16384, 32768, 65536])
    p.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--impls", nargs="+", default=["allgather", "ring"])
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    rows = [(seq, 1, "sdpa (varlen)", *single(seq)) for seq in args.seq]
    for cp in args.cp:
        cfg = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=cp,
            run_id=uuid.uuid4().hex[:8],
            rdzv_backend="c10d",
            rdzv_endpoint="127.0.0.1:0",
            max_restarts=0,
            start_method="spawn",
        )
        per_rank = elastic_launch(cfg, worker)(args.seq, args.impls)
        for seq in args.seq:
            for impl in args.impls:
                t = max(per_rank[r][(seq, impl)][0] for r in range(cp))
                m = max(per_rank[r][(seq, impl)][1] for r in range(cp))
                rows.append((seq, cp, impl, t, m))
    base = {seq: (t, m) for seq, cp, _, t, m in rows if cp == 1}
    print(
        f"{'tokens':>8} {'cp':>3} {'impl':<14} {'time s':>8} {'x cp=1':>7} {'peak MiB/rank':>14} {'x cp=1':>7}"
    )
    for seq, cp, impl, t, m in sorted(rows):
        print(
            f"{seq:>8} {cp:>3} {impl:<14} {t:>8.2f} {t / base[seq][0]:>7.2f} {m / 2**20:>14.1f} "
            f"{m / base[seq][1]:>7.2f}"
        )
    print(
        "time: slowest rank, best of 2 after a warm-up; ranks share this machine's cores, so cp > 1 "
        "time measures work per rank plus exchange, not a speed-up"
    )


if __name__ == "__main__":
    main()
