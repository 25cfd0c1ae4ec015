"""Single-process training: the loss falls, metrics are written, accumulation and
determinism behave."""

import io
import json
import math

import pytest

from bumblebee import load_config
from bumblebee.runtime.trainer import Trainer

SMALL = [
    "model.arch.num_hidden_layers=2",
    "model.arch.hidden_size=64",
    "model.arch.moe_intermediate_size=64",
    "train.seq_len=256",
    "data.min_records=4",
    "data.max_records=12",
]


def train(tmp_path, *overrides):
    cfg = load_config(None, SMALL + [f"train.out_dir={tmp_path}", *overrides])
    summary = Trainer(cfg, stream=io.StringIO()).run()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return summary, lines


def test_retrieval_is_learned_below_chance_and_metrics_written(tmp_path):
    """Loss is taken on the answer digits only, so chance is ln 10 = 2.30 per digit: a
    final loss well below it means the model copies the value from the record it queried
    (random digits: nothing but attention back to the record gives them). One record per
    document and short documents keep the task learnable in 80 tiny steps."""
    summary, lines = train(
        tmp_path,
        "train.steps=80",
        "train.global_batch=8",
        "train.lr=3e-3",
        "train.warmup_steps=10",
        "train.seq_len=128",
        "data.min_records=1",
        "data.max_records=1",
        "data.max_doc_len=24",
        "data.ramp_steps=0",
    )  # short documents: no long filler
    assert len(lines) == 80
    for key in (
        "step",
        "loss",
        "aux_loss",
        "grad_norm",
        "lr",
        "tokens",
        "tokens_per_s",
        "peak_mem_bytes",
    ):
        assert key in lines[0] and all(math.isfinite(r[key]) for r in lines)
    assert lines[0]["loss"] > 5.0  # ~ln(272) at init
    last = sum(r["loss"] for r in lines[-5:]) / 5
    assert last < math.log(10) - 0.8, [round(r["loss"], 2) for r in lines]  # measured: ~0.6
    assert (tmp_path / "config.toml").exists()
    # warmup then cosine decay
    lrs = [r["lr"] for r in lines]
    assert lrs[0] < lrs[9] and lrs[-1] < lrs[15]


def test_gradient_accumulation_matches_full_batch(tmp_path):
    _, a = train(tmp_path / "a", "train.steps=3", "train.global_batch=4", "train.micro_batch=4")
    _, b = train(tmp_path / "b", "train.steps=3", "train.global_batch=4", "train.micro_batch=1")
    # step 1 (before any update) agrees to float rounding; Adam's first steps amplify the rounding
    # of the different accumulation order (~1e-7) to ~1e-5 by step 3, a scaling bug would be ~1e-1
    assert a[0]["loss"] == pytest.approx(b[0]["loss"], rel=1e-6)
    for ra, rb in zip(a, b):
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-4)
        assert ra["grad_norm"] == pytest.approx(rb["grad_norm"], rel=1e-4)


def test_deterministic_runs_are_bit_identical(tmp_path):
    _, a = train(tmp_path / "a", "train.steps=3", "train.deterministic=true")
    _, b = train(tmp_path / "b", "train.steps=3", "train.deterministic=true")
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert [r["grad_norm"] for r in a] == [r["grad_norm"] for r in b]


def test_bf16_trains(tmp_path):
    """bf16 autocast follows the fp32 run step by step (each loss within an error budget, so the
    updates are the same updates) and is not the fp32 run itself (autocast is on)."""
    _, bf16 = train(tmp_path / "bf16", "train.steps=4", "train.dtype='bfloat16'")
    _, fp32 = train(tmp_path / "fp32", "train.steps=4")
    a, b = [r["loss"] for r in bf16], [r["loss"] for r in fp32]
    assert all(math.isfinite(x) for x in a)
    # measured: at most 6e-5 relative apart; a step lost or mis-scaled in bf16 moves a later loss by
    # more than 1e-2 (the loss falls ~0.1 per step here)
    assert a == pytest.approx(b, rel=2e-3), (a, b)
    assert a != b
    assert b[0] - b[-1] > 0.15, b
