"""The subcommands' arguments and runs that have no module of their own (train, primitives,
convert, checkpoint, data prepare's output guard); the others hand over to plan/, rl/, data/,
runtime/pair/ and report.py. cli.py lists them in ``SUBCOMMANDS``. Nothing heavy is imported at
module level: ``bumblebee --help`` must not load torch.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

from bumblebee.console import SetOverride


def add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config", metavar="F", help="TOML config file (default: the embedded default run)"
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action=SetOverride,
        metavar="SECTION.KEY=VALUE",
        help="override one config value, e.g. --set train.steps=20 (repeatable)",
    )


# ------------------------------------------------------------------------------ train
def train_args(p: argparse.ArgumentParser) -> None:
    add_config_args(p)
    p.add_argument(
        "--nproc",
        type=int,
        default=1,
        metavar="N",
        help="local ranks to start (torch.distributed elastic); under torchrun leave it out",
    )
    p.add_argument(
        "--resume",
        metavar="DIR|auto",
        help="continue from a checkpoint directory, or 'auto': the newest complete one in train.out_dir",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        metavar="N",
        help="with --nproc: restart every rank up to N times after a failure, resuming from the newest "
        "complete checkpoint (train.max_restarts)",
    )


def train_run(args) -> int:
    from bumblebee.config import ConfigError
    from bumblebee.config_checks import config_warnings
    from bumblebee.runtime.launch import launcher as launch
    from bumblebee.runtime.launch.interrupts import interrupt_once
    from bumblebee.runtime.launch.outdir import OutDirLock, distributed_lock
    from bumblebee.runtime.launch.preflight import preflight
    from bumblebee.runtime.launch.signals import Preempted
    from bumblebee.runtime.resolve import load_config
    from bumblebee.runtime.trainer import Trainer

    resume = [f"train.resume={json.dumps(args.resume)}"] if args.resume else []
    restarts = [f"train.max_restarts={args.max_restarts}"] if args.max_restarts is not None else []
    errors: list[str] = []  # reported with the checks below, all at once
    cfg = load_config(args.config, args.overrides + resume + restarts, errors=errors)
    if args.nproc < 1:
        errors.append(f"--nproc must be >= 1, got {args.nproc}")

    def checks(world: int):  # warnings only for a run that starts: an error stays the only line
        if errors:  # the launch checks assume valid values; they gather their own problems
            raise ConfigError("\n".join(errors))
        plan = preflight(cfg, world)
        if os.environ.get("RANK", "0") == "0":  # under torchrun: one copy of each warning
            from bumblebee.data.synthetic import eval_distance_warning

            distance = eval_distance_warning(cfg.data, cfg.train.seq_len)
            for warning in config_warnings(cfg) + ([distance] if distance else []):
                print(f"bumblebee: warning: {warning}", file=sys.stderr)
        return plan

    try:
        if launch.started_by_torchrun():
            import torch.distributed as dist

            from bumblebee.runtime.launch.rank_logs import rank_log

            launch.init_distributed(cfg.train.collective_timeout_s)
            with (
                rank_log(launch.rank_log_dir(cfg), dist.get_rank(), launch.restart_count()),
                distributed_lock(cfg.train.out_dir, lambda: checks(dist.get_world_size())),
            ):
                launch.train_worker(cfg)
            return 0
        plan = checks(args.nproc)  # reject bad input before any process starts
        with OutDirLock(cfg.train.out_dir) as held:  # one run per out_dir, for the run's lifetime
            if args.nproc > 1:
                return launch.launch_local(
                    cfg, args.nproc, max_restarts=cfg.train.max_restarts, lock=held.path
                )
            with interrupt_once():
                Trainer(cfg, plan=plan).run()
    except Preempted as p:
        if os.environ.get("RANK", "0") == "0":  # under torchrun every rank stops; one line
            print(f"bumblebee: {p}", file=sys.stderr)
        return p.exit_code
    return 0


# ------------------------------------------------------------------------------ primitives
def primitives_args(p: argparse.ArgumentParser) -> None:
    pass


def primitives_run(args) -> int:
    from bumblebee import registry
    from bumblebee.config import PrimitivesConfig
    from bumblebee.primitives import kernel_choice

    defaults = PrimitivesConfig()
    for slot, desc in registry.SLOTS.items():
        impls = registry.implementations(slot)
        print(f"{slot}: {desc}")
        if not impls:
            print("    (no implementation yet)")
        for name, impl in impls.items():
            tags = [
                t
                for t, on in (
                    ("reference", impl.reference),
                    ("default", getattr(defaults, slot) == name),
                )
                if on
            ]
            tag = f" [{', '.join(tags)}]" if tags else ""
            print(f"    {name:<14}{tag:<22} {impl.summary}")
            for device, dtype, label in kernel_choice.rows(slot, name):  # the kernel it runs where
                print(f"        {device + ', ' + dtype:<36} -> {label}")
    print("kernels beside the slots:")
    for (slot, name), desc in kernel_choice.EXTRA_KERNELS.items():
        print(f"    {slot}/{name}: {desc}")
        for device, dtype, label in kernel_choice.rows(slot, name):
            print(f"        {device + ', ' + dtype:<36} -> {label}")
    return 0


# ------------------------------------------------------------------------------ pair
def pair_args(p: argparse.ArgumentParser) -> None:
    from bumblebee.runtime.pair.command import add_arguments

    add_config_args(p)
    add_arguments(p)


def pair_run(args) -> int:
    from bumblebee.runtime.pair.command import run

    return run(args)


# ------------------------------------------------------------------------------ plan
def plan_args(p: argparse.ArgumentParser) -> None:
    from bumblebee.plan.cli import add_arguments

    add_arguments(p)


def plan_run(args) -> int:
    from bumblebee.plan.cli import run

    return run(args)


# ------------------------------------------------------------------------------ convert
def convert_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--to", required=True, choices=["hf"], help="output format: a Hugging Face directory"
    )
    p.add_argument(
        "ckpt_dir",
        metavar="CKPT_DIR",
        help="a checkpoint (out_dir/checkpoints/step_N), or a run directory: its newest complete one",
    )
    p.add_argument("out_dir", metavar="OUT_DIR")
    p.add_argument(
        "--max-shard-bytes",
        type=int,
        default=5 * 2**30,
        metavar="N",
        help="split the safetensors into shards of at most N bytes, with an index (default 5 GiB)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="OUT_DIR holds an earlier export: replace its files (otherwise a non-empty OUT_DIR is refused)",
    )
    p.add_argument(
        "--dtype",
        choices=["bfloat16", "float32"],
        default=None,
        help="dtype of the exported weights (default: bfloat16 for a checkpoint of a train.dtype = "
        "bfloat16 run, float32 otherwise); written one tensor at a time",
    )
    p.add_argument(
        "--source",
        default="",
        metavar="HF_DIR",
        help="the Hugging Face directory the run started from (its model.hf_path): its tensors "
        "outside the language model (vision tower, MTP) and its non-weight files are carried over "
        "(a path inside the checkpoint is never followed)",
    )
    p.add_argument(
        "--tokenizer",
        default="",
        metavar="DIR",
        help="a tokenizer directory to export beside the weights, its token ids in the configs",
    )


def convert_run(args) -> int:
    from bumblebee.errors import ConfigError
    from bumblebee.runtime.checkpoint.export import export_checkpoint

    for flag, where, needs in (
        ("--source", args.source, "config.json"),
        ("--tokenizer", args.tokenizer, "tokenizer.json"),
    ):
        if where and not os.path.isfile(os.path.join(where, needs)):
            raise ConfigError(f"{flag} {where}: no {needs} there")
    path = export_checkpoint(
        args.ckpt_dir,
        args.out_dir,
        args.max_shard_bytes,
        args.overwrite,
        dtype=args.dtype,
        source=args.source,
        tokenizer=args.tokenizer,
    )
    print(f"bumblebee: wrote {args.out_dir} from {path}")
    return 0


# ------------------------------------------------------------------------------ checkpoint
def checkpoint_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    v = sub.add_parser(
        "verify",
        help="check every file of a checkpoint against the checksums in its marker "
        "(no model is built); a run or checkpoints directory: all of its checkpoints",
    )
    v.add_argument("path", metavar="DIR")


def checkpoint_run(args) -> int:
    from bumblebee.runtime.checkpoint.verify import verify_command

    return verify_command(args.path)


# ------------------------------------------------------------------------------ rl
def rl_args(p: argparse.ArgumentParser) -> None:
    from bumblebee.rl.cli import add_arguments

    add_arguments(p)


def rl_run(args) -> int:
    from bumblebee.rl.cli import run

    return run(args)


# ------------------------------------------------------------------------------ data, report
def data_args(p: argparse.ArgumentParser) -> None:
    from bumblebee.data.cli import add_arguments

    add_arguments(p)


def data_run(args) -> int:
    from bumblebee.data.cli import run

    if args.data_command != "prepare":
        return run(args)
    # one writer per output directory, as a training run holds its out_dir: two prepares into one
    # OUT would leave a corpus equal to neither
    import bumblebee.outputs as outputs
    from bumblebee import safe_write
    from bumblebee.runtime.launch.outdir import OutDirLock

    outputs.check_target(args.out, "data prepare OUT", kind="dir", inputs=[args.input])
    created = not os.path.isdir(args.out)
    done = False
    safe_write.make_dirs(args.out)
    try:  # on a full disk the writer has removed its files; the guard's line says so
        with outputs.writing(args.out, "write the prepared data"):
            with OutDirLock(args.out, what="data prepare OUT"):
                code = run(args)
        done = True
        return code
    finally:  # a failed or interrupted prepare leaves no directory it created behind
        if created and not done:
            from bumblebee.data.prepare import no_interrupts

            with no_interrupts():  # everything in it is this run's (it held the lock)
                shutil.rmtree(args.out, ignore_errors=True)


def report_args(p: argparse.ArgumentParser) -> None:
    from bumblebee.report import add_arguments

    add_arguments(p)


def report_run(args) -> int:
    from bumblebee.report import run

    return run(args)
