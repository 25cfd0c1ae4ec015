"""All config errors of one invocation are reported together (issue 35, item 3): value checks
of every section, the model's architecture and the layout checks made before launch each add
their line (``bumblebee: error: ...``), exit 2, instead of one per attempt."""

import pytest
from cli_helpers import sets

from bumblebee import load_config
from bumblebee.cli import main
from bumblebee.errors import ConfigError

MISTAKES = [
    ("train.lr=-1", "train.lr"),  # a value (config_checks)
    ("data.eval_fraction=2", "data.eval_fraction"),  # another section's value
    ("model.arch.num_experts=0", "num_experts"),  # the architecture (resolve_arch)
]


def test_three_independent_mistakes_are_reported_together(capsys, tmp_path):
    code = main(["train"] + sets([m for m, _ in MISTAKES] + [f"train.out_dir={tmp_path}"]))
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2, lines
    assert len(lines) == 3 and all(ln.startswith("bumblebee: error: ") for ln in lines), lines
    for (_, name), line in zip(MISTAKES, lines):
        assert name in line, (name, lines)


def test_the_launch_checks_report_together(capsys, tmp_path):
    """The checks that need the world size (batch split, pipeline), on valid values: a batch
    that does not split and a balance a pipeline cannot give, both at once (the README's
    pipeline example used to fail on them one attempt at a time)."""
    mistakes = ["train.global_batch=3", "train.micro_batch=2", "train.balance=step"]
    code = main(
        ["train", "--nproc", "2"] + sets(mistakes + ["parallel.pp=2", f"train.out_dir={tmp_path}"])
    )
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and all(ln.startswith("bumblebee: error: ") for ln in lines), lines
    assert any("train.global_batch" in ln for ln in lines), lines
    assert any("train.balance" in ln for ln in lines), lines


def test_the_python_api_raises_one_error_naming_all(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(None, [m for m, _ in MISTAKES])
    assert all(name in str(e.value) for _, name in MISTAKES), str(e.value)
