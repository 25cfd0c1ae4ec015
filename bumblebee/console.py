"""What a user sees on the terminal besides results: progress of long operations, durations,
and the ``--set`` argument every subcommand shares.

A core module (imports nothing of bumblebee, no torch): the CLI, the planner, the runtime
and the data tools all use it, and ``bumblebee --help`` imports it without torch.

Progress goes to stderr so that stdout stays the result (``plan --json > f``, ``data
inspect | head``). An operation shorter than ``delay`` seconds prints nothing; after that
one line every ``every`` seconds (rewritten in place on a terminal), and a last line with
the total time.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import IO


def hms(seconds: float) -> str:
    """``3725.2`` -> ``"1:02:05"`` (h:mm:ss; hours grow past 24, as an ETA may)."""
    s = max(0, int(round(seconds)))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class SetOverride(argparse.Action):
    """``--set section.key=value`` (repeatable). A value without '=' (``--set train.steps 20``,
    the form other launchers take) is a usage error of the subcommand: its usage line, then
    what was wrong, exit 2 -- not a config error after the run has been set up."""

    def __init__(self, option_strings, dest, **kwargs):
        kwargs.setdefault("default", [])
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, value, option_string=None):
        if "=" not in value:
            parser.error(
                f"{option_string} {value}: expected KEY=VALUE with '=' (e.g. {option_string} "
                f"{value}=...), one {option_string} per value"
            )
        items = getattr(namespace, self.dest, None)
        setattr(
            namespace, self.dest, [*(items or []), value]
        )  # a fresh list: never the shared default


class Progress:
    """``with Progress("plan: layouts", total=n) as p: ... p.update(k)`` -> lines such as
    ``bumblebee: plan: layouts 120/480 (25%), 0:00:12 elapsed, eta 0:00:36``.

    ``total=None`` counts without a percentage. ``clock`` is injectable so tests need no
    sleeping; ``delay=0`` prints from the first update."""

    def __init__(
        self,
        what: str,
        total: int | None = None,
        *,
        stream: IO | None = None,
        delay: float = 2.0,
        every: float = 5.0,
        clock: Callable[[], float] | None = None,
    ):
        self.what, self.total, self.delay, self.every = what, total, delay, every
        self.clock = clock or time.monotonic  # looked up now: tests replace time.monotonic
        self.stream = stream if stream is not None else sys.stderr
        self.tty = getattr(self.stream, "isatty", lambda: False)()
        self.done, self.shown = 0, False
        self.start = self.clock()
        self._last = None  # when the last line was printed

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, kind, *_):
        if self.shown and kind is None:
            total = f" ({self.done}/{self.total})" if self.total else ""
            self._write(f"{self.what}: done{total} in {hms(self.clock() - self.start)}", final=True)
        elif self.shown and self.tty:  # an error follows: leave the last line, start a new one
            self.stream.write("\n")

    def update(self, n: int = 1, note: str = "") -> None:
        self.done += n
        now = self.clock()
        elapsed = now - self.start
        if elapsed < self.delay or (
            self._last is not None and now - self._last < (0.5 if self.tty else self.every)
        ):
            return
        self._last = now
        line = f"{self.what} {self.done}"
        if self.total:
            frac = min(self.done / self.total, 1.0)
            line += f"/{self.total} ({frac:.0%})"
            if 0 < frac < 1:
                line += f", eta {hms(elapsed / frac - elapsed)}"
        line += f", {hms(elapsed)} elapsed" + (f"; {note}" if note else "")
        self._write(line)

    def _write(self, line: str, final: bool = False) -> None:
        self.shown = True
        if self.tty:
            self.stream.write("\r\033[Kbumblebee: " + line + ("\n" if final else ""))
        else:
            self.stream.write("bumblebee: " + line + "\n")
        self.stream.flush()
