"""FlexAttention vs the existing CPU attention paths for packed documents, side by side.

Finding (torch 2.13 CPU): FlexAttention has NO backward on CPU ("FlexAttention does not support
backward on CPU"), so it cannot train there; this compares forwards (no grad: evaluation, RL
sampling-style scoring) and prints the backward error once.

The ``attention`` slot on CPU runs ``varlen`` as one causal SDPA call per document (no mask,
fused causal kernels, a Python loop over documents) and ``sdpa`` as one call with a dense
[B, 1, T, T] causal+document mask. ``torch.nn.attention.flex_attention`` takes a block mask
(causal AND same document, blocks of 128) instead; eager it materializes the scores, compiled
(inductor's CPU template) it skips empty blocks. This prints the forward time of each at a
few lengths and the max |diff| from ``varlen``. Printed only; nothing is asserted.

    python benchmarks/flex_attention_cpu.py                        # 1K, 4K, 16K tokens
    python benchmarks/flex_attention_cpu.py --seqs 2048 8192 --doc 512 --dtype bfloat16

Layout: one row, documents of ``--doc`` tokens (the last one shorter), 8 query / 2 KV heads of
dim 64 (GQA). Times: best of ``--repeats`` after a warm-up (the compiled variant's compile time
is printed separately). The block mask is built once per layout (outside the timed call), as a
model would build it once per batch.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from bumblebee.primitives.attention.sdpa import sdpa_masked, sdpa_varlen
from bumblebee.primitives.packed import doc_layout

HEADS, KV_HEADS, DIM = 8, 2, 64


def inputs(seq: int, doc: int, dtype):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, HEADS, seq, DIM, generator=g).to(dtype)
    k, v = (torch.randn(1, KV_HEADS, seq, DIM, generator=g).to(dtype) for _ in range(2))
    pos = (torch.arange(seq) % doc)[None]
    return q, k, v, pos


def block_mask_for(pos_BT: torch.Tensor):
    doc_T = (pos_BT[0] == 0).cumsum(0)

    def causal_same_doc(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc_T[q_idx] == doc_T[kv_idx])

    T = pos_BT.shape[1]
    return create_block_mask(causal_same_doc, None, None, T, T, device="cpu")


def timed(fn, q, k, v, repeats: int):
    """(best seconds of the forward, peak bytes, output) after one warm-up call, without grad."""
    best, peak, out = float("inf"), 0, None
    for i in range(repeats + 1):
        start = time.perf_counter()
        with (
            torch.no_grad()
        ):  # (perf.memory's dispatch mode cannot see inside flex's higher-order op)
            out = fn(q, k, v)
        if i:
            best = min(best, time.perf_counter() - start)
    return best, peak, out


def backward_error(fn, q, k, v) -> str:
    """'' if fwd+bwd runs, else the error's first line."""
    try:
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        fn(*leaves).float().sum().backward()
    except (NotImplementedError, RuntimeError) as e:
        return str(e).splitlines()[0]
    return ""


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--seqs", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--doc", type=int, default=1024, help="document length (tokens)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-compile", action="store_true", help="skip the compiled FlexAttention")
    p.add_argument(
        "--dense-max", type=int, default=8192, help="skip the dense-mask sdpa above this length"
    )
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    scale = DIM**-0.5
    compiled = None if args.no_compile else torch.compile(flex_attention, dynamic=False)
    print(
        f"attention forward (no grad) on CPU, {args.threads} thread(s), {args.dtype}, "
        f"{HEADS}/{KV_HEADS} heads of dim {DIM}, "
        f"documents of {args.doc} tokens; best of {args.repeats}"
    )
    print(f"{'tokens':>7} {'impl':<16} {'time s':>8} {'x varlen':>9} {'max|diff|':>10}")
    for seq in args.seqs:
        q, k, v, pos = inputs(seq, args.doc, dtype)
        layout = doc_layout(pos)
        bm = block_mask_for(pos)
        impls = {"varlen (per doc)": lambda q, k, v: sdpa_varlen(q, k, v, layout, scale)}
        if seq <= args.dense_max:
            impls["sdpa (dense mask)"] = lambda q, k, v: sdpa_masked(q, k, v, layout, scale)
        impls["flex eager"] = lambda q, k, v: flex_attention(
            q, k, v, block_mask=bm, scale=scale, enable_gqa=True
        )
        compile_s = None
        if seq == args.seqs[0]:
            print(
                f"{'':>7} flex backward on CPU: {backward_error(impls['flex eager'], q, k, v) or 'runs'}"
            )
        if compiled is not None:
            impls["flex compiled"] = lambda q, k, v: compiled(
                q, k, v, block_mask=bm, scale=scale, enable_gqa=True
            )
        rows = {}
        for name, fn in impls.items():
            if name == "flex compiled":
                start = time.perf_counter()
                with torch.no_grad():
                    fn(q, k, v)
                compile_s = time.perf_counter() - start
            rows[name] = timed(fn, q, k, v, args.repeats)
        t0, _, o0 = rows["varlen (per doc)"]
        for name, (t, _, o) in rows.items():
            diff = (o.float() - o0.float()).abs().max().item()
            print(f"{seq:>7} {name:<16} {t:>8.3f} {t / t0:>9.2f} {diff:>10.1e}")
        if compile_s is not None:
            print(f"{'':>7} (flex compiled: first call incl. compile {compile_s:.1f} s)")


if __name__ == "__main__":
    main()
