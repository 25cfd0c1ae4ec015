"""FSDP2's in-place all-gather / reduce-scatter for gloo (primitives/sharding/fsdp_comm.py):
the same values as gloo's own collectives, without their full-size staging copies
(measured from the process's own peak resident memory)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from bumblebee.primitives.collectives import all_gather_single, reduce_scatter_single
from bumblebee.primitives.sharding.fsdp_comm import InPlaceAllGather, UnitReduceScatter
from tests.dist_utils import run_distributed

SLOT = 8 << 20  # elements per rank: 32 MiB of fp32


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def _growth(fn) -> int:
    """Peak resident bytes added while ``fn`` runs (VmHWM reset to the current RSS first)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status("VmRSS")
    fn()
    return _status("VmHWM") - before


def _collectives(rank, world):
    g = torch.Generator().manual_seed(rank)
    # integers: every order of summation gives the same float sum, so results compare exactly
    grads = torch.randint(-1000, 1000, (world * SLOT,), generator=g).float()
    shard = torch.randint(-1000, 1000, (SLOT,), generator=g).float()
    group, mesh = dist.group.WORLD, init_device_mesh("cpu", (world,))

    ref_rs, ref_ag = torch.empty(SLOT), torch.empty(world * SLOT)
    x = grads.clone()
    default_rs = _growth(lambda: reduce_scatter_single(ref_rs, x))
    default_ag = _growth(lambda: all_gather_single(ref_ag, shard))

    out, x = torch.empty(SLOT), grads.clone()
    ours_rs = _growth(
        lambda: UnitReduceScatter([], mesh, gloo=True)(out, x, group, dist.ReduceOp.SUM)
    )
    assert torch.equal(out, ref_rs)
    gathered = torch.full((world * SLOT,), float("nan"))
    gathered.view(world, -1)[rank].copy_(shard)  # FSDP copies the shard into its slot first
    ours_ag = _growth(lambda: InPlaceAllGather()(gathered, gathered.view(world, -1)[rank], group))
    assert torch.equal(gathered, ref_ag)
    return default_rs, ours_rs, default_ag, ours_ag


def test_in_place_collectives_match_gloo_without_full_size_copies(tmp_path):
    whole = 3 * SLOT * 4
    for rank, (default_rs, ours_rs, default_ag, ours_ag) in enumerate(
        run_distributed(_collectives, 3)
    ):
        print(
            f"rank {rank}: reduce-scatter +{default_rs >> 20} MiB (gloo) vs +{ours_rs >> 20} MiB (in place); "
            f"all-gather +{default_ag >> 20} vs +{ours_ag >> 20} MiB; whole tensor {whole >> 20} MiB"
        )
        assert ours_ag < whole // 8, "the all-gather staged a copy"
        assert ours_rs < whole // 2, "the reduce-scatter staged a full-size copy"
