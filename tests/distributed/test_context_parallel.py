"""Context parallelism: zigzag sharding and CP attention (allgather, ring) give the same
loss and gradients as cp=1 on packed documents of uneven lengths, alone and composed
with dp_shard, ep, fsdp2, linear CE and full recompute."""

import io
import json

import pytest
import torch
from dist_utils import run_distributed
from torch.distributed.tensor import DTensor

from bumblebee import load_config
from bumblebee.primitives.cp.zigzag import shard_sequence, unshard_sequence, zigzag_index
from bumblebee.runtime.trainer import Trainer

T = 256
# documents per row: one shorter than a cp=4 chunk (32), one spanning all ranks, a few in between
DOCS = [[5, 200, 17, 34], [250, 6], [64, 64, 64, 64], [1, 255]]
BASE = [
    "model.arch.num_hidden_layers=2",
    "model.arch.hidden_size=64",
    "model.arch.moe_intermediate_size=32",
    "model.arch.num_experts=4",
    "model.arch.vocab_size=256",
    f"train.seq_len={T}",
    "train.global_batch=4",
    "train.micro_batch=2",
    "train.clip_grad=0",
    "train.lr=1e-2",
    "train.warmup_steps=1",
    "data.source='jsonl'",
]


def write_data(path) -> str:
    g = torch.Generator().manual_seed(0)
    with open(path, "w") as f:
        for row in DOCS:
            for n in row:
                f.write(
                    json.dumps({"input_ids": torch.randint(0, 256, (n,), generator=g).tolist()})
                    + "\n"
                )
    return str(path)


def run(overrides, data, out_dir, steps):
    cfg = load_config(
        None,
        BASE
        + [f"data.path={data}", f"train.out_dir={out_dir}", f"train.steps={steps}", *overrides],
    )
    trainer = Trainer(cfg, stream=io.StringIO())
    grads = {}
    step = trainer.sharding.step

    def capture(optimizer):  # gradients of the first step, after reduction, before the update
        if not grads:
            # replicated (not FSDP-sharded) dense gradients; sharded runs are checked by grad norm
            grads.update(
                {
                    n: p.grad.detach().clone()
                    for n, p in trainer.model.named_parameters()
                    if p.grad is not None and "experts" not in n and not isinstance(p.grad, DTensor)
                }
            )
        step(optimizer)

    trainer.sharding.step = capture
    trace = [trainer.train_step() for _ in range(steps)]
    return [(r["loss"], r["grad_norm"]) for r in trace], grads


def _ranks(rank, world, cases, data, out_dir):
    return [run(ov, data, f"{out_dir}/{rank}", steps) for ov, steps in cases]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_data(tmp_path_factory.mktemp("cp") / "docs.jsonl")


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
    return run(["primitives.sharding=none"], data, tmp_path_factory.mktemp("ref"), 5)


def check(result, ref, steps, what):
    (trace, grads), (ref_trace, ref_grads) = result, ref
    for (loss, gnorm), (ref_loss, ref_gnorm) in zip(trace[:steps], ref_trace[:steps]):
        assert loss == pytest.approx(ref_loss, rel=1e-5), what
        assert gnorm == pytest.approx(ref_gnorm, rel=1e-5), what
    for name, g in grads.items():
        err = ((g - ref_grads[name]).norm() / ref_grads[name].norm()).item()
        assert err < 1e-5, f"{what}: {name} gradient relative error {err:.1e}"


def test_zigzag_roundtrip_and_balance():
    parts = [shard_sequence(torch.arange(16).view(1, 16), 4, r) for r in range(4)]
    assert parts[0].tolist() == [[0, 1, 14, 15]] and parts[3].tolist() == [[6, 7, 8, 9]]
    assert unshard_sequence(parts).tolist() == [list(range(16))]
    # causal work per rank (sum of key counts of its queries) is identical
    work = [int((zigzag_index(64, 4, r) + 1).sum()) for r in range(4)]
    assert len(set(work)) == 1
    with pytest.raises(ValueError, match="not divisible by 2 x cp"):
        zigzag_index(20, 4, 0)


TWO = [
    (["parallel.cp=2", "primitives.sharding=zero1", "primitives.cp_attention=allgather"], 1),
    (["parallel.cp=2", "primitives.sharding=zero1", "primitives.cp_attention=ring"], 1),
    (
        [
            "parallel.cp=2",
            "parallel.ep=2",
            "primitives.sharding=fsdp2",
            "primitives.cp_attention=ring",
        ],
        5,
    ),
]
FOUR = [
    (["parallel.cp=4", "primitives.sharding=zero1", "primitives.cp_attention=allgather"], 1),
    (["parallel.cp=4", "primitives.sharding=zero1", "primitives.cp_attention=ring"], 1),
    (
        [
            "parallel.cp=2",
            "parallel.ep=4",
            "primitives.sharding=fsdp2",
            "primitives.cp_attention=ring",
            "primitives.loss=linear_ce",
            "primitives.recompute=full",
        ],
        3,
    ),
]


def test_cp2_matches_cp1(reference, data, tmp_path):
    results = run_distributed(_ranks, 2, TWO, data, str(tmp_path))[0]
    for (ov, steps), result in zip(TWO, results):
        check(result, reference, steps, " ".join(ov))


def test_cp4_matches_cp1(reference, data, tmp_path):
    results = run_distributed(_ranks, 4, FOUR, data, str(tmp_path))[0]
    for (ov, steps), result in zip(FOUR, results):
        check(result, reference, steps, " ".join(ov))


def test_bad_cp_layout_is_rejected():
    from bumblebee.config import ConfigError
    from bumblebee.runtime.resolve import check_run

    cfg = load_config(None, ["parallel.cp=3", "train.seq_len=100"])
    with pytest.raises(ConfigError, match="divisible by 2 x parallel.cp"):
        check_run(cfg, 3)
