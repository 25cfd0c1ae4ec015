"""The command line's small promises: ``--version``; ``--help`` without importing torch (the
CLI imports a subcommand's modules only when that subcommand runs); ``--set k v`` answered by
the subcommand's usage; ``plan --help`` lists every preset and the ``family/tiny`` form; output
into a closed pipe (``| head``) ends without a traceback; warm-up longer than the run warned.
"""

import os
import subprocess
import sys

import pytest

from bumblebee.cli import main

ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(
        [
            os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
            os.environ.get("PYTHONPATH", ""),
        ]
    ),
}


def python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=300
    )


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == "bumblebee 0.1.0"


def test_help_imports_no_torch():
    """`import bumblebee.cli` and `bumblebee --help` load neither torch nor its pipelining package
    (seconds of imports before anything is printed)."""
    r = python(
        "import sys, bumblebee.cli\n"
        "from bumblebee.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.distributed.pipelining')))"
    )
    assert r.returncode == 0, r.stderr
    assert "usage: bumblebee" in r.stdout and r.stdout.strip().endswith("[]"), r.stdout


def test_public_api_still_reachable():
    import bumblebee

    assert (
        callable(bumblebee.from_hf)
        and callable(bumblebee.load_config)
        and bumblebee.Engine.__name__ == "Engine"
    )
    from bumblebee import ConfigError, build_model, to_hf  # noqa: F401  (from-imports resolve lazily too)

    with pytest.raises(AttributeError):
        _ = bumblebee.no_such_name


@pytest.mark.parametrize("command", ["train", "plan", "rl"])
def test_set_without_equals_shows_the_subcommand_usage(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, "--set", "train.steps", "5"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert (
        err.startswith(f"usage: bumblebee {command}")
        and "--set train.steps: expected KEY=VALUE" in err
    ), err


def test_plan_help_lists_every_preset(capsys):
    from bumblebee.models import FAMILIES

    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    # argparse wraps lines, also after a hyphen inside a name ("kimi-" / "linear-48b-a3b")
    out = " ".join(capsys.readouterr().out.split()).replace("- ", "-")
    for family in FAMILIES.values():
        for name in family.presets:
            assert (f"{family.name}/tiny" if name == "tiny" else name) in out, name
    assert "FAMILY/tiny" in out


def test_closed_pipe_ends_quietly(tmp_path):
    """`bumblebee data inspect X | head`: the reader is gone before the output is written."""
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(f'{{"input_ids": {list(range(1, 40))}}}\n' for _ in range(20)))
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "bumblebee.cli",
            "data",
            "prepare",
            "--source",
            "tokens",
            str(src),
            str(tmp_path / "prepared"),
            "--no-progress",
            "--workers",
            "1",
        ],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    read, write = os.pipe()
    os.close(read)  # as `head` after its lines: every write into the pipe fails
    try:
        r = subprocess.run(
            [sys.executable, "-m", "bumblebee.cli", "data", "inspect", str(tmp_path / "prepared")],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            env=ENV,
            timeout=300,
        )
    finally:
        os.close(write)
    assert "Traceback" not in r.stderr and "BrokenPipeError" not in r.stderr, r.stderr
    assert r.returncode == 141


TINY = [
    "model.arch.num_hidden_layers=1",
    "model.arch.hidden_size=32",
    "model.arch.head_dim=8",
    "model.arch.moe_intermediate_size=16",
    "model.arch.num_experts=2",
    "model.arch.num_experts_per_tok=1",
    "primitives.loss=ce",
    "primitives.recompute=none",
    "primitives.attention=sdpa",
    "train.seq_len=32",
    "train.global_batch=1",
    "train.steps=1",
    "train.eval_every=0",
]


def test_warmup_longer_than_the_run_is_warned(tmp_path, capsys):
    sets = [a for s in TINY for a in ("--set", s)]
    assert (
        main(
            [
                "train",
                *sets,
                "--set",
                "train.warmup_steps=10",
                "--set",
                f"train.out_dir={tmp_path / 'a'}",
            ]
        )
        == 0
    )
    err = capsys.readouterr().err
    assert "bumblebee: warning: train.warmup_steps = 10 > train.steps = 1" in err
    assert (
        main(
            [
                "train",
                *sets,
                "--set",
                "train.warmup_steps=0",
                "--set",
                f"train.out_dir={tmp_path / 'b'}",
            ]
        )
        == 0
    )
    assert "warning" not in capsys.readouterr().err
    # a run refused before launch: its error stays the only line
    assert main(["train", *sets, "--set", "train.warmup_steps=10", "--nproc", "0"]) == 2
    assert "warning" not in capsys.readouterr().err


def test_vocabulary_mismatch_names_the_directory_and_the_fix(tmp_path, capsys):
    """A corpus prepared for a larger vocabulary: refused before launch, naming data.path and
    how to prepare it again (was: the source's own message naming the input file only)."""
    src = tmp_path / "docs.jsonl"
    src.write_text('{"input_ids": [1, 2, 3, 70000]}\n' * 4)  # beyond the tiny preset's vocabulary
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "bumblebee.cli",
            "data",
            "prepare",
            "--source",
            "tokens",
            str(src),
            str(tmp_path / "prepared"),
            "--no-progress",
            "--workers",
            "1",
        ],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert (
        main(
            [
                "train",
                "--set",
                "data.source=tokens",
                "--set",
                f"data.path={tmp_path / 'prepared'}",
                "--set",
                f"train.out_dir={tmp_path / 'run'}",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        f"bumblebee: error: {tmp_path / 'prepared'}: prepared with token ids up to 70000"
    )
    assert "bumblebee data prepare" in err and "--tokenizer" in err and "\n" not in err


def test_plan_suggests_offloading_when_the_static_state_does_not_fit(capsys):
    assert (
        main(["plan", "--model", "qwen3-235b-a22b", "--gpus", "8", "--seq", "4096", "--top", "1"])
        == 0
    )
    assert "train.offload_optimizer = true" in capsys.readouterr().out
