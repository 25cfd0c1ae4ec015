"""Activation peak and step time of the recompute policies: none / selective / full.

One forward+backward of the tiny Qwen3-MoE (``[model] preset = "tiny"``) on one
long packed row per policy, all models built from the same seed. Memory comes
from ``bumblebee.perf.MemoryTracker``: "activations" is the peak of everything
that is not a parameter or a gradient (saved activations and temporaries,
including recomputed ones in backward); "peak" adds parameters and gradients.
Time is the median wall-clock (and process CPU) seconds of untracked runs; runs
alternate between policies so background load hits all alike. Figures only;
nothing is asserted.

Issue setting (16K tokens):

    python benchmarks/recompute_memory.py --tokens 16384

Quick run:

    python benchmarks/recompute_memory.py --tokens 2048 --repeats 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bumblebee.config import ModelConfig, PrimitivesConfig
from bumblebee.models import build_model, resolve_arch
from bumblebee.perf import MemoryTracker

# (label, recompute, recompute_modules)
POLICIES = [
    ("none", "none", []),
    ("selective: norm", "selective", ["norm"]),
    ("selective: attn_core", "selective", ["attn_core"]),
    ("selective: moe", "selective", ["moe"]),
    ("selective: norm+attn_core", "selective", ["norm", "attn_core"]),
    ("selective: all modules", "selective", ["norm", "attn_core", "moe", "mlp"]),
    ("full", "full", []),
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--tokens", type=int, default=16384, help="tokens in the packed row")
    p.add_argument(
        "--docs", type=int, default=4, help="documents packed into the row (position_ids restart)"
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="bfloat16 runs under autocast (parameters stay fp32)",
    )
    p.add_argument("--loss", default="linear_ce", help="loss primitive")
    p.add_argument("--repeats", type=int, default=2, help="timed (untracked) runs per policy")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    return p.parse_args(argv)


def make_batch(arch, tokens, docs):
    g = torch.Generator().manual_seed(0)
    input_ids_BT = torch.randint(0, arch.vocab_size, (1, tokens), generator=g)
    labels_BT = torch.roll(input_ids_BT, -1, dims=1)
    bounds = torch.linspace(0, tokens, docs + 1).long().tolist()
    position_ids_BT = torch.cat([torch.arange(e - s) for s, e in zip(bounds[:-1], bounds[1:])])[
        None
    ]
    labels_BT[0, torch.tensor(bounds[1:]) - 1] = -100  # no target across a document boundary
    return input_ids_BT, labels_BT, position_ids_BT


def step(model, batch, dtype):
    input_ids_BT, labels_BT, position_ids_BT = batch
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
        loss = model(input_ids_BT, position_ids=position_ids_BT, labels=labels_BT)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return loss.item()


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    arch = resolve_arch(ModelConfig())
    batch = make_batch(arch, args.tokens, args.docs)
    models = {}
    for label, recompute, modules in POLICIES:
        torch.manual_seed(0)
        prims = PrimitivesConfig(recompute=recompute, recompute_modules=modules, loss=args.loss)
        models[label] = build_model(arch, prims)
    print(
        f"tiny qwen3_moe: {arch.num_hidden_layers} layers, hidden {arch.hidden_size}, {arch.num_experts} experts "
        f"top-{arch.num_experts_per_tok}, vocab {arch.vocab_size}; {args.tokens} tokens in {args.docs} docs, "
        f"{args.dtype}, loss {args.loss}, threads {torch.get_num_threads()}"
    )
    mem, losses = {}, {}
    for label, model in models.items():  # one tracked run each (also a warm-up)
        with MemoryTracker("cpu", model=model) as tracker:
            losses[label] = step(model, batch, args.dtype)
        mem[label] = tracker.breakdown("peak")
    times = {label: [] for label in models}
    for _ in range(args.repeats):
        for label, model in models.items():
            t0, c0 = time.perf_counter(), time.process_time()
            step(model, batch, args.dtype)
            times[label].append((time.perf_counter() - t0, time.process_time() - c0))
    mib = 2**20
    base = mem["none"]
    base_wall = statistics.median(t[0] for t in times["none"])
    base_cpu = statistics.median(t[1] for t in times["none"])
    head = (
        f"{'policy':<27} | {'activations':>11} {'vs none':>7} | {'peak':>8} | {'step s':>7} {'vs none':>7} | "
        f"{'cpu s':>7} {'vs none':>7} | loss"
    )
    print(head)
    print("-" * len(head))
    for label in models:
        m = mem[label]
        wall = statistics.median(t[0] for t in times[label])
        cpu = statistics.median(t[1] for t in times[label])
        print(
            f"{label:<27} | {m['activations'] / mib:>10.1f}M {m['activations'] / base['activations']:>7.2f} | "
            f"{m['total'] / mib:>7.1f}M | {wall:>7.2f} {wall / base_wall:>7.2f} | {cpu:>7.2f} "
            f"{cpu / base_cpu:>7.2f} | {losses[label]:.6f}"
        )
    print(
        "activations: peak bytes of saved activations + temporaries during forward+backward; peak: with\n"
        "parameters and gradients. Losses must be identical across policies (same computation)."
    )


if __name__ == "__main__":
    main()
