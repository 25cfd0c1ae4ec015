"""Sizes that cannot work are refused up front with one line (exit 2) instead of a raw
MemoryError, a silent NaN, or a run that never reaches step 1: ``data inspect --seq-len``
beyond the machine's memory, ``plan --dry-run --skew`` NaN / infinite, ``train.seq_len`` whose
activations alone exceed the device."""

import json

import pytest
from cli_helpers import one_line_error, sets

from bumblebee.cli import main

TINY = [
    "train.warmup_steps=1",
    "model.arch.num_hidden_layers=1",
    "model.arch.hidden_size=32",
    "model.arch.head_dim=8",
    "model.arch.moe_intermediate_size=16",
    "model.arch.num_experts=2",
    "model.arch.num_experts_per_tok=1",
    "train.global_batch=1",
    "data.min_records=1",
    "data.max_records=2",
]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    d = tmp_path_factory.mktemp("p")
    (d / "a.jsonl").write_text(
        "".join(json.dumps({"input_ids": [1, 2, 3]}) + "\n" for _ in range(4))
    )
    out = d / "out"
    assert (
        main(
            ["data", "prepare", str(d / "a.jsonl"), str(out), "--source", "tokens", "--no-progress"]
        )
        == 0
    )
    return out


@pytest.mark.parametrize("seq_len", [10**12, 2**62])
def test_inspect_with_an_absurd_seq_len(capsys, prepared, seq_len):
    capsys.readouterr()
    one_line_error(
        capsys, ["data", "inspect", str(prepared), "--seq-len", str(seq_len)], "--seq-len"
    )


@pytest.mark.parametrize("skew", ["nan", "inf", "-inf"])
def test_plan_dry_run_with_a_non_finite_skew(capsys, skew):
    argv = ["plan", "--model", "qwen3_moe/tiny", "--gpus", "1", "--seq", "256", "--dry-run"]
    one_line_error(capsys, argv + [f"--skew={skew}"], "--skew")


def test_train_seq_len_that_cannot_fit_is_refused_before_launch(capsys, tmp_path):
    argv = ["train"] + sets(TINY + ["train.seq_len=1000000000", f"train.out_dir={tmp_path}"])
    one_line_error(capsys, argv, "train.seq_len = 1000000000")
