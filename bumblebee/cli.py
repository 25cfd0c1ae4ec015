"""The ``bumblebee`` command: one subcommand per job.

Every subcommand takes ``--help``; bad input (a config error, malformed data, a
missing file) prints one line ``bumblebee: error: ...`` and exits with code 2,
without a traceback. Subcommands register in ``SUBCOMMANDS`` as
(help, add_arguments, run) triples; ``run(args)`` returns the exit code.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

from bumblebee.console import SetOverride


def _add_config_args(p: argparse.ArgumentParser) -> None:
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
def _train_args(p: argparse.ArgumentParser) -> None:
    _add_config_args(p)
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


def _train_run(args) -> int:
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
            for warning in config_warnings(cfg):
                print(f"bumblebee: warning: {warning}", file=sys.stderr)
        return plan

    try:
        if launch.started_by_torchrun():
            import torch.distributed as dist

            launch.init_distributed(cfg.train.collective_timeout_s)
            with distributed_lock(cfg.train.out_dir, lambda: checks(dist.get_world_size())):
                launch.train_worker(cfg)
            return 0
        plan = checks(args.nproc)  # reject bad input before any process starts
        with OutDirLock(cfg.train.out_dir):  # one run per out_dir, for the run's lifetime
            if args.nproc > 1:
                return launch.launch_local(cfg, args.nproc, max_restarts=cfg.train.max_restarts)
            with interrupt_once():
                Trainer(cfg, plan=plan).run()
    except Preempted as p:
        if os.environ.get("RANK", "0") == "0":  # under torchrun every rank stops; one line
            print(f"bumblebee: {p}", file=sys.stderr)
        return p.exit_code
    return 0


# ------------------------------------------------------------------------------ primitives
def _primitives_args(p: argparse.ArgumentParser) -> None:
    pass


def _primitives_run(args) -> int:
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
def _pair_args(p: argparse.ArgumentParser) -> None:
    from bumblebee.runtime.pair.command import add_arguments

    _add_config_args(p)
    add_arguments(p)


def _pair_run(args) -> int:
    from bumblebee.runtime.pair.command import run

    return run(args)


# ------------------------------------------------------------------------------ plan
def _plan_args(p: argparse.ArgumentParser) -> None:
    from bumblebee.plan.cli import add_arguments

    add_arguments(p)


def _plan_run(args) -> int:
    from bumblebee.plan.cli import run

    return run(args)


# ------------------------------------------------------------------------------ convert
def _convert_args(p: argparse.ArgumentParser) -> None:
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


def _convert_run(args) -> int:
    from bumblebee.runtime.checkpoint.export import export_checkpoint

    path = export_checkpoint(
        args.ckpt_dir, args.out_dir, args.max_shard_bytes, args.overwrite, dtype=args.dtype
    )
    print(f"bumblebee: wrote {args.out_dir} from {path}")
    return 0


# ------------------------------------------------------------------------------ checkpoint
def _checkpoint_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    v = sub.add_parser(
        "verify",
        help="check every file of a checkpoint against the checksums in its marker "
        "(no model is built); a run or checkpoints directory: all of its checkpoints",
    )
    v.add_argument("path", metavar="DIR")


def _checkpoint_run(args) -> int:
    from bumblebee.runtime.checkpoint.verify import verify_command

    return verify_command(args.path)


# ------------------------------------------------------------------------------ rl
def _rl_args(p: argparse.ArgumentParser) -> None:
    from bumblebee.rl.cli import add_arguments

    add_arguments(p)


def _rl_run(args) -> int:
    from bumblebee.rl.cli import run

    return run(args)


# ------------------------------------------------------------------------------ data, report
def _data_args(p: argparse.ArgumentParser) -> None:
    from bumblebee.data.cli import add_arguments

    add_arguments(p)


def _data_run(args) -> int:
    from bumblebee.data.cli import run

    if args.data_command != "prepare":
        return run(args)
    # one writer per output directory, as a training run holds its out_dir: two prepares into one
    # OUT would leave a corpus equal to neither
    import bumblebee.outputs as outputs
    from bumblebee.config import ConfigError
    from bumblebee.runtime.launch.outdir import OutDirLock

    outputs.check_target(args.out, "data prepare OUT", kind="dir", inputs=[args.input])
    created = not os.path.isdir(args.out)
    done = False
    try:
        os.makedirs(args.out, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"data prepare OUT: cannot create {args.out} ({e.strerror or e})"
        ) from None
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


def _report_args(p: argparse.ArgumentParser) -> None:
    from bumblebee.report import add_arguments

    add_arguments(p)


def _report_run(args) -> int:
    from bumblebee.report import run

    return run(args)


SUBCOMMANDS = {
    "train": (
        "train a model (no arguments: the embedded default run on CPU)",
        _train_args,
        _train_run,
    ),
    "primitives": (
        "list every primitive slot and its implementations",
        _primitives_args,
        _primitives_run,
    ),
    "convert": (
        "export a training checkpoint (--to hf: a Hugging Face directory)",
        _convert_args,
        _convert_run,
    ),
    "checkpoint": (
        "checkpoint tools (verify: checksums of every file, without loading)",
        _checkpoint_args,
        _checkpoint_run,
    ),
    "plan": (
        "plan a layout: per-GPU memory, predicted throughput, the default recipe (no GPU)",
        _plan_args,
        _plan_run,
    ),
    "rl": (
        "warm-up + GRPO on a built-in verifiable task (no arguments: a tiny model on CPU)",
        _rl_args,
        _rl_run,
    ),
    "pair": (
        "run two implementations of one primitive slot side by side and compare them step by step",
        _pair_args,
        _pair_run,
    ),
    "data": (
        "prepare (tokenize into memory-mapped tokens) or inspect training data",
        _data_args,
        _data_run,
    ),
    "report": (
        "draw the curves of training or RL runs (overlaid, with their difference to the first) into a PNG",
        _report_args,
        _report_run,
    ),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; with ``only``, the arguments of that subcommand alone (the others are
    listed by name and help): a subcommand's arguments import its module, which may import
    torch, and ``bumblebee --help`` / ``bumblebee train ...`` need no other subcommand's."""
    from bumblebee import __version__

    parser = argparse.ArgumentParser(
        prog="bumblebee", description="Long-context MoE training in pure PyTorch."
    )
    parser.add_argument("--version", action="version", version=f"bumblebee {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_text, add_args, _) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if only is None or name == only:
            add_args(p)
    return parser


def _command(argv: list[str]) -> str | None:
    """The subcommand ``argv`` names (its first word that is not an option), if any."""
    first = next((a for a in argv if not a.startswith("-")), None)
    return first if first in SUBCOMMANDS else None


def main(argv: list[str] | None = None) -> int:
    """The command line; ``argv`` None: the program itself (``bumblebee ...``), whose exit code
    is final once decided, so a late Ctrl-C is ignored rather than turned into a traceback from
    the interpreter's shutdown or a death by SIGINT after the work is done."""
    import signal

    program = argv is None
    try:
        if program:
            from bumblebee.runtime.launch.interrupts import defer_during_imports

            defer_during_imports()
        code = _main(argv)
    except KeyboardInterrupt:  # anywhere, imports included (torch takes seconds to import)
        if program:
            from bumblebee.runtime.launch.interrupts import reported

            signal.signal(signal.SIGINT, signal.SIG_IGN)
            reported()
        print("bumblebee: interrupted", file=sys.stderr)
        return 130
    if program:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    return code


def _main(argv: list[str] | None) -> int:
    # CUDA's caching allocator grows segments in place instead of keeping one per size class: less
    # fragmentation at long context. Read when CUDA first allocates, so set before any command runs
    # (and inherited by the ranks --nproc starts); a user's own setting wins.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    argv = sys.argv[1:] if argv is None else list(argv)
    command = _command(argv)
    parser = build_parser(only=command or "")  # no subcommand: list them, import none
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    # after parsing: --help and --version import nothing of torch (NonFiniteError's module does)
    from bumblebee.config import ConfigError
    from bumblebee.runtime.nonfinite import NonFiniteError

    try:
        return SUBCOMMANDS[args.command][2](args)
    except BrokenPipeError:  # `bumblebee data inspect X | head`: the reader has gone; stop quietly
        _silence_stdout()
        return 141  # 128 + SIGPIPE, what a shell reports for a command its pipe ended
    except ConfigError as e:  # several lines: every config error of the invocation
        for line in str(e).splitlines() or [""]:
            print(f"bumblebee: error: {line}", file=sys.stderr)
        return 2
    except NonFiniteError as e:  # a run stopped on a NaN/Inf step: its checkpoints are intact
        print(f"bumblebee: error: {e}", file=sys.stderr)
        return 1


def _silence_stdout() -> None:
    """Point stdout at /dev/null: the interpreter flushes stdout at exit, and a flush into the
    closed pipe would print 'Exception ignored ... BrokenPipeError' after all."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (
        OSError,
        ValueError,
    ):  # stdout is not a real file (captured): nothing will flush into a pipe
        pass
    finally:
        os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
