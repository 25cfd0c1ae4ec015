"""DeepSeek Sparse Attention on the CPU: peak memory and step time of one sparse layer against
the same layer attending densely, over sequence length.

One MLA layer (small dims: ``DIMS``) with a lightning indexer, fp32, forward + backward of
``sum(output)`` on one row of ``--lengths`` tokens. Two ways:

- ``sparse``: ``SparseLatentAttention`` with the blockwise core (top ``--topk`` keys per query,
  gathered latents, checkpointed query blocks; the indexer's KL included);
- ``dense``: plain MLA (``MultiHeadLatentAttention``, same dims and weights) through the
  ``varlen`` core (causal SDPA, no [T, T] mask): what the layer costs without the indexer.

Peak is the live-tensor peak of the step (``perf/memory.py``; inputs and weights excluded, the
activations and gradients of the step counted). ``--dense-max`` caps the dense runs (the slow ones).

    python benchmarks/dsa_cpu.py [--lengths 4096 8192 16384 32768 65536] [--topk 2048]
        [--dense-max 16384] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from bumblebee.perf.memory import MemoryTracker
from bumblebee.primitives.attention.mla import MultiHeadLatentAttention
from bumblebee.primitives.attention.sdpa import sdpa_varlen
from bumblebee.primitives.attention.sparse_mla import SparseLatentAttention
from bumblebee.primitives.packed import doc_layout
from bumblebee.primitives.recompute import NoRecompute
from bumblebee.primitives.rope import rope_cos_sin

HIDDEN, HEADS = 256, 16
DIMS = dict(q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16)
INDEXER = dict(index_heads=4, index_dim=32)


def layer(kind: str, topk: int, block: int):
    mla = dict(
        **DIMS, v_head_dim=32, eps=1e-6, scale=48**-0.5, rope_interleave=True,
        recompute=NoRecompute(),
    )  # fmt: skip
    torch.manual_seed(0)
    if kind == "dense":
        return MultiHeadLatentAttention(HIDDEN, HEADS, attend=sdpa_varlen, **mla)
    return SparseLatentAttention(
        HIDDEN, HEADS, index_topk=topk, index_rope_interleave=False, block=block, attend=None,
        **INDEXER, **mla,
    )  # fmt: skip


def step(kind: str, T: int, topk: int, block: int) -> dict:
    m = layer(kind, topk, block)
    x = torch.randn(1, T, HIDDEN, requires_grad=True)
    pos = torch.arange(T)[None]
    cos, sin = rope_cos_sin(pos, DIMS["qk_rope_head_dim"], 10000.0, torch.float32)
    lay = doc_layout(pos)
    with MemoryTracker() as mem:
        t0 = time.perf_counter()
        m(x, cos, sin, lay).sum().backward()
        seconds = time.perf_counter() - t0
    return {"kind": kind, "T": T, "seconds": round(seconds, 2), "peak_MiB": mem.peak_bytes / 2**20}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536])
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--dense-max", type=int, default=16384)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for T in args.lengths:
        for kind in ("sparse", "dense"):
            if kind == "dense" and T > args.dense_max:
                continue
            rows.append(step(kind, T, args.topk, args.block))
            print(json.dumps(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"topk": args.topk, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
