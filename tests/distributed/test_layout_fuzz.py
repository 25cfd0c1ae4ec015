"""A handful of seeded layout-fuzz cases per run (tests/layout_fuzz.py): each drawn layout, dtype,
recompute policy, balance mode and document packing trains 2 steps emulated (CUDA branches on CPU,
reference kernels, checked communication) and plain on the same ranks; losses and grad norms per
rank and step agree at the dtype's tolerance. The seed is the UTC date (another day, other cases),
printed; ``LAYOUT_FUZZ_SEED`` sets it, and a failure names the one command that reproduces it:
``python -m tests.layout_fuzz --seed S --case K``. Cases of at most 2 ranks here (the sweep,
``python -m tests.layout_fuzz --cases 300``, also runs 4). Plus the regressions the sweep found,
each at the smallest size that shows it."""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from layout_fuzz import TAIL, case, run_cases

from bumblebee.primitives import emulation
from bumblebee.primitives.cp.allgather import GatherSequence
from bumblebee.primitives.cp.zigzag import build_cp_shards, shard_sequence

CI_CASES = 3
CI_WORLD = 2  # at most this many ranks per case (2 cores)


def _seed() -> int:
    given = os.environ.get("LAYOUT_FUZZ_SEED", "")
    return int(given) if given else int(datetime.datetime.now(datetime.UTC).strftime("%Y%m%d"))


def _ci_cases(seed: int) -> list:
    """The first ``CI_CASES`` cases of ``seed`` on at most ``CI_WORLD`` ranks."""
    out, k = [], 0
    while len(out) < CI_CASES:
        c = case(seed, k)
        if c.world <= CI_WORLD:
            out.append(c)
        k += 1
    return out


def test_seeded_layouts_emulated_match_plain(tmp_path):
    seed = _seed()
    cases = _ci_cases(seed)
    print(f"layout fuzz seed {seed} (LAYOUT_FUZZ_SEED={seed} reruns these cases)")
    outcomes = []
    for world in sorted({c.world for c in cases}):
        outcomes += run_cases([c for c in cases if c.world == world], str(tmp_path))
    failed = [o for o in outcomes if not o.ok]
    report = [
        f"{o.case.command()}  # {o.kind}: {o.case.describe()}\n"
        + "\n".join(o.detail.strip().splitlines()[-TAIL:])
        for o in failed
    ]
    assert not failed, f"layout fuzz seed {seed}: {len(failed)} case(s) failed:\n" + "\n".join(
        report
    )
    assert len(outcomes) == CI_CASES


# ---------------------------------------------------------------------------------------------
# regressions the sweep found


def _gather_grads(rank, world):
    """GatherSequence's input gradient, B = 2 rows, through the gloo path (all-reduce and slice)
    and through the NCCL form (reduce-scatter) under the emulation."""
    g = torch.Generator().manual_seed(0)
    pos = torch.arange(16).repeat(2, 1)
    x_full = torch.randn(2, 2, 16, 4, generator=g)
    w_full = torch.randn(2, 2, 16, 4, generator=g)
    layout = build_cp_shards(shard_sequence(pos, world, rank), dist.group.WORLD)
    grads = []
    for emulated in (False, True):
        x = shard_sequence(x_full.transpose(1, 2), world, rank).transpose(1, 2).clone()
        x.requires_grad_()
        with emulation.emulate_cuda() if emulated else emulation.maybe(False):
            (GatherSequence.apply(x, layout) * w_full).sum().backward()
        grads.append(x.grad)
    return grads


def test_allgather_backward_reduce_scatter_shapes():
    """The all-gather CP core's backward in its NCCL form passed reduce_scatter_single a stacked
    [C, B, ...] input for a [B, ...] output; gloo (and CheckedComm's emulated run) refused it
    (found by the fuzz: deepseek_v32 cp = 2, whose indexer keys take this path under either
    cp_attention). Both forms now give the same gradient."""
    for plain, emulated in run_distributed(_gather_grads, 2):
        torch.testing.assert_close(emulated, plain, rtol=0, atol=0)


if __name__ == "__main__":
    pytest.main([__file__, "-s"])
