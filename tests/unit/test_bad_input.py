"""Bad input ends in one line ``bumblebee: error: ...`` and exit code 2, before any model is
built: wrong-typed or out-of-range values, output paths, the plan CLI, RL settings, and
messages that name what is wrong. (Files that are not what they claim, signals, zero-loss
batches and launched ranks: test_bad_files.py, test_interrupts.py.)"""

import os

import pytest
from cli_helpers import one_line_error, sets

from bumblebee.cli import main

TINY = [
    "model.arch.num_hidden_layers=1",
    "model.arch.hidden_size=32",
    "model.arch.head_dim=8",
    "model.arch.moe_intermediate_size=16",
    "model.arch.num_experts=2",
    "model.arch.num_experts_per_tok=1",
    "primitives.loss=ce",
    "primitives.recompute=none",
    "train.seq_len=32",
    "train.global_batch=1",
    "data.min_records=1",
    "data.max_records=2",
    "train.steps=1",
]


VALUES = [  # (--set items, fragment of the error)
    (["train.lr=nan"], "train.lr must be a finite number"),
    (["train.lr=inf"], "train.lr must be a finite number"),
    (["train.lr=-inf"], "train.lr must be a finite number"),
    (["train.min_lr=nan"], "train.min_lr must be a finite number"),
    (["train.clip_grad=inf"], "train.clip_grad must be a finite number"),
    (["train.beta1=1.0"], "train.beta1 must be in [0, 1)"),
    (["train.beta1=-0.1"], "train.beta1 must be in [0, 1)"),
    (["train.beta2=1.5"], "train.beta2 must be in [0, 1)"),
    (["train.eps=0"], "train.eps must be > 0"),
    (["train.weight_decay=-1"], "weight_decay >= 0"),
    (["model.arch.hidden_size=64.5"], "hidden_size must be an integer, got 64.5"),
    (["model.arch.hidden_size=abc"], "hidden_size must be an integer, got 'abc'"),
    (["model.arch.num_hidden_layers=true"], "num_hidden_layers must be an integer, got True"),
    (
        ["model.arch.tie_word_embeddings=yes"],
        "tie_word_embeddings must be true or false, got 'yes'",
    ),
    (['model.arch.tie_word_embeddings="true"'], "tie_word_embeddings must be true or false"),
    (["model.arch.norm_topk_prob=1"], "norm_topk_prob must be true or false, got 1"),
    (["model.arch.rms_norm_eps=small"], "rms_norm_eps must be a number, got 'small'"),
    (["model.arch.rms_norm_eps=nan"], "rms_norm_eps must be a finite number"),
    (["model.arch.rope_theta=inf"], "rope_theta must be a finite number"),
    (["model.arch.rope_theta=1"], "rope_theta must be > 1"),
    (["model.arch.rms_norm_eps=1"], "rms_norm_eps must be in (0, 0.01]"),
    (["model.arch.rms_norm_eps=0"], "rms_norm_eps must be in (0, 0.01]"),
    (["model.name=qwen3_5_moe", "model.arch.rms_norm_eps=1"], "rms_norm_eps must be in (0, 0.01]"),
    (["model.arch.num_experts=0"], "num_experts must be >= 1"),
    (
        ["train.steps=99999999999999999999999"],
        "train.steps = 99999999999999999999999 is beyond a 64-bit integer",
    ),
    (["train.seed=-99999999999999999999999"], "train.seed = -99999999999999999999999 is beyond"),
    (
        ["model.arch.vocab_size=99999999999999999999999"],
        "vocab_size = 99999999999999999999999 is beyond",
    ),
    (["model.arch.mlp_only_layers=[0.5]"], "mlp_only_layers must be a list of integers"),
    (["model.arch.mlp_only_layers=3"], "mlp_only_layers must be a list, got 3"),
    (["model.arch.hidden_act=1"], "hidden_act must be a string"),
    (
        ["model.name=qwen3_5_moe", "model.arch.layer_types=[1]"],
        "layer_types must be a list of strings",
    ),
    (
        ["model.name=qwen3_5_moe", "model.arch.linear_conv_kernel_dim=2.0"],
        "linear_conv_kernel_dim must be an integer",
    ),
    (["train.seq_len=3"], "too short for the synthetic key-value task"),
    (["train.seq_len=10"], "needs >= 11 tokens"),
    (["data.min_records=1", "data.max_records=27"], "max_records <= 26"),
    (["primitives.pp_layout=[[0.0]]"], "primitives.pp_layout must be a list of stages"),
    (['primitives.pp_layout=[["a"]]'], "primitives.pp_layout must be a list of stages"),
    (["primitives.pp_layout=[[true]]"], "primitives.pp_layout must be a list of stages"),
    (["primitives.pp_layout=[1, 2]"], "primitives.pp_layout must be a list of stages"),
    (["primitives.recompute_modules=[1]"], "recompute_modules must be a list of module names"),
    (['primitives.recompute_modules=["nope"]'], "unknown recompute_modules ['nope']"),
    (["primitives.pp_microbatches=-1"], "primitives.pp_microbatches must be >= 0"),
    (['train.out_dir=""'], "train.out_dir is empty"),
    (['train.out_dir="   "'], "train.out_dir is empty"),
    (["train.out_dir=/proc/bumblebee-run"], "/proc/bumblebee-run: not writable"),
    ([f"train.out_dir=/tmp/{'x' * 300}"], "longer than"),
]


