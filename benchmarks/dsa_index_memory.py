"""DeepSeek Sparse Attention's indexer buffers on the CPU: live-tensor peak of one query block's
top-k selection against S keys, at DeepSeek-V3.2's indexer dims (64 heads x 128, fp32), over S.

The last query block of a causal row scores every key, so its selection is the largest transient
of the blockwise core (``primitives/attention/dsa.py``) and of the CP selection (``dsa_cp.py``).
Two formulations, no gradient (the selection has none):

- ``heads_at_once``: the per-head products [block, Hi, S] fp32 in one einsum, then the weighted
  sum (``index_scores``, what the core ran before the head loop);
- ``head_loop``: ``selection_scores``, one head at a time into a running [block, S] sum.

Both then mask and take the top-k (``select_top``). Peak: ``perf/memory.py`` (inputs excluded).
``--old-max`` caps the one-einsum runs (they need Hi x block x S x 4 B: 2 GiB at 64K).

``--warmup``: the dense warm-up stage's block instead (``dsa._block`` with ``dense``: every
allowed key, no selection), as the stage runs it: bf16, the main attention frozen (absorbed q
and latents without gradient, N = 128, C + R = 576), the indexer trained, under its checkpoint;
the forward's and the backward's (recompute + indexer gradient) peaks. ``previous``: the block
before the head loops (``[block, Hi, S]`` indexer products and ``[block, N, S]`` scores in one
einsum each); ``head_loop``: the current one.

    python benchmarks/dsa_index_memory.py [--lengths 16384 32768 65536 131072] [--block 128]
    python benchmarks/dsa_index_memory.py --warmup --lengths 16384 32768
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.utils.checkpoint import checkpoint

from bumblebee.perf.memory import MemoryTracker
from bumblebee.primitives.attention.dsa import (
    _attend,
    _block,
    _kl,
    allowed,
    index_scores,
    select_top,
    selection_scores,
)

HI, DI, TOPK = 64, 128, 2048
N, C, R = 128, 512, 64  # DeepSeek-V3.2's heads and latents


def previous_dense_block(q_abs, lat, qi, ki, w, qpos, doc_q, doc_k, scale, index_scale):
    """The dense warm-up block before the head loops (one einsum per product)."""
    end = int(qpos[-1]) + 1
    ok = allowed(qpos, doc_q, doc_k, end)
    scores = index_scores(qi, ki[:, :end], w, index_scale)
    o, p = _attend(q_abs, lat[:, :end], ok, scale, C)
    return o, _kl(p, scores, ok)


def head_loop_dense_block(q_abs, lat, qi, ki, w, qpos, doc_q, doc_k, scale, index_scale):
    return _block(q_abs, lat, qi, ki, w, qpos, doc_q, doc_k, 0, scale, index_scale, True, C)


def run_warmup(kind: str, S: int, block: int) -> dict:
    qpos, doc = torch.arange(S - block, S), torch.zeros(1, S, dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    bf = torch.bfloat16

    def r(*shape, grad=True, dtype=bf):
        return torch.randn(*shape, generator=g).to(dtype).requires_grad_(grad)

    q_abs, lat = r(1, block, N, C + R, grad=False), r(1, S, C + R, grad=False)
    qi, ki, w = r(1, block, HI, DI), r(1, S, DI), r(1, block, HI, dtype=torch.float32)
    fn = previous_dense_block if kind == "previous" else head_loop_dense_block
    args = (q_abs, lat, qi, ki, w, qpos, doc[:, qpos], doc, 0.1, DI**-0.5)
    t0 = time.perf_counter()
    with MemoryTracker() as fwd:
        o, kl = checkpoint(fn, *args, use_reentrant=False)
    with MemoryTracker() as bwd:
        kl.backward()
    seconds = time.perf_counter() - t0
    return {
        "kind": f"warmup_{kind}",
        "S": S,
        "block": block,
        "seconds": round(seconds, 2),
        "fwd_peak_MiB": round(fwd.peak_bytes / 2**20, 1),
        "bwd_peak_MiB": round(bwd.peak_bytes / 2**20, 1),
        "block_x_S_fp32_MiB": block * S * 4 / 2**20,
    }


@torch.no_grad()
def run(kind: str, S: int, block: int) -> dict:
    g = torch.Generator().manual_seed(0)
    qi = torch.randn(1, block, HI, DI, generator=g)
    ki = torch.randn(1, S, DI, generator=g)
    w = torch.randn(1, block, HI, generator=g) * HI**-0.5
    qpos = torch.arange(S - block, S)
    doc = torch.zeros(1, S, dtype=torch.long)
    fn = index_scores if kind == "heads_at_once" else selection_scores
    with MemoryTracker() as mem:
        t0 = time.perf_counter()
        ok = allowed(qpos, doc[:, qpos], doc, S)
        idx = select_top(fn(qi, ki, w, DI**-0.5).masked_fill_(~ok, float("-inf")), TOPK)
        seconds = time.perf_counter() - t0
    del idx
    return {
        "kind": kind,
        "S": S,
        "block": block,
        "seconds": round(seconds, 2),
        "peak_MiB": round(mem.peak_bytes / 2**20, 1),
        "block_x_S_fp32_MiB": block * S * 4 / 2**20,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768, 65536, 131072])
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--old-max", type=int, default=65536)
    ap.add_argument("--json", default="")
    ap.add_argument("--warmup", action="store_true", help="the dense warm-up block (docstring)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for S in args.lengths if args.warmup else ():
        for kind in ("head_loop", "previous"):
            rows.append(run_warmup(kind, S, args.block))
            print(json.dumps(rows[-1]), flush=True)
    for S in () if args.warmup else args.lengths:
        for kind in ("head_loop", "heads_at_once"):
            if kind == "heads_at_once" and S > args.old_max:
                continue
            rows.append(run(kind, S, args.block))
            print(json.dumps(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
