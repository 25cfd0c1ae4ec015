"""Pipeline bubble, measured on CPU beside its ideal value, for every schedule of the ``pipeline`` slot.

Runs P gloo ranks (one pipeline, P stages, v = 2 virtual stages per rank for
interleaved_1f1b) through the real schedules (``registry`` -> torch.distributed.pipelining),
with stages whose cost is known exactly: each micro-batch's forward costs ``--forward-ms`` per
rank (split evenly over its v stages) and its backward twice that. With ``--work sleep`` (the
default) a stage sleeps for its cost, so P ranks share 2 cores without slowing each other and
the measurement isolates the schedule: idle time is what the dependencies between stages force
(plus gloo point-to-point and Python overhead). ``--work matmul`` spins on matrix products for
the same durations instead (real compute; on a machine with fewer cores than P it measures
core contention too).

Measured bubble of a rank = 1 - (time in stage forward/backward) / (step time: wall time until
the last rank is done, as the optimizer step waits for every stage), averaged over ranks and
``--steps`` steps after one warm-up step. Ideal (``bubble`` of each schedule):
(P-1)/(m+P-1) for gpipe and 1f1b, (P-1)/(v m+P-1) for interleaved_1f1b.

    python benchmarks/pipeline_bubble.py              # P = 4, m = 4 and 8
    python benchmarks/pipeline_bubble.py --pp 2 --microbatches 4 8 16 --work matmul
"""

from __future__ import annotations

import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.pipelining import PipelineStage

from bumblebee import registry

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2))  # (name, stages per rank)


class Clock:
    """Spends a stage's cost (sleeping or multiplying matrices) and adds up the time spent."""

    def __init__(self, work: str):
        self.work, self.busy = work, 0.0
        self.a = torch.randn(128, 128)

    def spend(self, seconds: float) -> None:
        start = time.perf_counter()
        if self.work == "sleep":
            time.sleep(seconds)
        else:
            while time.perf_counter() - start < seconds:
                self.a = torch.tanh(self.a @ self.a)
        self.busy += time.perf_counter() - start


class Work(torch.autograd.Function):
    """Identity whose forward costs ``seconds`` and whose backward costs twice that."""

    @staticmethod
    def forward(ctx, x, seconds: float, clock: Clock):
        ctx.seconds, ctx.clock = seconds, clock
        clock.spend(seconds)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.clock.spend(2 * ctx.seconds)
        return grad, None, None


class Stage(nn.Module):
    def __init__(self, seconds: float, clock: Clock, last: bool):
        super().__init__()
        self.w = nn.Parameter(torch.ones(16))
        self.seconds, self.clock, self.last = seconds, clock, last

    def forward(self, x):
        y = Work.apply(x * self.w, self.seconds, self.clock)
        return y.sum(dim=1, keepdim=True) if self.last else y


def measure(name: str, virtual: int, m: int, args, clock: Clock) -> float:
    """Mean bubble of this rank over ``args.steps`` steps (after one warm-up step)."""
    P, rank = dist.get_world_size(), dist.get_rank()
    stages_total = P * virtual
    seconds = (
        args.forward_ms / 1000 / virtual
    )  # a rank's forward of one micro-batch costs forward_ms
    mine = [rank + j * P for j in range(virtual)]
    stages = [
        PipelineStage(
            Stage(seconds, clock, s == stages_total - 1), s, stages_total, torch.device("cpu")
        )
        for s in mine
    ]
    schedule = registry.get("pipeline", name).factory.build(
        stages, m, lambda out, target: out.sum()
    )
    x, target = torch.ones(m, 16), torch.zeros(m, 1)
    bubbles = []
    for step in range(args.steps + 1):
        dist.barrier()
        clock.busy, start = 0.0, time.perf_counter()
        schedule.step(x, target=target) if 0 in mine else schedule.step(target=target)
        wall = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(wall, op=dist.ReduceOp.MAX)  # the step ends when the slowest rank is done
        if step:  # the first step also infers stage metadata (one extra forward/backward)
            bubbles.append(1 - clock.busy / wall.item())
    return sum(bubbles) / len(bubbles)


def _rank(rank: int, world: int, port: int, args, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    clock = Clock(args.work)
    try:
        for name, virtual in SCHEDULES:
            for m in args.microbatches:
                local = torch.tensor([measure(name, virtual, m, args, clock)])
                dist.all_reduce(local)
                if rank == 0:
                    queue.put((name, virtual, m, local.item() / world))
    finally:
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pp", type=int, default=4, help="pipeline ranks P (default 4)")
    p.add_argument(
        "--microbatches", type=int, nargs="+", default=[4, 8], help="micro-batches per step m"
    )
    p.add_argument(
        "--forward-ms", type=float, default=20.0, help="forward cost of one micro-batch per rank"
    )
    p.add_argument(
        "--steps", type=int, default=3, help="measured steps per point (after one warm-up)"
    )
    p.add_argument("--work", choices=["sleep", "matmul"], default="sleep")
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.start_processes(
        _rank, args=(args.pp, port, args, queue), nprocs=args.pp, start_method="spawn"
    )
    print(
        f"pipeline bubble, P = {args.pp} ranks, forward {args.forward_ms:g} ms + backward "
        f"{2 * args.forward_ms:g} ms per micro-batch and rank, work = {args.work}, mean of {args.steps} steps"
    )
    print(f"{'schedule':<18} {'v':>2} {'m':>3} {'measured':>9} {'ideal':>7}")
    while not queue.empty():
        name, virtual, m, measured = queue.get()
        ideal = registry.get("pipeline", name).factory.bubble(args.pp, m, virtual)
        print(f"{name:<18} {virtual:>2} {m:>3} {measured:>9.3f} {ideal:>7.3f}")


if __name__ == "__main__":
    main()
