"""Shared-prefix (tree) training against every sample in full: tokens processed and step time.

One GRPO group: G samples sharing a P-token prompt, each with a C-token continuation. The
unshared batch packs the G full sequences (G rows of P + C tokens); the tree batch
(``rl/shared_prefix.py``) packs the prompt once and each continuation after it (one row of
P - 1 + G (C + 1) tokens: the prompt's last token opens every branch). Both run the same
``Engine.forward_backward`` (policy loss, fp32, recompute as configured) on a tiny-width model;
printed side by side: tokens processed, step time (median of ``--reps``, alternating the two
so both see the same machine load; wall and this process's CPU seconds, the second less
sensitive to a shared machine), and the loss and gradient difference between them. With
``--memory``, one more untimed forward_backward of each under the repo's ``MemoryTracker``
(CPU: every tensor storage allocated) gives the peak activation bytes.

    PYTHONPATH=. python benchmarks/shared_prefix.py                      # G=8, 16K + 1K, qwen3_5_moe
    PYTHONPATH=. python benchmarks/shared_prefix.py --family qwen3_moe --prefix 2048 --cont 256
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

import torch

from bumblebee import load_config
from bumblebee.rl.batch import pack_sequences
from bumblebee.rl.engine import Engine
from bumblebee.rl.losses import PolicyLoss
from bumblebee.rl.shared_prefix import Segment, pack_tree, unshared

TINY = {
    "qwen3_5_moe": [  # Qwen3.5's 3 Gated DeltaNet : 1 attention layers
        "model.arch.num_hidden_layers=4",
        "model.arch.hidden_size=64",
        "model.arch.head_dim=16",
        "model.arch.linear_key_head_dim=16",
        "model.arch.linear_value_head_dim=16",
        "model.arch.moe_intermediate_size=32",
        "model.arch.shared_expert_intermediate_size=32",
    ],
    "qwen3_moe": [
        "model.arch.num_hidden_layers=2",
        "model.arch.hidden_size=64",
        "model.arch.head_dim=16",
        "model.arch.moe_intermediate_size=32",
    ],
    "deepseek_v3": [
        "model.arch.num_hidden_layers=2",
        "model.arch.hidden_size=64",
        "model.arch.intermediate_size=64",
        "model.arch.moe_intermediate_size=32",
    ],
}


def group(G: int, P: int, C: int, seed: int = 0) -> Segment:
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(0, 256, (n,), generator=g).tolist()  # noqa: E731
    leaves = []
    for _ in range(G):
        old = -5.6 + 0.1 * torch.randn(C, generator=g)
        leaves.append(
            Segment(
                ids(C), advantages=float(torch.randn((), generator=g)), old_logprobs=old.tolist()
            )
        )
    return Segment(ids(P), leaves)


def timed(engine: Engine, batch, loss) -> tuple[tuple[float, float], float, dict]:
    """((wall seconds, this process's CPU seconds), loss, gradients) of one forward_backward."""
    engine.zero_grad()
    start, cpu = time.perf_counter(), time.process_time()
    out = engine.forward_backward(batch, loss)
    seconds = (time.perf_counter() - start, time.process_time() - cpu)
    grads = {n: p.grad.clone() for n, p in engine.model.named_parameters() if p.grad is not None}
    return seconds, out.loss, grads


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="qwen3_5_moe", choices=sorted(TINY))
    ap.add_argument("--groups", type=int, default=8, help="G: samples per prompt")
    ap.add_argument("--prefix", type=int, default=16384, help="P: prompt tokens")
    ap.add_argument("--cont", type=int, default=1024, help="C: continuation tokens")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    ap.add_argument("--memory", action="store_true", help="also peak activation bytes (tracked)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    root = group(args.groups, args.prefix, args.cont)
    tree = pack_tree([root])
    samples = unshared([root])
    full = pack_sequences(
        [s["tokens"] for s in samples],
        [s["loss_mask"] for s in samples],
        args.prefix + args.cont,
        advantages=[s["advantages"] for s in samples],
        old_logprobs=[s["old_logprobs"] for s in samples],
    )
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(
            None,
            [
                f"model.name={args.family}",
                *TINY[args.family],
                "model.arch.router_aux_loss_coef=0.0",  # counts a shared token once: not compared
                "train.micro_batch=1",  # one full sequence (or the tree) per forward
                f"train.out_dir={out}",
            ],
        )
        engine = Engine(cfg)
    loss = PolicyLoss(agg="seq-mean-token-mean")
    times = {"shared": [], "unshared": []}
    for _ in range(args.reps):
        ts, loss_t, grads_t = timed(engine, tree, loss)
        tf, loss_f, grads_f = timed(engine, full, loss)
        times["shared"].append(ts)
        times["unshared"].append(tf)
    grad_rel = max(
        float((grads_t[n] - g).abs().max() / g.abs().max().clamp(min=1e-12))
        for n, g in grads_f.items()
    )
    res = {
        "family": args.family,
        "G": args.groups,
        "prefix": args.prefix,
        "continuation": args.cont,
        "threads": torch.get_num_threads(),
        "tokens_shared": tree.input_ids.numel(),
        "tokens_unshared": int(full.input_ids.numel()),
        "token_ratio": full.input_ids.numel() / tree.input_ids.numel(),
        "step_s_shared": statistics.median(t for t, _ in times["shared"]),
        "step_s_unshared": statistics.median(t for t, _ in times["unshared"]),
        "cpu_s_shared": statistics.median(c for _, c in times["shared"]),
        "cpu_s_unshared": statistics.median(c for _, c in times["unshared"]),
        "times": times,
        "loss_shared": loss_t,
        "loss_unshared": loss_f,
        "loss_rel_diff": abs(loss_t - loss_f) / max(abs(loss_f), 1e-12),
        "grad_max_rel_diff": grad_rel,
    }
    res["step_ratio"] = res["step_s_unshared"] / res["step_s_shared"]
    res["cpu_ratio"] = res["cpu_s_unshared"] / res["cpu_s_shared"]
    if args.memory:
        from bumblebee.perf.memory import MemoryTracker

        for name, batch in (("shared", tree), ("unshared", full)):
            engine.zero_grad()
            with MemoryTracker("cpu", model=engine.model) as mem:
                mem.reset_peak()
                engine.forward_backward(batch, loss)
                res[f"peak_activation_bytes_{name}"] = mem.breakdown("peak")["activations"]
    print(
        f"{args.family}, G={args.groups}, prefix {args.prefix} + continuation {args.cont} "
        f"({res['threads']} threads, median of {args.reps})\n"
        f"  tokens processed: shared {res['tokens_shared']}, unshared {res['tokens_unshared']} "
        f"({res['token_ratio']:.2f}x fewer)\n"
        f"  forward_backward: shared {res['step_s_shared']:.2f} s, unshared "
        f"{res['step_s_unshared']:.2f} s ({res['step_ratio']:.2f}x) wall; "
        f"{res['cpu_s_shared']:.2f} s / {res['cpu_s_unshared']:.2f} s ({res['cpu_ratio']:.2f}x) CPU\n"
        f"  loss {loss_t:.6f} vs {loss_f:.6f} (rel {res['loss_rel_diff']:.1e}), "
        f"max gradient difference / max |gradient| {grad_rel:.1e}"
    )
    if args.memory:
        a, b = res["peak_activation_bytes_shared"], res["peak_activation_bytes_unshared"]
        print(
            f"  peak activations (tracked): shared {a / 2**20:.1f} MiB, unshared {b / 2**20:.1f} MiB"
        )
    json.dump(res, sys.stdout)
    print()
    return res


if __name__ == "__main__":
    main()
