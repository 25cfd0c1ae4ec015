"""Host syncs, staged host-to-device copies and kernel launches of one training step, by call
site, counted in the emulated-CUDA mode (``bumblebee/perf/syncs.py``) on 2 gloo ranks.

    python benchmarks/host_syncs.py                 # Qwen3.5 cp2 (and ep2), Qwen3-MoE ep2, DeepSeek-V3 cp2 ep2
    python benchmarks/host_syncs.py --seq 2048 --layers 8

The models are the tiny presets with the layer patterns of the real families (the counts per
layer do not depend on width); the shapes of the running case would take hours on a CPU.
Printed only: syncs per step, per layer per micro-batch, and the top call sites; launches
with the kernels' stand-ins counted as the kernels they stand for (``primitives/kernel_region.py``)
and, for comparison, op by op. Per-mixer counts at the real widths: ``benchmarks/launches.py``.
"""

from __future__ import annotations

import argparse
import io
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

CASES = {
    "qwen3_5_moe cp2 ring": ["model.name=qwen3_5_moe", "model.preset=tiny", "parallel.cp=2"],
    "qwen3_5_moe cp2 ep2 chunked (the running case's layout)": [
        "model.name=qwen3_5_moe",
        "model.preset=tiny",
        "parallel.cp=2",
        "parallel.ep=2",
        "primitives.moe_comm=chunked",
    ],
    "qwen3_moe ep2 chunked": [
        "model.name=qwen3_moe",
        "model.preset=tiny",
        "parallel.ep=2",
        "primitives.moe_comm=chunked",
    ],
    "deepseek_v3 cp2 ep2 chunked": [
        "model.name=deepseek_v3",
        "model.preset=tiny",
        "parallel.cp=2",
        "parallel.ep=2",
        "primitives.moe_comm=chunked",
    ],
}


def _rank(rank, world, sets, out_dir):
    from bumblebee import load_config
    from bumblebee.perf.syncs import SyncCounter
    from bumblebee.primitives.emulation import emulate_cuda
    from bumblebee.runtime.trainer import Trainer

    cfg = load_config(
        None,
        sets + [f"train.out_dir={out_dir}/{rank}", "train.eval_every=0", "train.emulate_cuda=true"],
    )
    trainer = Trainer(cfg, stream=io.StringIO())
    trainer.train_step()  # the first step builds what a run builds once
    # before: the kernels' stand-ins counted op by op (and their own host reads)
    with emulate_cuda(check_comm=False), SyncCounter(kernel_regions=False) as raw:
        trainer.train_step()
    with emulate_cuda(check_comm=False), SyncCounter(launch_sites=True) as c:
        trainer.train_step()
    return (
        (raw.launches, raw.syncs, c.launches),
        c.by_launch_site.most_common(8),
        c.syncs,
        sum(c.async_by_site.values()),
        trainer.model.arch.num_hidden_layers,
        trainer.accum,
        c.top(6),
        c.async_by_site.most_common(4),
    )


def main() -> None:
    from dist_utils import run_distributed

    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--out", default="/tmp/bb_host_syncs")
    args = p.parse_args()
    base = [
        f"train.seq_len={args.seq}",
        "train.global_batch=4",
        "train.micro_batch=1",
        "train.dtype=bfloat16",
        f"model.arch.num_hidden_layers={args.layers}",
    ]
    for name, sets in CASES.items():
        (
            (raw_launches, raw_syncs, launches),
            top_launch,
            syncs,
            staged,
            layers,
            micro,
            top,
            top_async,
        ) = run_distributed(_rank, 2, base + sets, f"{args.out}/{name}")[0]
        print(
            f"{name}: {syncs} host syncs per step ({syncs / (layers * micro):.2f} per layer per micro-batch; "
            f"{layers} layers, {micro} micro-batches), {staged} staged async copies"
        )
        for site, n in top:
            print(f"    {n:5d}  {site}")
        for site, n in top_async:
            print(f"    {n:5d}  {site} (staged, async)")
        per = layers * micro
        print(
            f"  kernel launches (eager CUDA, emulated; kernel stand-ins counted as the kernels): "
            f"{launches} per step ({launches / per:.0f} per layer per micro-batch, head and "
            f"optimizer included); stand-ins counted op by op: {raw_launches} "
            f"({raw_launches / per:.0f}), {raw_syncs} syncs; top sites:"
        )
        for site, n in top_launch:
            print(f"    {n:6d}  {site}")


if __name__ == "__main__":
    main()
