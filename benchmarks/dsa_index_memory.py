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

    python benchmarks/dsa_index_memory.py [--lengths 16384 32768 65536 131072] [--block 128]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from bumblebee.perf.memory import MemoryTracker
from bumblebee.primitives.attention.dsa import (
    allowed,
    index_scores,
    select_top,
    selection_scores,
)

HI, DI, TOPK = 64, 128, 2048


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
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for S in args.lengths:
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
