"""Weight sync to a rollout engine: tensor by tensor vs in buckets, over gloo on 2 ranks.

Rank 0 trains (an ``Engine`` on both ranks, fsdp2 dp = 2), rank 1 also plays the rollout side:
every weight goes from rank 0 to rank 1 through ``BroadcastTransport``. Tensor by tensor means
one bucket per HF tensor (``bucket_bytes=1``: every expert projection its own round trip, the
way a per-tensor ``named_weights`` push works); bucketed uses ``bucket_bytes`` (default 512 MiB
as the Engine's default, i.e. one or a few buckets for this model). Printed per mode: buckets
(= broadcast rounds), bytes, wall time, and rank 0's peak extra memory while iterating (CPU
live-tensor tracker). A MoE model has many small expert tensors, so the round-trip count, not
the bytes, dominates; the ratio grows with the expert count. Figures only, nothing asserted.

    python benchmarks/weight_sync.py --experts 64 --layers 4
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from dist_utils import run_distributed  # noqa: E402

from bumblebee import load_config  # noqa: E402
from bumblebee.perf.memory import MemoryTracker  # noqa: E402
from bumblebee.rl.engine import Engine  # noqa: E402
from bumblebee.rl.transport import BroadcastTransport  # noqa: E402


def _ranks(rank, world, overrides, modes):
    e = Engine(load_config(None, overrides))
    out = {}
    for name, bucket_bytes in modes:
        transport = BroadcastTransport(src=0)
        n = nbytes = 0
        start = time.perf_counter()
        with MemoryTracker("cpu") as mem:
            for bucket in e.weight_buckets(bucket_bytes=bucket_bytes):
                got = transport(bucket)
                n += 1
                nbytes += sum(t.numel() * t.element_size() for _, t in got)
                del bucket, got
            transport.finish(e.weight_version)
        out[name] = (n, nbytes, time.perf_counter() - start, mem.peak_bytes)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--bucket-mib", type=float, default=512)
    args = ap.parse_args()
    overrides = [
        f"model.arch.num_hidden_layers={args.layers}",
        f"model.arch.hidden_size={args.hidden}",
        f"model.arch.num_experts={args.experts}",
        "model.arch.moe_intermediate_size=64",
        "primitives.sharding=fsdp2",
        "train.out_dir=/tmp/bumblebee_weight_sync",
    ]
    modes = [
        ("tensor by tensor", 1),
        (f"buckets of {args.bucket_mib:g} MiB", int(args.bucket_mib * 2**20)),
        ("buckets of 1 MiB", 2**20),
    ]
    res = run_distributed(_ranks, 2, overrides, modes)
    print(
        f"{args.layers} layers x {args.experts} experts, hidden {args.hidden}; bf16 weights, gloo broadcast, 2 ranks"
    )
    base = res[1][modes[0][0]][2]
    for name, _ in modes:
        n, nbytes, secs, _ = res[1][name]
        peak0 = res[0][name][3]
        print(
            f"  {name:>22}: {n:5d} buckets, {nbytes / 2**20:7.1f} MiB, {secs:6.2f} s on the receiver "
            f"({base / secs:4.1f}x), sender peak extra {peak0 / 2**20:6.1f} MiB"
        )


if __name__ == "__main__":
    main()