@pytest.mark.parametrize("items, fragment", VALUES, ids=[" ".join(i) for i, _ in VALUES])
def test_bad_values_end_in_one_line(capsys, tmp_path, items, fragment):
    out = (
        [f"train.out_dir={tmp_path / 'run'}"]
        if not any(i.startswith("train.out_dir") for i in items)
        else []
    )
    one_line_error(capsys, ["train"] + sets(TINY + out + items), fragment)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_seq_len_message_mentions_zigzag_chunks_only_with_context_parallelism(capsys, tmp_path):
    line = one_line_error(
        capsys, ["train"] + sets(TINY + ["train.seq_len=3", f"train.out_dir={tmp_path}"]), "seq_len"
    )
    assert "zigzag" not in line
    one_line_error(
        capsys,
        ["train", "--nproc", "2"]
        + sets(TINY + ["train.seq_len=34", "parallel.cp=2", f"train.out_dir={tmp_path}"]),
        "zigzag chunks",
    )


@pytest.mark.parametrize(
    "items, fragment",
    [
        (['primitives.recompute_modules=["nope"]'], "unknown recompute_modules ['nope']"),
        (["train.seq_len=10"], "too short for the synthetic key-value task"),
        (["model.arch.hidden_size=32.0"], "hidden_size must be an integer"),
    ],
)
def test_errors_with_nproc_are_found_in_the_launching_process(capsys, tmp_path, items, fragment):
    one_line_error(
        capsys,
        ["train", "--nproc", "2"]
        + sets(TINY + ["train.global_batch=2", f"train.out_dir={tmp_path}", *items]),
        fragment,
    )


def test_gdn_cp_chunks_shorter_than_the_conv_window_are_refused_before_launch(capsys, tmp_path):
    items = TINY + [
        "model.name=qwen3_5_moe",
        'model.arch.layer_types=["linear_attention"]',
        "parallel.cp=2",
        "model.arch.linear_conv_kernel_dim=8",
        "train.seq_len=24",
        f"train.out_dir={tmp_path}",
    ]
    one_line_error(
        capsys, ["train", "--nproc", "2"] + sets(items), "fewer than the conv window (7)"
    )


