"""Static memory evidence: fsdp2 holds ~1/world of params + grads + optimizer state per
rank; zero1 keeps params and grads replicated and shards only the optimizer state."""

import io
import sys
from pathlib import Path

from dist_utils import run_distributed

from bumblebee.config import load_config

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
from static_memory import measure  # noqa: E402

ARGS = ["model.arch.hidden_size=64", "model.arch.num_hidden_layers=2", "model.arch.moe_intermediate_size=64",
        "train.seq_len=128", "data.min_records=2", "data.max_records=6", "train.global_batch=2",
        "train.out_dir=/tmp/bumblebee-test-static"]


def _ranks(rank, world):
    return {s: measure(load_config(None, ARGS + [f"primitives.sharding={s}"])) for s in ("fsdp2", "zero1")}


def test_fsdp2_shards_everything_zero1_only_optimizer_state():
    single = measure(load_config(None, ARGS + ["primitives.sharding=none"]))
    total = sum(single.values())
    for per_rank in run_distributed(_ranks, 2):
        fsdp = per_rank["fsdp2"]
        assert abs(sum(fsdp.values()) - total / 2) <= 0.1 * total / 2
        zero = per_rank["zero1"]
        assert zero["params"] == single["params"] and zero["grads"] == single["grads"]
        assert abs(zero["optimizer"] - single["optimizer"] / 2) <= 0.1 * single["optimizer"] / 2
