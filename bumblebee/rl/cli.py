"""``bumblebee rl``: arguments, configuration (run config + ``RLConfig``), launch, plot.

Configuration, lowest to highest precedence: the RL defaults below (a smaller tiny
model and optimizer settings suited to the toy task), the ``--config`` TOML file,
then ``--set`` overrides. Keys under ``rl.`` (``--set rl.steps=40`` or an ``[rl]``
table) go to ``RLConfig``; everything else is the ordinary run config, validated by
``load_config``. ``--tis C`` is ``--set rl.tis=C`` and ``--lora R`` is
``--set model.lora.rank=R`` (both applied last). ``--plot out.png``
draws the reward curve (through bumblebee/report.py; matplotlib is imported only when
asked for).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import get_type_hints

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from bumblebee.config import ConfigError
from bumblebee.config_parse import parse_override, read_toml
from bumblebee.console import SetOverride
from bumblebee.report import check_plot_target, plot_rewards
from bumblebee.rl.rl_config import RLConfig
from bumblebee.rl.run import run as run_rl
from bumblebee.runtime.resolve import load_config

# the run config of the embedded RL run, before the user's file and overrides; rows hold ~10
# short rollouts each, so one masked SDPA call beats varlen's per-document loop
RL_DEFAULTS = [
    "primitives.attention=sdpa",
    "model.arch.num_hidden_layers=2",
    "model.arch.hidden_size=64",
    "model.arch.num_attention_heads=4",
    "model.arch.num_key_value_heads=2",
    "model.arch.head_dim=16",
    "model.arch.num_experts=4",
    "model.arch.moe_intermediate_size=64",
    "train.micro_batch=16",
    "train.global_batch=32",
    "train.weight_decay=0.0",
    "train.clip_grad=1.0",
    "train.out_dir=runs/rl",
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="F", help="TOML config file; an [rl] table sets RLConfig")
    p.add_argument(
        "--set",
        dest="overrides",
        action=SetOverride,
        metavar="SECTION.KEY=VALUE",
        help="override one value, e.g. --set rl.steps=40 or --set model.arch.hidden_size=128 (repeatable)",
    )
    p.add_argument(
        "--tis",
        type=float,
        metavar="C",
        help="truncated importance sampling on pi_train / pi_rollout, capped at C > 1 (e.g. 2); "
        "the same as --set rl.tis=C, which it overrides",
    )
    p.add_argument(
        "--lora",
        type=int,
        metavar="R",
        help="train rank-R LoRA adapters on every projection and the routed experts, the base "
        "frozen (models/lora.py); the same as --set model.lora.rank=R, which it overrides",
    )
    p.add_argument(
        "--nproc",
        type=int,
        default=1,
        metavar="N",
        help="local ranks to start (torch.distributed elastic); under torchrun leave it out",
    )
    p.add_argument(
        "--plot", metavar="OUT.png", help="write a PNG of the reward curve (needs matplotlib)"
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        metavar="N",
        help="intra-op CPU threads of a single-process run (default 1: the toy model is too small to "
        "gain from more, and on a busy machine extra threads only contend)",
    )


def _flatten(prefix: str, value) -> list[str]:
    if isinstance(value, dict):
        return [item for k, v in value.items() for item in _flatten(f"{prefix}.{k}", v)]
    return [f"{prefix}={json.dumps(value)}"]  # JSON scalars and arrays are TOML literals


def _set_rl(rl: RLConfig, key: str, value, where: str) -> None:
    hints = get_type_hints(RLConfig)
    if key not in hints:
        raise ConfigError(f"{where}: unknown key rl.{key}; valid: {', '.join(hints)}")
    hint = hints[key]
    if hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        value = float(value)
    elif not (isinstance(value, hint) and not (hint is int and isinstance(value, bool))):
        raise ConfigError(f"{where}: rl.{key} expects {hint.__name__}, got {value!r}")
    setattr(rl, key, value)


def load_configs(path: str | None, overrides: list[str]):
    """(run Config, RLConfig) from the defaults, an optional TOML file and ``--set`` items."""
    data = read_toml(path) if path else {}
    rl = RLConfig()
    rl_table = data.pop("rl", {})
    if not isinstance(rl_table, dict):
        raise ConfigError(f"{path}: [rl] must be a table")
    for key, value in rl_table.items():
        _set_rl(rl, key, value, path)
    rest = []
    for item in overrides:
        keys, value = parse_override(item)
        if keys[0] == "rl":
            if len(keys) != 2:
                raise ConfigError(f"--set {item!r}: expected rl.key=value")
            _set_rl(rl, keys[1], value, "--set")
        else:
            rest.append(item)
    file_items = [x for section, table in data.items() for x in _flatten(section, table)]
    cfg = load_config(None, RL_DEFAULTS + file_items + rest)
    rl.validate()
    return cfg, rl


def configs_from_args(args):
    """(run Config, RLConfig) of parsed ``bumblebee rl`` arguments."""
    overrides = list(args.overrides or [])
    if args.tis is not None:  # last, so it wins over the file and --set
        overrides.append(f"rl.tis={args.tis!r}")
    if args.lora is not None:
        overrides.append(f"model.lora.rank={args.lora}")
    return load_configs(args.config, overrides)


@record
def _worker(job) -> None:
    from bumblebee.runtime.launch import launcher as launch
    from bumblebee.runtime.launch.interrupts import interrupt_once

    cfg, rl, out_png = job
    launch.init_distributed()
    try:
        with interrupt_once(ignore_after=True):  # Ctrl-C stops the rank quietly
            _run_and_plot(cfg, rl, out_png)
    finally:
        import torch.distributed as dist

        dist.destroy_process_group()


def _run_and_plot(cfg, rl, out_png) -> None:
    import torch.distributed as dist

    run_rl(cfg, rl)
    if out_png and (not dist.is_initialized() or dist.get_rank() == 0):
        plot_rewards(os.path.join(cfg.train.out_dir, "metrics.jsonl"), out_png)
        print(f"reward curve: {out_png}")


def run(args) -> int:
    from bumblebee.runtime.launch import launcher as launch
    from bumblebee.runtime.launch.interrupts import interrupt_once
    from bumblebee.runtime.launch.outdir import OutDirLock, check_out_dir
    from bumblebee.runtime.resolve import check_run

    cfg, rl = configs_from_args(args)
    if args.nproc < 1:
        raise ConfigError(f"--nproc must be >= 1, got {args.nproc}")
    if args.plot:  # fail before training, not after: the path, matplotlib, the format
        check_plot_target(args.plot, "rl --plot")
    if launch.started_by_torchrun():
        import torch.distributed as dist

        from bumblebee.runtime.launch.rank_logs import rank_log

        launch.init_distributed()
        with rank_log(launch.rank_log_dir(cfg), dist.get_rank(), launch.restart_count()):
            _run_and_plot(cfg, rl, args.plot)
        return 0
    check_run(cfg, args.nproc)
    if args.threads < 1:
        raise ConfigError(f"--threads must be >= 1, got {args.threads}")
    check_out_dir(cfg.train.out_dir, checkpoints=False)
    with OutDirLock(cfg.train.out_dir) as held:  # one run per out_dir
        if args.nproc > 1:
            return launch.launch_local(
                (cfg, rl, args.plot),
                args.nproc,
                worker=_worker,
                lock=held.path,
                log_dir=launch.rank_log_dir(cfg),
            )
        torch.set_num_threads(args.threads)
        with interrupt_once():
            _run_and_plot(cfg, rl, args.plot)
    return 0
