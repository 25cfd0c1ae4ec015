"""Static memory evidence: fsdp2 holds ~1/world of params + grads + optimizer state per
rank; zero1 keeps params and grads replicated and shards only the optimizer state. And the
CPU MemoryTracker sees FSDP2's gathered parameters, which FSDP2 grows and frees with
in-place storage resizes (exact bytes for one unit's unshard / reshard)."""

import sys
from pathlib import Path

import torch
from dist_utils import run_distributed
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from bumblebee import load_config
from bumblebee.perf import MemoryTracker

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
from static_memory import measure  # noqa: E402

ARGS = [
    "model.arch.hidden_size=64",
    "model.arch.num_hidden_layers=2",
    "model.arch.moe_intermediate_size=64",
    "train.seq_len=128",
    "data.min_records=2",
    "data.max_records=6",
    "train.global_batch=2",
    "train.out_dir=/tmp/bumblebee-test-static",
]


def _ranks(rank, world):
    out = {
        s: measure(load_config(None, ARGS + [f"primitives.sharding={s}"]))
        for s in ("fsdp2", "zero1")
    }
    out["gathers"] = _tracked_gathers(world)
    return out


UNIT = 512 * 512 * 4  # bytes of one fp32 Linear(512, 512) weight, gathered


def _tracked_gathers(world):
    """Tracker figures around FSDP2's unshard / reshard of one unit and a forward+backward,
    after a warm-up step (so the gathered storages exist, resized to 0 between uses)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512, bias=False) for _ in range(3)])
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x = torch.randn(4, 512)
    model(x).sum().backward()
    model.zero_grad(set_to_none=True)
    with MemoryTracker("cpu") as mem:
        base = mem.current_bytes
        model[1].unshard()
        gathered = mem.current_bytes - base
        model[1].reshard()
        freed = mem.current_bytes - base
        mem.reset_peak()
        model(x).sum().backward()
        peak = mem.peak_bytes - base
    return gathered, freed, peak


def test_fsdp2_shards_everything_zero1_only_optimizer_state():
    single = measure(load_config(None, ARGS + ["primitives.sharding=none"]))
    total = sum(single.values())
    for per_rank in run_distributed(_ranks, 2):
        gathered, freed, peak = per_rank["gathers"]
        # Reshard frees exactly the unit's bytes; unshard grows by at least that much (the
        # all-gather's staging buffer may still be alive when gloo's work object lets go late).
        assert gathered >= UNIT and gathered - freed == UNIT, (gathered, freed)
        assert peak >= UNIT + UNIT // 2  # a gathered unit on top of the sharded gradients
        fsdp = per_rank["fsdp2"]
        assert abs(sum(fsdp.values()) - total / 2) <= 0.1 * total / 2
        zero = per_rank["zero1"]
        assert zero["params"] == single["params"] and zero["grads"] == single["grads"]
        assert abs(zero["optimizer"] - single["optimizer"] / 2) <= 0.1 * single["optimizer"] / 2
