"""Static memory per rank under each sharding: bytes of parameters, gradients and
optimizer state after one backward, beside the single-process total / world.

    python benchmarks/static_memory.py --nproc 4
    python benchmarks/static_memory.py --nproc 4 --hidden 256 --layers 4 --experts 16

fsdp2 should hold about total / world of everything; zero1 keeps parameters and
gradients replicated (per expert-parallel rank) and shards only the optimizer state.
"""

from __future__ import annotations

import argparse
import io
import os
import uuid

import torch
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from bumblebee import load_config
from bumblebee.runtime.launch.launcher import init_distributed
from bumblebee.runtime.trainer import Trainer


def overrides(args, sharding: str, ep: int) -> list[str]:
    return [
        f"model.arch.hidden_size={args.hidden}",
        f"model.arch.num_hidden_layers={args.layers}",
        f"model.arch.num_experts={args.experts}",
        f"model.arch.moe_intermediate_size={args.hidden}",
        "train.seq_len=256",
        "data.min_records=4",
        "data.max_records=12",
        f"train.global_batch={args.nproc}",
        f"primitives.sharding={sharding}",
        f"parallel.ep={ep}",
        "train.out_dir=/tmp/bumblebee-static-memory",
    ]


def measure(cfg) -> dict[str, int]:
    """State bytes after one forward/backward and gradient reduction (gradients present)."""
    trainer = Trainer(cfg, stream=io.StringIO())
    batch = trainer.source.global_batch_at(0)
    rows = batch.rows(
        trainer.dp_rank * trainer.rows_per_rank, (trainer.dp_rank + 1) * trainer.rows_per_rank
    )
    terms = trainer.model.loss_terms(rows.input_ids, rows.labels, rows.position_ids)
    (terms.loss_sum / max(batch.num_valid, 1)).backward()
    trainer.sharding.reduce_grads()
    trainer.sharding.step(trainer.optimizer)  # creates the optimizer state
    return trainer.sharding.state_bytes(trainer.optimizer)


def worker(args, layouts):
    init_distributed()
    return [measure(load_config(None, overrides(args, s, ep))) for s, ep in layouts]


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    single = measure(load_config(None, overrides(args, "none", 1)))
    total = sum(single.values())
    layouts = [("fsdp2", 1), ("fsdp2", 2), ("zero1", 1), ("zero1", 2)]
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
    results = elastic_launch(cfg, worker)(args, layouts)
    mib = lambda b: b / 2**20  # noqa: E731
    print(
        f"single process: params {mib(single['params']):.2f} MiB, grads {mib(single['grads']):.2f} MiB, "
        f"optimizer {mib(single['optimizer']):.2f} MiB, total {mib(total):.2f} MiB; "
        f"total / world = {mib(total / args.nproc):.2f} MiB"
    )
    print(
        f"{'layout':<14}{'rank':>5}{'params':>10}{'grads':>10}{'optim':>10}{'total':>10}{'x total/world':>15}"
    )
    for i, (sharding, ep) in enumerate(layouts):
        for rank in range(args.nproc):
            b = results[rank][i]
            t = sum(b.values())
            print(
                f"{sharding + ' ep=' + str(ep):<14}{rank:>5}{mib(b['params']):>10.2f}{mib(b['grads']):>10.2f}"
                f"{mib(b['optimizer']):>10.2f}{mib(t):>10.2f}{t / (total / args.nproc):>15.3f}"
            )


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