def test_out_dir_that_is_a_file_or_has_a_file_for_checkpoints(capsys, tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    one_line_error(
        capsys, ["train"] + sets(TINY + [f"train.out_dir={f}"]), "exists and is not a directory"
    )
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").write_text("x")
    one_line_error(
        capsys,
        ["train"] + sets(TINY + [f"train.out_dir={run}", "train.save_every=1"]),
        "checkpoints exists and is not a directory",
    )
    assert (
        main(["train"] + sets(TINY + [f"train.out_dir={run}"])) == 0
    )  # without saving it is not needed


PLAN = [
    (
        ["--model", "qwen3.5-35b-a3b", "--gpus", "3", "--seq", "131072"],
        "--gpus 3: the recipe needs",
    ),
    (
        ["--model", "qwen3-30b-a3b", "--gpus", "8", "--seq", "4096", "--layout", "cp=2 cp=4"],
        "cp is given twice",
    ),
    (
        ["--model", "qwen3-30b-a3b", "--gpus", "8", "--seq", "4096", "--layout", "tp=1,tp=1"],
        "tp is given twice",
    ),
]


@pytest.mark.parametrize("args, fragment", PLAN)
def test_plan_cli_errors(capsys, args, fragment):
    one_line_error(capsys, ["plan"] + args, fragment)


@pytest.mark.parametrize("n", ["-1", "0"])
def test_convert_refuses_a_non_positive_shard_size(capsys, tmp_path, n):
    one_line_error(
        capsys,
        ["convert", "--to", "hf", str(tmp_path), str(tmp_path / "o"), "--max-shard-bytes", n],
        "--max-shard-bytes must be >= 1",
    )
    assert not os.path.exists(tmp_path / "o")


RL = [
    (["rl.clip_low=1.5"], "rl.clip_low must be in [0, 1)"),
    (["rl.clip_low=-0.1"], "rl.clip_low must be in [0, 1)"),
    (["rl.clip_high=-1.0"], "rl.clip_high >= 0"),
    (["rl.temperature=nan"], "rl.temperature must be a finite number"),
    (["rl.temperature=inf"], "rl.temperature must be a finite number"),
    (["rl.temperature=1e-20"], "rl.temperature must be a finite number >= 0.01"),
    (["rl.temperature=0"], "rl.temperature must be a finite number >= 0.01"),
    (
        ["rl.steps=99999999999999999999999"],
        "rl.steps = 99999999999999999999999 is beyond a 64-bit integer",
    ),
    (["rl.lr=inf"], "rl.lr must be a finite number"),
    (["rl.kl_coef=nan"], "rl.kl_coef must be a finite number"),
    (["rl.partial=2.0"], "rl.partial must be in [0, 1]"),
    (["rl.seq_len=8"], "rl.seq_len = 8 is shorter than the longest 'reverse' sequence"),
    (['rl.task="add"', "rl.digits=40"], "rl.digits must be <= 18"),
    (
        ['rl.task="add"', "rl.digits=12", "rl.max_new_tokens=20", "rl.seq_len=40"],
        "rl.seq_len = 40 is shorter",
    ),
    (["rl.max_new_tokens=2"], "rl.max_new_tokens = 2 cannot produce the longest answer"),
    (["rl.dual_clip=0.5"], "rl.dual_clip must be > 1"),
]


@pytest.mark.parametrize("items, fragment", RL, ids=[" ".join(i) for i, _ in RL])
def test_rl_settings_are_checked_before_warm_up(capsys, tmp_path, items, fragment):
    one_line_error(capsys, ["rl"] + sets(items + [f"train.out_dir={tmp_path}"]), fragment)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_checkpoints_that_become_unwritable_during_the_run_fail_with_one_line(tmp_path):
    from bumblebee import load_config
    from bumblebee.config import ConfigError
    from bumblebee.runtime.trainer import Trainer

    t = Trainer(load_config(None, TINY + ["train.save_every=1", f"train.out_dir={tmp_path}"]))
    if (tmp_path / "checkpoints").is_dir():
        (tmp_path / "checkpoints").rmdir()
    (tmp_path / "checkpoints").write_text(
        "not a directory any more"
    )  # root ignores permissions; a file does not
    with pytest.raises(ConfigError, match="cannot write a checkpoint"):
        t.run()
