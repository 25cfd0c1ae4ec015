"""Peak memory per rank of an FSDP2 step with gradient accumulation: 4 micro-batches vs 1,
same micro-batch, ``train.grad_accum = "sharded"`` (reduce-scatter every micro-batch, the
default) vs ``"unsharded"`` (sync on the last micro-batch only, the old behaviour), under both
balance-loss modes: ``train.balance = "micro_batch"`` (forward + backward per micro-batch) and
``"step"`` (the default: every micro-batch's forward first, then every backward, so
every micro-batch's graph, under full recompute its layer inputs, lives until the backwards:
accumulation then grows memory by design, as one larger micro-batch would).

    python benchmarks/grad_accum_memory.py                 # 2 ranks, bf16, tiny-shaped MoE
    python benchmarks/grad_accum_memory.py --hidden 384 --experts 32 --dtype float32
    python benchmarks/grad_accum_memory.py --balance micro_batch --phases   # where the peak is

Two figures per rank for the second step (the first creates the optimizer state):
- tracker: ``perf.memory.MemoryTracker`` peak (tensor storages seen by the dispatcher;
  FSDP2's in-place resized all-gather buffers are not seen);
  ``--phases`` also prints, per run, the tracker's peak inside each phase of the step
  (forward i, backward i, optimizer) and its split into parameters / gradients /
  optimizer state / activations;
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
from bumblebee.perf.memory import MemoryTracker
from bumblebee.runtime.launch.launcher import init_distributed
from bumblebee.runtime.trainer import Trainer


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def overrides(args, accum: int, mode: str, balance: str) -> list[str]:
    return [
        f"model.arch.hidden_size={args.hidden}",
        f"model.arch.num_hidden_layers={args.layers}",
        f"model.arch.num_experts={args.experts}",
        f"model.arch.moe_intermediate_size={args.hidden}",
        f"train.seq_len={args.seq}",
        f"train.global_batch={args.nproc * accum}",
        "train.micro_batch=1",
        f"train.dtype={args.dtype}",
        f"train.grad_accum={mode}",
        f"train.balance={balance}",
        "primitives.sharding=fsdp2",
        "train.steps=2",
        "train.out_dir=/tmp/bumblebee-accum-memory",
    ]


class Phases:
    """Marks phase boundaries of a step inside a MemoryTracker: the model's loss forward, every
    ``Tensor.backward`` and the optimizer step; records each phase's peak and its breakdown."""

    def __init__(self, trainer, mem: MemoryTracker):
        self.mem, self.rows, self.phase, self.n = mem, [], "start", {"forward": 0, "backward": 0}
        model, orig_terms, orig_backward = (
            trainer.model,
            trainer.model.loss_terms,
            torch.Tensor.backward,
        )

        def loss_terms(*a, **k):
            self.enter("forward")
            out = orig_terms(*a, **k)
            self.enter("after forward")
            return out

        def backward(t, *a, **k):
            self.enter("backward")
            out = orig_backward(t, *a, **k)
            self.enter("after backward")
            return out

        self.undo = [
            lambda: setattr(model, "loss_terms", orig_terms),  # FSDP's wrapped method again
            lambda: setattr(torch.Tensor, "backward", orig_backward),
        ]
        model.loss_terms, torch.Tensor.backward = loss_terms, backward
        hooks = [
            trainer.optimizer.register_step_pre_hook(lambda *_: self.enter("optimizer")),
            trainer.optimizer.register_step_post_hook(lambda *_: self.enter("after optimizer")),
        ]
        self.undo += [h.remove for h in hooks]

    def enter(self, name: str) -> None:
        self.rows.append((self.phase, self.mem.peak_bytes, self.mem.breakdown("peak")))
        if name in self.n:
            self.n[name] += 1
            name = f"{name} {self.n[name]}"
        self.phase = name
        self.mem.reset_peak()

    def close(self) -> list:
        self.enter("end")
        for undo in self.undo:
            undo()
        return [r for r in self.rows if r[0] != "start"]


def measure(cfg, phases: bool) -> dict:
    trainer = Trainer(cfg, stream=io.StringIO())
    trainer.train_step()  # optimizer state exists from here on
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    before = _status("VmRSS")
    with MemoryTracker(trainer.device, trainer.model, trainer.optimizer) as mem:
        marks = Phases(trainer, mem) if phases else None
        trainer._step()
        rows = marks.close() if marks else []
    peak = max([mem.peak_bytes] + [r[1] for r in rows])
    return {
        "tracker": peak,
        "rss_growth": _status("VmHWM") - before,
        "phases": rows,
        "grads": trainer.sharding.state_bytes(trainer.optimizer)["grads"],
    }


def worker(args, runs):
    init_distributed()
    torch.set_num_threads(1)
    return [measure(load_config(None, overrides(args, *run)), args.phases) for run in runs]


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument(
        "--balance",
        nargs="+",
        default=["micro_batch", "step"],
        choices=("micro_batch", "step"),
    )
    p.add_argument(
        "--modes", nargs="+", default=["sharded", "unsharded"], choices=("sharded", "unsharded")
    )
    p.add_argument("--phases", action="store_true", help="per-phase peaks and their split (rank 0)")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    runs = [(accum, mode, bal) for bal in args.balance for mode in args.modes for accum in (1, 4)]
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
    results = elastic_launch(cfg, worker)(args, runs)
    mib = lambda b: b / 2**20  # noqa: E731
    print(
        f"fsdp2, {args.nproc} ranks, {args.dtype}, hidden {args.hidden}, {args.layers} layers, "
        f"{args.experts} experts, seq {args.seq}, micro-batch 1; second step, per rank"
    )
    print(
        f"{'balance':<13}{'grad_accum':<12}{'accum':>6}{'rank':>5}{'tracker MiB':>13}{'vs accum 1':>11}"
        f"{'RSS growth MiB':>16}{'vs accum 1':>11}"
    )
    for i, (accum, mode, bal) in enumerate(runs):
        base = runs.index((1, mode, bal))
        for rank in range(args.nproc):
            r, b = results[rank][i], results[rank][base]
            print(
                f"{bal:<13}{mode:<12}{accum:>6}{rank:>5}{mib(r['tracker']):>13.1f}"
                f"{r['tracker'] / b['tracker']:>11.3f}{mib(r['rss_growth']):>16.1f}"
                f"{r['rss_growth'] / max(b['rss_growth'], 1):>11.3f}"
            )
    if args.phases:
        cats = ("parameters", "gradients", "optimizer_state", "activations")
        for i, (accum, mode, bal) in enumerate(runs):
            print(
                f"\nrank 0, {bal}, {mode}, accum {accum}: peak inside each phase, MiB "
                f"({' / '.join(cats)} at that peak)"
            )
            for name, peak, split in results[0][i]["phases"]:
                print(
                    f"  {name:<20}{mib(peak):>9.2f}   "
                    + " / ".join(f"{mib(split[c]):.2f}" for c in cats)
                )


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
