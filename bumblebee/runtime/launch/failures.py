"""Which rank failed first: per-rank failure reports and the one-line diagnosis.

When one rank of a job raises, the others soon fail too: a peer's socket closes
under a collective ("Connection closed by peer") or the collective times out.
Which of these the elastic agent notices first is a race (it polls the ranks, and
torch's spawn join reports the first dead process it happens to look at), so the
launcher does not trust that order. Instead every rank, at the moment its worker
raises, writes a small JSON report (rank, ``time.time_ns()``, the exception's
first line, whether it looks like a *consequence* of another rank's failure) into
a directory the launcher owns. The report is written before this rank's process
group is torn down, so a root cause is always timestamped before the peer-loss
errors it causes.

``diagnose`` then names the root cause: the earliest report that is not a
consequence; failing that (a rank killed by a signal or hung leaves no report), the
ranks that never reported, with the consequence seen on the others.
"""

from __future__ import annotations

import json
import os
import signal
import time

from bumblebee import safe_write
from bumblebee.errors import ConfigError
from bumblebee.runtime.launch.rank_logs import recorded_failure, tail

# substrings of errors that a rank sees because *another* rank died or stalled
_PEER_LOSS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "connection refused",
    "socket closed",
    "econnreset",
    "epipe",
    "remote process exited",
    "read error",
    "write error",
    "process group watchdog",
    "recvbytes",
    "sendbytes",
)
_TIMEOUT = ("timed out", "timeout", "deadline exceeded")


def _first_line(text: str, limit: int = 300) -> str:
    lines = [x.strip() for x in str(text).splitlines() if x.strip()]
    line = lines[0] if lines else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def classify(exc: BaseException) -> str:
    """``"timeout"`` (waited for a peer too long), ``"peer"`` (a peer went away) or
    ``"error"`` (this rank's own failure)."""
    text = f"{type(exc).__name__}: {exc}".lower()
    if isinstance(exc, (RuntimeError, OSError, ConnectionError)) or "distbackenderror" in text:
        if any(s in text for s in _TIMEOUT) and not isinstance(exc, ConnectionError):
            return "timeout"
        if any(s in text for s in _PEER_LOSS):
            return "peer"
    return "error"


def write_report(
    report_dir: str, attempt: int, rank: int, exc: BaseException, log: str | None = None
) -> str:
    """Record this rank's failure (called from the worker's ``except``, before teardown);
    returns its kind. ``log``: the rank's full-traceback file, when one is written; without
    one the report keeps the traceback's last lines for the launcher to print."""
    report = {
        "rank": rank,
        "attempt": attempt,
        "time_ns": time.time_ns(),
        "kind": classify(exc),
        "error": f"{type(exc).__name__}: {_first_line(str(exc)) or 'no message'}",
        "log": log,
        "tail": [] if log else tail(exc),
    }
    try:
        safe_write.write_file(
            os.path.join(report_dir, f"a{attempt}_r{rank}.json"), json.dumps(report), durable=False
        )
    except ConfigError:  # e.g. a full disk: the diagnosis goes without it, the cause stays raised
        pass
    return report["kind"]


def read_reports(report_dir: str, attempt: int) -> dict[int, dict]:
    """The reports of one attempt (restart round), by rank."""
    out = {}
    prefix = f"a{attempt}_r"
    for name in os.listdir(report_dir) if os.path.isdir(report_dir) else []:
        if name.startswith(prefix) and name.endswith(".json"):
            with open(os.path.join(report_dir, name)) as f:
                r = json.load(f)
            out[int(r["rank"])] = r
    return out


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def _others(n: int) -> str:
    return f"{n} other rank{'' if n == 1 else 's'} stopped after it" if n else "no other rank"


def _exit_text(exitcode: int | None) -> str:
    if exitcode is None:
        return "no Python error"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit {exitcode}"


def first_failure(failures: dict) -> tuple[int, object]:
    """(rank, failure) of the rank that stopped by itself first among torch elastic's failures: a rank
    the agent killed while tearing the job down (a signal) is a consequence; ties by lowest rank."""

    def key(item):
        rank, f = item
        return (f.exitcode is None or f.exitcode < 0, f.timestamp, rank)

    return min(failures.items(), key=key)


def diagnose(
    reports: dict[int, dict],
    world: int,
    seen: tuple[int, int | None] | None = None,
    log_dir: str | None = None,
) -> str:
    """One line naming the root cause among ``world`` ranks. ``seen`` is the (rank,
    exit code) the elastic agent reported, used for a rank that left no report; ``log_dir``:
    where the ranks' full tracebacks are (rank_logs.py), named for the rank that failed first."""
    rank, line = _diagnose(reports, world, seen)
    if rank is not None and (path := recorded_failure(log_dir, rank)):
        line += f"; full traceback in {path}"
    return line


def failing_tail(reports: dict[int, dict], world: int, seen=None) -> list[str]:
    """The traceback's last lines of the rank ``diagnose`` names, when it wrote no log file."""
    rank, _ = _diagnose(reports, world, seen)
    report = reports.get(rank) if rank is not None else None
    return list(report.get("tail") or []) if report else []


def _diagnose(
    reports: dict[int, dict], world: int, seen: tuple[int, int | None] | None
) -> tuple[int | None, str]:
    """(the rank that failed first or None, the line)."""
    roots = sorted(
        (r for r in reports.values() if r["kind"] == "error"), key=lambda r: r["time_ns"]
    )
    if roots:
        first = roots[0]
        line = f"rank {first['rank']} failed first (exit 1): {first['error']}; {_others(world - 1)}"
        return first["rank"], line
    silent = [r for r in range(world) if r not in reports]
    waited = sorted(reports.values(), key=lambda r: r["time_ns"])
    seen_text = ""
    if seen is not None and seen[0] in silent:
        seen_text = f" ({_exit_text(seen[1])})"
    if silent and any(r["kind"] == "timeout" for r in waited):
        t = next(r for r in waited if r["kind"] == "timeout")
        return silent[0] if len(silent) == 1 else None, (
            f"{_ranks(silent)} did not arrive at a collective within train.collective_timeout_s "
            f"(hung or stuck): rank {t['rank']} gave up waiting: {t['error']}"
        )
    if silent:
        if seen is not None and seen[0] in silent:
            # the rank the agent saw stop first; the other silent ranks were stopped by the agent's
            # teardown before they noticed the loss (no report: they never raised)
            silent = [seen[0]]
        what = (
            seen_text.strip(" ()")
            if seen_text
            else "no Python error: killed by a signal or crashed"
        )
        line = f"{_ranks(silent)} failed first ({what})"
        if waited:
            line += f"; rank {waited[0]['rank']} then saw: {waited[0]['error']}"
        return silent[0] if len(silent) == 1 else None, line
    if waited:
        first = waited[0]
        line = f"rank {first['rank']} failed first (exit 1): {first['error']}; {_others(world - 1)}"
        return first["rank"], line
    return None, "the job failed without a report from any rank"
