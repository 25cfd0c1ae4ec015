"""Loss-side peak memory and forward+backward time: ``ce`` (materialized) vs ``linear_ce``.

For each vocabulary size and dtype, both implementations compute the mean
cross-entropy of ``hidden [T, H] @ weight[V, H]^T`` and its gradients for hidden
and weight, side by side in one process (runs alternate so background load hits
both alike). Memory is measured with ``bumblebee.perf.MemoryTracker``:

- ``peak``: the most bytes live at once during forward+backward among tensors
  allocated by the loss (inputs excluded; the two gradients included);
- ``extra``: ``peak`` minus the gradients' own bytes (which every implementation
  must produce) -- the loss's temporaries, what ``linear_ce`` exists to remove.

Goals from the issue: linear_ce's extra peak <= 5% of ce's, time <= 1.1x ce's.
The script prints figures and ratios only; it never passes or fails.

Issue setting (needs ~16 GB free for ce at vocab 151,936 in fp32, more at 248,320):

    python benchmarks/loss_memory.py --tokens 8192 --hidden 2048 --vocab 151936,248320

Quick run, and linear_ce alone at the issue size (where ce does not fit):

    python benchmarks/loss_memory.py --quick
    python benchmarks/loss_memory.py --impls linear_ce --dtype bfloat16 --repeats 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bumblebee.perf import MemoryTracker
from bumblebee.primitives.loss import cross_entropy, linear_cross_entropy

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--vocab", default="151936,248320", help="comma list of vocabulary sizes")
    p.add_argument("--dtype", default="bfloat16,float32", help="comma list of " + "|".join(DTYPES))
    p.add_argument(
        "--repeats", type=int, default=2, help="fwd+bwd runs per implementation (median time)"
    )
    p.add_argument(
        "--impls",
        default="ce,linear_ce",
        help="comma list; 'linear_ce' alone skips the [T, V] "
        "reference where it does not fit in memory (ratios are then not printed)",
    )
    p.add_argument(
        "--token-tile", type=int, default=None, help="linear_ce token tile (default: per device)"
    )
    p.add_argument(
        "--vocab-tile", type=int, default=None, help="linear_ce vocab tile (default: per device)"
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=0, help="torch threads on CPU (0: leave as is)")
    p.add_argument("--quick", action="store_true", help="tokens 1024, hidden 512, vocab 32768")
    args = p.parse_args(argv)
    if args.quick:
        args.tokens, args.hidden, args.vocab = 1024, 512, "32768"
    try:
        args.vocabs = [int(v) for v in args.vocab.split(",")]
        args.dtypes = [DTYPES[d] for d in args.dtype.split(",")]
        args.impl_names = args.impls.split(",")
        assert args.impl_names and set(args.impl_names) <= {"ce", "linear_ce"}, args.impls
    except (ValueError, KeyError, AssertionError) as e:
        p.error(f"bad --vocab/--dtype/--impls: {e}")
    return args


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def one_run(fn, hidden_TH, weight_VH, labels_T, device, **kw):
    """(loss, wall seconds, process CPU seconds, peak bytes, extra bytes) of one forward+backward."""
    h = hidden_TH.detach().requires_grad_()
    w = weight_VH.detach().requires_grad_()
    sync(device)
    with MemoryTracker(device) as mem:
        base = mem.current_bytes  # CUDA counts the inputs too; CPU starts at 0
        mem.reset_peak()
        t0, c0 = time.perf_counter(), time.process_time()
        loss = fn(h, w, labels_T, **kw)
        loss.backward()
        sync(device)
        seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
        peak = mem.peak_bytes - base
    grads = h.grad.numel() * h.grad.element_size() + w.grad.numel() * w.grad.element_size()
    return loss.item(), seconds, cpu_seconds, peak, peak - grads


def measure(args, vocab, dtype, device):
    g = torch.Generator().manual_seed(0)
    hidden_TH = torch.randn(args.tokens, args.hidden, generator=g).to(device, dtype)
    weight_VH = (torch.randn(vocab, args.hidden, generator=g) * args.hidden**-0.5).to(device, dtype)
    labels_T = torch.randint(0, vocab, (args.tokens,), generator=g).to(device)
    labels_T[::10] = -100
    impls = {
        "ce": (cross_entropy, {}),
        "linear_ce": (
            linear_cross_entropy,
            dict(token_tile=args.token_tile, vocab_tile=args.vocab_tile),
        ),
    }
    impls = {name: impls[name] for name in args.impl_names}
    runs = {name: [] for name in impls}
    for _ in range(args.repeats):
        for name, (fn, kw) in impls.items():
            runs[name].append(one_run(fn, hidden_TH, weight_VH, labels_T, device, **kw))
    out = {}
    for name, rs in runs.items():
        out[name] = dict(
            loss=rs[0][0],
            time=statistics.median(r[1] for r in rs),
            cpu=statistics.median(r[2] for r in rs),
            peak=max(r[3] for r in rs),
            extra=max(r[4] for r in rs),
        )
    return out


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"device {device}, threads {torch.get_num_threads()}, tokens {args.tokens}, hidden {args.hidden}, "
        f"repeats {args.repeats}, linear_ce tiles {args.token_tile or 'default'} x {args.vocab_tile or 'default'}"
    )
    head = (
        f"{'vocab':>8} {'dtype':>9} | {'ce peak':>9} {'lin peak':>9} {'ratio':>6} | {'ce extra':>9} "
        f"{'lin extra':>9} {'ratio':>6} | {'ce s':>9} {'lin s':>9} {'ratio':>6} | {'ce cpu':>9} {'lin cpu':>9} "
        f"{'ratio':>6} | {'|dloss|':>8}"
    )
    print(head)
    print("-" * len(head))
    mib = 2**20
    for vocab in args.vocabs:
        for dtype in args.dtypes:
            r = measure(args, vocab, dtype, device)
            ce, lin = r.get("ce"), r.get("linear_ce")

            def col(key, fmt, scale=1.0):  # "ce  lin  ratio" for one figure; "-" where not measured
                a, b = (x[key] / scale if x else None for x in (ce, lin))
                cells = [
                    format(a, fmt) if a is not None else "-",
                    format(b, fmt) if b is not None else "-",
                    f"{b / a:.3f}" if a and b is not None else "-",
                ]
                return " ".join(c.rjust(w) for c, w in zip(cells, (9, 9, 6)))

            dloss = f"{abs(ce['loss'] - lin['loss']):.1e}" if ce and lin else "-"
            print(
                f"{vocab:>8} {str(dtype).split('.')[1]:>9} | {col('peak', '.0f', mib)} | {col('extra', '.0f', mib)} "
                f"| {col('time', '.2f')} | {col('cpu', '.2f')} | {dloss:>8}",
                flush=True,
            )
    print(
        "peak / extra: MiB; s: median wall seconds of forward+backward; cpu: median process CPU seconds (all\n"
        "threads; less sensitive to a shared machine). goals: extra ratio <= 0.05, time ratio <= 1.10 (nothing\n"
        "is asserted)"
    )


if __name__ == "__main__":
    main()
