"""Static memory per rank, full fine-tuning vs LoRA at the same layout: bytes of the live
parameters, gradients and optimizer state (``sharding.state_bytes``) on every rank, taken after
one Engine step (the optimizer state exists) and a further forward/backward (the gradients too).

    python benchmarks/lora_memory.py                       # tiny preset, 2 ranks, fsdp2, ep = 2
    python benchmarks/lora_memory.py --preset qwen3-30b-a3b --layers 2 --experts 16 --vocab 16384

bf16 compute (``train.dtype``): full fine-tuning keeps fp32 masters, fp32 gradients and two fp32
moments (16 B per parameter, sharded); LoRA keeps the frozen base in bf16 (2 B per parameter,
sharded the same way, no gradient, no optimizer state) plus the adapters at 16 B per element.
"""

from __future__ import annotations

import argparse
import os
import uuid

import torch
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from bumblebee import load_config
from bumblebee.primitives.sharding.common import local
from bumblebee.rl.batch import pack_sequences
from bumblebee.rl.engine import Engine
from bumblebee.rl.losses import TokenNLL
from bumblebee.runtime.launch.launcher import init_distributed


def overrides(args, rank: int) -> list[str]:
    out = [
        f"model.preset={args.preset}",
        f"model.arch.num_hidden_layers={args.layers}",
        "train.dtype=bfloat16",
        f"train.global_batch={args.nproc}",
        "train.micro_batch=1",
        "primitives.sharding=fsdp2",
        f"parallel.ep={args.ep}",
        "primitives.attention=sdpa",
        "train.out_dir=/tmp/bumblebee-lora-memory",
        f"model.lora.rank={rank}",
    ]
    if args.experts:
        out.append(f"model.arch.num_experts={args.experts}")
    if args.vocab:
        out.append(f"model.arch.vocab_size={args.vocab}")
    return out


def measure(cfg) -> dict[str, int]:
    e = Engine(cfg)
    rows = e.get_data_parallel_size()
    b = pack_sequences([list(range(3, 35))] * rows, [[True] * 32] * rows, 32)
    mine = b.select_rows(e.get_data_parallel_rank(), e.get_data_parallel_rank() + 1)
    e.train_step(b, TokenNLL(), lr=1e-4)  # the optimizer state exists from the first step
    e.zero_grad()
    e.forward_backward(mine, TokenNLL())  # and the gradients, reduced, during every step
    out = e.sharding.state_bytes(e.optimizer)
    out["trainable"] = sum(local(p).numel() for p in e.model.parameters() if p.requires_grad)
    return out


def worker(args):
    init_distributed()
    return [measure(load_config(None, overrides(args, r))) for r in (0, args.rank)]


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=0, help="override num_experts (0: the preset's)")
    p.add_argument("--vocab", type=int, default=0, help="override vocab_size (0: the preset's)")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cfg = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=args.nproc,
        run_id=uuid.uuid4().hex[:8],
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=0,
        start_method="spawn",
    )
    results = elastic_launch(cfg, worker)(args)
    mib = lambda b: b / 2**20  # noqa: E731
    print(f"{' '.join(overrides(args, args.rank))}; {args.nproc} ranks")
    print(f"{'run':<10}{'rank':>5}{'params':>11}{'grads':>11}{'optim':>11}{'total MiB':>11}")
    for rank in range(args.nproc):
        full, lora = results[rank]
        for name, b in (("full", full), (f"lora r={args.rank}", lora)):
            t = b["params"] + b["grads"] + b["optimizer"]
            print(
                f"{name:<10}{rank:>5}{mib(b['params']):>11.2f}{mib(b['grads']):>11.2f}"
                f"{mib(b['optimizer']):>11.2f}{mib(t):>11.2f}"
            )
        ratio = sum(full[k] for k in ("params", "grads", "optimizer")) / sum(
            lora[k] for k in ("params", "grads", "optimizer")
        )
        print(
            f"rank {rank}: full / lora = {ratio:.2f}x (trainable elements on this rank "
            f"{full['trainable']:,} -> {lora['trainable']:,})"
        )


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
