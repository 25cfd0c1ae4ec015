"""Every `bumblebee train` command of the README's usage block passes the checks a launch makes
before any rank starts (layout, pipeline micro-batches, balance loss, kernels) on the ranks it
asks for, with the defaults for everything it does not set: the README's pipeline example used
to fail three times in turn (micro-batches, then train.balance, then eval_every with pp)."""

import re
import shlex
from pathlib import Path

from bumblebee import load_config
from bumblebee.cli import build_parser
from bumblebee.models import resolve_arch
from bumblebee.runtime.launch.preflight import check_kernels
from bumblebee.runtime.resolve import check_run

README = Path(__file__).parents[2] / "README.md"


def train_commands():
    text = README.read_text()
    block = text[text.index("### `bumblebee train`") :]
    block = re.search(r"```bash\n(.*?)```", block, flags=re.S).group(1)
    return [c.split("  #")[0] for c in block.splitlines() if c.startswith("bumblebee train")]


def test_readme_train_commands_pass_the_launch_checks():
    commands = train_commands()
    assert any("parallel.pp=2" in c for c in commands)
    for command in commands:
        args = build_parser().parse_args(shlex.split(command)[1:])
        cfg = load_config(args.config, args.overrides)
        check_run(cfg, args.nproc)
        check_kernels(cfg, resolve_arch(cfg.model), cuda=False)
