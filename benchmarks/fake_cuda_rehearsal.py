"""Saved and peak bytes of one token-mixer layer (forward + backward) at a running case's
per-rank shapes, rehearsed on fake tensors through the kernels CUDA would run (no GPU needed;
``benchmarks/rehearsal.py``).

    python benchmarks/fake_cuda_rehearsal.py                      # Qwen3.5-35B-A3B, 2 x 16K tokens, bf16
    python benchmarks/fake_cuda_rehearsal.py --tokens 8192 --no-torch-chunked

Rows: full attention through ``varlen_attn``, Gated DeltaNet through FLA's chunk kernel, and
(unless --no-torch-chunked; it runs the 256-chunk Python loop, minutes) the pure-PyTorch
chunked core that runs when FLA is absent. Printed only.
"""

from __future__ import annotations

import argparse
import time

import torch
from rehearsal import rehearse  # benchmarks/rehearsal.py

from bumblebee.models.presets import preset
from bumblebee.models.qwen3_5_moe.arch import Qwen3_5MoeArch


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", default="qwen3.5-35b-a3b")
    p.add_argument("--rows", type=int, default=2, help="sequences / CP segments per rank")
    p.add_argument("--tokens", type=int, default=16384, help="tokens per row")
    p.add_argument("--no-torch-chunked", action="store_true")
    args = p.parse_args()
    arch = Qwen3_5MoeArch.from_hf_dict(preset("qwen3_5_moe", args.preset))
    cases = [("attention", None), ("gdn", "fla_chunk")]
    if not args.no_torch_chunked:
        cases.append(("gdn", "torch_chunked"))
    print(
        f"{args.preset}: one layer forward + backward, bf16, {args.rows} x {args.tokens} tokens per rank "
        f"(fake tensors; kernel workspaces not counted)"
    )
    for mixer, kernel in cases:
        start = time.perf_counter()
        r = rehearse(
            arch, mixer, rows=args.rows, tokens=args.tokens, dtype=torch.bfloat16, kernel=kernel
        )
        print(f"  {r.line()}   ({time.perf_counter() - start:.0f} s to rehearse)", flush=True)


if __name__ == "__main__":
    main()
