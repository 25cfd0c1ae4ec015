"""Per-rank failure logs: ``out_dir/logs/rank<N>.log`` holds each rank's full traceback.

The launcher prints one line per failure (failures.py names the rank that failed first);
the traceback behind that line would otherwise be lost with the rank's process, and a
multi-rank failure could not be reported. Each rank therefore appends, to its own file,
a header (attempt, time, pid) and the Python traceback of the exception that ended it;
``faulthandler`` writes into the same file, so a segfault or an abort in a kernel still
leaves the rank's stacks behind. Neither ``logs/`` nor the file is followed when it is a link
(planted in a shared out_dir): the rank then keeps no log, and says so.
A log that cannot be written never hides the failure it was meant to record.
"""

from __future__ import annotations

import errno
import faulthandler
import os
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager

from bumblebee import safe_write
from bumblebee.errors import ConfigError

LOGS = "logs"
# lines of the traceback kept in the failure report, printed when no log file could be written
TAIL_LINES = 12
_HEADER = "--- rank "


def log_path(log_dir: str, rank: int) -> str:
    return os.path.join(log_dir, f"rank{rank}.log")


def recorded_failure(log_dir: str | None, rank: int) -> str | None:
    """``rank``'s log file when its latest start recorded something (a traceback, a fatal
    signal's stacks); None for a rank that left only its start header (killed, hung)."""
    if not log_dir:
        return None
    path = log_path(log_dir, rank)
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - (1 << 16)))
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    last = text.rfind(_HEADER)
    rest = text[last:].split("\n", 1)[1] if last >= 0 and "\n" in text[last:] else ""
    return path if rest.strip() else None


def _open_append(path: str):
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
    return os.fdopen(os.open(path, flags, 0o644), "a", buffering=1)


def tail(exc: BaseException, lines: int = TAIL_LINES) -> list[str]:
    """The last ``lines`` lines of ``exc``'s formatted traceback."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return text.rstrip("\n").splitlines()[-lines:]


@contextmanager
def rank_log(log_dir: str | None, rank: int, attempt: int = 0) -> Iterator[str | None]:
    """Record the block's exception (re-raised unchanged) and any fatal signal of this rank in
    ``log_dir/rank<rank>.log``; yields the file's path, or None when there is no log to write."""
    f = None
    if log_dir:
        try:  # neither logs/ nor the file is followed when a link (a link planted there)
            safe_write.make_dirs(log_dir, root=os.path.dirname(os.path.abspath(log_dir)))
            f = _open_append(log_path(log_dir, rank))
            f.write(
                f"{_HEADER}{rank} attempt {attempt} pid {os.getpid()} "
                f"started {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
            )
            faulthandler.enable(file=f, all_threads=True)
        except (OSError, ConfigError) as e:
            if f is not None:  # e.g. a full disk at the header: the file goes quietly
                try:
                    f.close()
                except OSError:
                    pass
            f = None
            if isinstance(e, ConfigError) or getattr(e, "errno", None) == errno.ELOOP:
                print(f"bumblebee: note: rank {rank} keeps no log: {e}", file=sys.stderr)
    try:
        yield None if f is None else log_path(log_dir, rank)
    except BaseException as e:
        if f is not None:
            try:
                f.write(f"--- failed {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
                traceback.print_exception(type(e), e, e.__traceback__, file=f)
            except OSError:
                pass
        raise
    finally:
        if f is not None:
            faulthandler.disable()
            f.close()
