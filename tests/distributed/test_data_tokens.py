"""A prepared (memory-mapped) token corpus trains identically on 1 rank and on 2 data-parallel
ranks that each build only their own rows: per-step loss, grad norm and held-out eval_loss."""

import io
import json
import random

import pytest
from dist_utils import run_distributed

from bumblebee import load_config
from bumblebee.data.encode import Encoder
from bumblebee.data.prepare import prepare
from bumblebee.runtime.trainer import Trainer

STEPS = 3
BASE = [
    "model.arch.num_hidden_layers=2",
    "model.arch.hidden_size=64",
    "model.arch.moe_intermediate_size=32",
    "train.seq_len=64",
    "train.global_batch=4",
    f"train.steps={STEPS}",
    "train.lr=1e-2",
    "train.warmup_steps=1",
    "data.source=tokens",
    "data.eval_fraction=0.1",
    "train.eval_every=3",
]


def run(overrides, out_dir):
    trainer = Trainer(
        load_config(None, BASE + overrides + [f"train.out_dir={out_dir}"]), stream=io.StringIO()
    )
    trainer.run()
    with open(f"{out_dir}/metrics.jsonl") as f:
        return [json.loads(x) for x in f] if trainer.rank == 0 else None


def _ranks(rank, world, overrides, out_dir):
    return run(overrides, out_dir)


def test_tokens_source_two_ranks_match_one(tmp_path):
    rng = random.Random(0)
    path = tmp_path / "t.jsonl"
    lines = []
    for _ in range(300):
        n = rng.randint(5, 90)
        lines.append(
            json.dumps(
                {
                    "input_ids": [rng.randrange(1, 272) for _ in range(n)],
                    "loss_mask": [int(rng.random() < 0.7) for _ in range(n)],
                }
            )
        )
    path.write_text("\n".join(lines) + "\n")
    prepare(str(path), str(tmp_path / "prepared"), Encoder("tokens"), progress=False)
    data = [f"data.path={tmp_path / 'prepared'}"]
    ref = run(data + ["primitives.sharding=none", "primitives.moe_comm=local"], tmp_path / "ref")
    got = run_distributed(_ranks, 2, data, str(tmp_path / "dp2"))[0]
    assert [r["step"] for r in got] == [1, 2, 3] and "eval_loss" in got[-1]
    for a, b in zip(got, ref):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
        assert a["valid_tokens"] == b["valid_tokens"]
    assert got[-1]["eval_loss"] == pytest.approx(ref[-1]["eval_loss"], rel=1e-5)
    assert got[-1]["eval_tokens"] == ref[-1]["eval_tokens"]
