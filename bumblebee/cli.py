"""The ``bumblebee`` command: one subcommand per job.

Every subcommand takes ``--help``; bad input (a config error, malformed data, a
missing file) prints one line ``bumblebee: error: ...`` and exits with code 2,
without a traceback. Subcommands register in ``SUBCOMMANDS`` as
(help, add_arguments, run) triples; ``run(args)`` returns the exit code.
"""

from __future__ import annotations

import argparse
import os
import sys

from bumblebee import commands

SUBCOMMANDS = {
    "train": (
        "train a model (no arguments: the embedded default run on CPU)",
        commands.train_args,
        commands.train_run,
    ),
    "primitives": (
        "list every primitive slot and its implementations",
        commands.primitives_args,
        commands.primitives_run,
    ),
    "convert": (
        "export a training checkpoint (--to hf: a Hugging Face directory)",
        commands.convert_args,
        commands.convert_run,
    ),
    "checkpoint": (
        "checkpoint tools (verify: checksums of every file, without loading)",
        commands.checkpoint_args,
        commands.checkpoint_run,
    ),
    "plan": (
        "plan a layout: per-GPU memory, predicted throughput, the default recipe (no GPU)",
        commands.plan_args,
        commands.plan_run,
    ),
    "rl": (
        "warm-up + GRPO on a built-in verifiable task (no arguments: a tiny model on CPU)",
        commands.rl_args,
        commands.rl_run,
    ),
    "pair": (
        "run two implementations of one primitive slot side by side and compare them step by step",
        commands.pair_args,
        commands.pair_run,
    ),
    "data": (
        "prepare (tokenize into memory-mapped tokens) or inspect training data",
        commands.data_args,
        commands.data_run,
    ),
    "report": (
        "draw the curves of training or RL runs (overlaid, with their difference to the first) into a PNG",
        commands.report_args,
        commands.report_run,
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
    is final once decided, so a late Ctrl-C or SIGTERM is ignored rather than turned into a
    traceback from the interpreter's shutdown or a death by signal after the work is done.
    Ctrl-C exits 130 and SIGTERM (outside a training loop, where it means preemption) 143, in
    whatever phase they land: the command's cleanup has run."""
    import signal

    from bumblebee.runtime.launch.interrupts import (
        Terminated,
        defer_during_imports,
        exit_code_of,
        reported,
    )

    program = argv is None
    try:
        if program:
            defer_during_imports()
        code = _main(argv)
    except (KeyboardInterrupt, Terminated) as e:  # anywhere, imports included
        if program:
            reported()
        if isinstance(e, Terminated):
            print(f"bumblebee: {e}", file=sys.stderr)
        else:
            print("bumblebee: interrupted", file=sys.stderr)
        return exit_code_of(e)
    if program:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_IGN)
    return code


def use_run_allocator() -> str:
    """The CUDA allocator setting every run uses (a user's own setting wins); returns it. CUDA's
    caching allocator then grows segments in place instead of keeping one per size class: less
    fragmentation at long context. Read when CUDA first allocates, so set before any command runs
    (and inherited by the ranks --nproc starts)."""
    return os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


def _main(argv: list[str] | None) -> int:
    use_run_allocator()
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
