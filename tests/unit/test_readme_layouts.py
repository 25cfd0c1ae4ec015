"""Every `bumblebee train` command of the usage block in docs/commands.md (moved there from the
README) and every one the README shows passes the checks a launch makes before any rank starts
(layout, pipeline micro-batches, balance loss, kernels) on the ranks it asks for, with the
defaults for everything it does not set: the pipeline example used to fail three times in turn
(micro-batches, then train.balance, then eval_every with pp)."""

import re
import shlex
from pathlib import Path

from bumblebee import load_config
from bumblebee.cli import build_parser
from bumblebee.models import resolve_arch
from bumblebee.runtime.launch.preflight import check_kernels
from bumblebee.runtime.resolve import check_run

ROOT = Path(__file__).parents[2]
COMMANDS = ROOT / "docs" / "commands.md"
README = ROOT / "README.md"


def usage_block_commands():
    """The `bumblebee train` lines of the first ```bash block under the train heading."""
    text = COMMANDS.read_text()
    start = re.search(r"^#+ `bumblebee train`$", text, flags=re.M)
    assert start, f"{COMMANDS.relative_to(ROOT)} has no `bumblebee train` heading"
    block = re.search(r"```bash\n(.*?)```", text[start.end() :], flags=re.S).group(1)
    return [c.split("  #")[0] for c in block.splitlines() if c.startswith("bumblebee train")]


def readme_train_commands():
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)
    return [
        part.split("  #")[0].strip()
        for block in blocks
        for line in block.splitlines()
        for part in line.split("&&")
        if part.strip().startswith("bumblebee train")
    ]


def check(command):
    args = build_parser().parse_args(shlex.split(command)[1:])
    cfg = load_config(args.config, args.overrides)
    check_run(cfg, args.nproc)
    check_kernels(cfg, resolve_arch(cfg.model), cuda=False)


def test_usage_block_train_commands_pass_the_launch_checks():
    commands = usage_block_commands()
    assert any("parallel.pp=2" in c for c in commands)
    for command in commands:
        check(command)


def test_readme_train_commands_pass_the_launch_checks():
    commands = readme_train_commands()
    assert commands
    for command in commands:
        check(command)
