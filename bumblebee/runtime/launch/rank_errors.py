"""What the launching process prints when local ranks fail or are interrupted.

``launch.launch_local`` runs the ranks under torch.distributed.elastic, whose agent
logs every failure as a multi-line traceback. ``quiet_elastic`` silences those
logs for the launch (the launcher prints its own summary), ``config_error`` turns a
rank's bad-input failure (the ``ConfigError`` family: bad data, a checkpoint that
does not fit, ...) into the one line ``bumblebee: error: ...`` that a single-process
run prints (exit code 2), and ``interrupted`` tells a Ctrl-C of the launch (which
elastic reports as ``SignalException``) so the CLI exits 130 with one line.
"""

from __future__ import annotations

import logging
import signal
from contextlib import contextmanager

from bumblebee.config import ConfigError

_LOGGERS = ("torch.distributed.elastic", "torch.multiprocessing", "torch.distributed.launcher")


@contextmanager
def quiet_elastic():
    """Only critical records from torch's elastic machinery during the block."""
    names = [
        n for n in list(logging.root.manager.loggerDict) if n.startswith(_LOGGERS)
    ]  # torch sets levels per module
    loggers = [logging.getLogger(name) for name in sorted(set(names) | set(_LOGGERS))]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _family() -> set[str]:
    """Class names of ``ConfigError`` and its subclasses (imported so that they register)."""
    import bumblebee.data.jsonl  # noqa: F401  DataError
    import bumblebee.models.hf  # noqa: F401  CheckpointError

    names, todo = set(), [ConfigError]
    while todo:
        cls = todo.pop()
        names.add(cls.__name__)
        todo += cls.__subclasses__()
    return names


def config_error(failures: dict) -> str | None:
    """The message of the lowest rank whose failure is a ``ConfigError``-family exception
    (``failures``: rank -> elastic ``ProcessFailure``), or None."""
    family = _family()
    for _, failure in sorted(failures.items()):
        message = failure.message
        if isinstance(message, dict):
            message = message.get("message", "")
        kind, sep, text = str(message).strip().partition(": ")
        if sep and kind.rsplit(".", 1)[-1] in family:
            return text.splitlines()[0] if text else kind
    return None


def interrupted(exc: BaseException) -> bool:
    """True if ``exc`` is elastic's report of a SIGINT (Ctrl-C) delivered to the launcher."""
    return getattr(exc, "sigval", None) == signal.SIGINT
