"""Peak memory per rank of an FSDP2 step with gradient accumulation: 4 micro-batches vs 1,
same micro-batch, ``train.grad_accum = "sharded"`` (reduce-scatter every micro-batch, the
default) vs ``"unsharded"`` (sync on the last micro-batch only, the old behaviour).

    python benchmarks/grad_accum_memory.py                 # 2 ranks, bf16, tiny-shaped MoE
    python benchmarks/grad_accum_memory.py --hidden 384 --experts 32 --dtype float32

Two figures per rank for the second step (the first creates the optimizer state):
- tracker: ``perf.memory.MemoryTracker`` peak (tensor storages seen by the dispatcher;
  FSDP2's in-place resized all-gather buffers are not seen);
- RSS: the growth of the process's peak resident set during the step (``VmHWM`` after
  resetting it with ``/proc/self/clear_refs``, minus ``VmRSS`` before the step); it sees
  everything, including allocator caching, so it is noisier.
With ``unsharded`` accumulation FSDP keeps an unsharded gradient (in the reduce dtype) for
every unit between micro-batches; with ``sharded`` accumulation the step should cost about
the same as one micro-batch. Printed only; nothing is asserted.
"""

from __future__ import annotations

import argparse
import io
import os
import uuid

import torch
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from bumblebee import load_config
from bumblebee.runtime.launch import init_distributed
from bumblebee.runtime.trainer import Trainer


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def overrides(args, accum: int, mode: str) -> list[str]:
    return [f"model.arch.hidden_size={args.hidden}", f"model.arch.num_hidden_layers={args.layers}",
            f"model.arch.num_experts={args.experts}", f"model.arch.moe_intermediate_size={args.hidden}",
            f"train.seq_len={args.seq}", f"train.global_batch={args.nproc * accum}", "train.micro_batch=1",
            f"train.dtype={args.dtype}", f"train.grad_accum={mode}", "primitives.sharding=fsdp2",
            "train.steps=2", "train.out_dir=/tmp/bumblebee-accum-memory"]


def measure(cfg) -> dict[str, int]:
    trainer = Trainer(cfg, stream=io.StringIO())
    trainer.train_step()  # optimizer state exists from here on
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    before = _status("VmRSS")
    record = trainer.train_step()
    return {"tracker": record["peak_mem_bytes"], "rss_growth": _status("VmHWM") - before,
            "grads": trainer.sharding.state_bytes(trainer.optimizer)["grads"]}


def worker(args, runs):
    init_distributed()
    torch.set_num_threads(1)
    return [measure(load_config(None, overrides(args, accum, mode))) for accum, mode in runs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    runs = [(1, "sharded"), (4, "sharded"), (1, "unsharded"), (4, "unsharded")]
    cfg = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=args.nproc, run_id=uuid.uuid4().hex[:8],
                       rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0, start_method="spawn")
    results = elastic_launch(cfg, worker)(args, runs)
    mib = lambda b: b / 2**20  # noqa: E731
    print(f"fsdp2, {args.nproc} ranks, {args.dtype}, hidden {args.hidden}, {args.layers} layers, "
          f"{args.experts} experts, seq {args.seq}, micro-batch 1; second step, per rank")
    print(f"{'grad_accum':<12}{'accum':>6}{'rank':>5}{'tracker MiB':>13}{'vs accum 1':>11}"
          f"{'RSS growth MiB':>16}{'vs accum 1':>11}")
    for i, (accum, mode) in enumerate(runs):
        base = runs.index((1, mode))
        for rank in range(args.nproc):
            r, b = results[rank][i], results[rank][base]
            print(f"{mode:<12}{accum:>6}{rank:>5}{mib(r['tracker']):>13.1f}{r['tracker'] / b['tracker']:>11.3f}"
                  f"{mib(r['rss_growth']):>16.1f}{r['rss_growth'] / max(b['rss_growth'], 1):>11.3f}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
