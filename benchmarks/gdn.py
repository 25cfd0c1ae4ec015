"""CPU time of the gated delta rule: ``chunked`` (WY/UT chunks of 64) vs ``recurrent`` (token by token).

For each sequence length the script times forward and backward (the backward of
a fixed random projection of the output and the final state) of both
``linear_attention`` implementations on the same inputs, alternating between
them so background load affects both alike, and prints the median times, the
tokens/s, the bytes autograd saves for backward (unique storages, a proxy for
activation memory) and the chunked speed-up. It also prints the max-abs output
difference as a sanity check. It never passes or fails on a timing
(the project's testing rule).

Defaults are the tiny preset's GDN heads (2 key heads, 4 value heads, dims 32).
The recurrent reference stores a [H, K, V] state per token for backward, so its
saved bytes grow as T * H * K * V * 4 * (a few): mind the memory at 32K with
larger heads (``--max-recurrent`` skips it above a length).

    python benchmarks/gdn.py                          # 4K, 8K, 16K, 32K tokens
    python benchmarks/gdn.py --seqs 1024,2048 --repeats 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from bumblebee.primitives.linear_attention.gated_delta_rule import (
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
)
from bumblebee.primitives.packed import DocLayout

IMPLS = {"chunked": gated_delta_rule_chunked, "recurrent": gated_delta_rule_recurrent}


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument(
        "--seqs", default="4096,8192,16384,32768", help="comma list of tokens per sequence"
    )
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--key-heads", type=int, default=2)
    p.add_argument("--value-heads", type=int, default=4)
    p.add_argument("--key-dim", type=int, default=32)
    p.add_argument("--value-dim", type=int, default=32)
    p.add_argument(
        "--repeats", type=int, default=3, help="timed runs per implementation (median reported)"
    )
    p.add_argument("--warmup", type=int, default=1, help="untimed runs per implementation")
    p.add_argument(
        "--threads", type=int, default=0, help="torch threads (0: leave torch's default)"
    )
    p.add_argument(
        "--max-recurrent",
        type=int,
        default=32768,
        help="skip the recurrent reference above this length",
    )
    args = p.parse_args(argv)
    try:
        args.seqs = [int(s) for s in args.seqs.split(",") if s]
    except ValueError:
        p.error(f"--seqs must be a comma list of integers, got {args.seqs!r}")
    if (
        not args.seqs
        or min(args.seqs) <= 0
        or min(args.batch, args.repeats) <= 0
        or args.warmup < 0
    ):
        p.error("--seqs, --batch and --repeats must be positive, --warmup non-negative")
    if args.value_heads % args.key_heads:
        p.error(
            f"--value-heads ({args.value_heads}) must be a multiple of --key-heads ({args.key_heads})"
        )
    return args


def make_inputs(args, T, gen):
    B, G, H, K, V = args.batch, args.key_heads, args.value_heads, args.key_dim, args.value_dim
    q, k = (torch.randn(B, T, G, K, generator=gen) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen)
    g = -F.softplus(
        torch.randn(B, T, H, generator=gen) + 1
    )  # log decay, as softplus(a + dt_bias) * A with A ~ 1
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    w_o, w_s = torch.randn(B, T, H, V, generator=gen), torch.randn(B, H, K, V, generator=gen)
    return (q, k, v, g, beta), (w_o, w_s)


def run_once(fn, tensors, weights, layout):
    """(forward s, backward s, saved bytes, output)."""
    leaves = [t.clone().requires_grad_() for t in tensors]
    storages: dict[int, int] = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        o, S = fn(*leaves, layout)
        loss = (o * weights[0]).sum() + (S * weights[1]).sum()
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, sum(storages.values()), o.detach()


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"gated delta rule fwd+bwd on CPU ({torch.get_num_threads()} threads), batch {args.batch}, "
        f"{args.key_heads} key / {args.value_heads} value heads, dims {args.key_dim}/{args.value_dim}, fp32; "
        f"median of {args.repeats}"
    )
    header = f"{'tokens':>7} {'impl':>10} {'fwd s':>8} {'bwd s':>8} {'total s':>8} {'tok/s':>9} {'saved MiB':>10}"
    print(header)
    print("-" * len(header))
    gen = torch.Generator().manual_seed(0)
    for T in args.seqs:
        tensors, weights = make_inputs(args, T, gen)
        layout = DocLayout(bounds=((0, T),) * args.batch, seq_len=T)
        names = [n for n in IMPLS if n == "chunked" or T <= args.max_recurrent]
        for _ in range(args.warmup):
            for n in names:
                run_once(IMPLS[n], tensors, weights, layout)
        fwd = {n: [] for n in names}
        bwd = {n: [] for n in names}
        saved, outs = {}, {}
        for _ in range(args.repeats):
            for n in names:  # alternate so background load hits both alike
                f, b, saved[n], outs[n] = run_once(IMPLS[n], tensors, weights, layout)
                fwd[n].append(f)
                bwd[n].append(b)
        totals = {}
        for n in names:
            f, b = statistics.median(fwd[n]), statistics.median(bwd[n])
            totals[n] = statistics.median([x + y for x, y in zip(fwd[n], bwd[n])])
            print(
                f"{T:>7} {n:>10} {f:>8.3f} {b:>8.3f} {totals[n]:>8.3f} {args.batch * T / totals[n]:>9.0f} "
                f"{saved[n] / 2**20:>10.1f}"
            )
        if "recurrent" in totals:
            diff = (outs["chunked"] - outs["recurrent"]).abs().max().item()
            print(
                f"{'':>7} {'speed-up':>10} {totals['recurrent'] / totals['chunked']:>8.1f}x chunked vs recurrent "
                f"(max-abs output diff {diff:.1e})"
            )


if __name__ == "__main__":
    main()
