"""Ctrl-C (SIGINT) and SIGTERM outside a training loop: stop the command once, cleanly.

SIGINT raises ``KeyboardInterrupt`` as Python does by default; once the run has
stopped on it, any later one while the process shuts down (a second Ctrl-C, or the
launcher forwarding the signal to its ranks) is ignored, so that a clean stop never turns into a traceback
from an atexit or finalizer callback. For the program (``bumblebee ...``) SIGTERM raises
``Terminated`` the same way, so what a command was writing is cleaned up by its ``finally``
blocks (a convert's temporary directory, a prepare's partial output, the out_dir lock) instead
of being left behind by the default disposition; the CLI exits 128 + signal (130 for SIGINT,
143 for SIGTERM) whatever phase the signal lands in. Inside a training loop SIGTERM / SIGUSR1
mean preemption (signals.py: finish the step, save, exit 143). Saves are crash-safe (written
to a hidden temporary directory, published by a rename), so an interrupted save leaves nothing
half-written where a resume or convert would look.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from contextlib import contextmanager

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Terminated(BaseException):
    """SIGTERM reached a command outside a training loop (a ``BaseException``, like
    ``KeyboardInterrupt``: ``except Exception`` does not swallow it)."""

    def __init__(self, signum: int = signal.SIGTERM):
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def stop_signal(exc: BaseException | None) -> BaseException | None:
    """The ``KeyboardInterrupt`` / ``Terminated`` that ``exc`` is or was raised from, if any. torch's
    zip writer turns an interrupt that lands in its write callback into ``RuntimeError('...
    unexpected pos ...')`` (which reads like a full disk), with the interrupt as its context.
    The chain is followed through ``__cause__``, ``cause`` and ``__context__``."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, (KeyboardInterrupt, Terminated)):
            return exc
        seen.add(id(exc))
        # ``cause``: the error a one-line DiskFullError was made from (bumblebee.errors.disk_full)
        exc = exc.__cause__ or getattr(exc, "cause", None) or exc.__context__
    return None


def exit_code_of(exc: BaseException) -> int:
    """128 + the signal of a ``stop_signal`` exception."""
    return exc.exit_code if isinstance(exc, Terminated) else 128 + signal.SIGINT


@contextmanager
def signals_held():
    """SIGINT and SIGTERM are held back within the block and delivered at its end (to the
    handlers in place before it): for a few renames that must happen all or not at all (moving
    an earlier run's record aside, releasing a lock). Python-level: blocking them with a signal
    mask would only hold them off this thread, and any other thread of the process (torch's)
    takes a process-directed signal instead. A no-op off the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = {
        s: signal.signal(s, lambda signum, frame: held.append(signum)) for s in STOP_SIGNALS
    }
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for signum in dict.fromkeys(held):
            signal.raise_signal(signum)


@contextmanager
def interrupt_once(ignore_after: bool = False):
    """Within the block SIGINT raises ``KeyboardInterrupt`` (every time: an interrupt that some
    callback swallowed is not the last word). With ``ignore_after`` (a launched rank, which is
    about to exit), once the block ends by ``KeyboardInterrupt`` SIGINT is ignored for the rest
    of the process; otherwise the previous handler is restored on exit. Outside the main
    thread it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    except KeyboardInterrupt:
        if ignore_after:
            previous = signal.SIG_IGN  # the rank is stopping: no second traceback from its shutdown
        raise
    finally:
        signal.signal(signal.SIGINT, previous)


def _importing(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib._bootstrap"):
            return True
        frame = frame.f_back
    return False


_PENDING: set[int] = set()  # signals (SIGINT, SIGTERM) the program has not reported yet
_GUARD = threading.Lock()


def _raise_for(signum: int) -> None:
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Terminated(signum)


def defer_during_imports() -> None:
    """For the program's whole life (``bumblebee ...``, not an in-process caller): Ctrl-C raises
    ``KeyboardInterrupt`` and SIGTERM ``Terminated``; one that arrives while a module is being
    imported is raised once the import has finished, and one that was swallowed is raised again
    until the program reports it (``reported``). An interrupt inside numpy's or torch's import
    leaves them half-initialized (the next import fails with an ImportError), and one that lands
    in a callback Python runs for itself (logging's at-fork hook while an import forks a helper)
    is printed as "Exception ignored" and lost: the command ran to the end and exited 0."""

    def again():  # while unreported, signal again whenever this handler is the one installed
        while True:
            time.sleep(0.2)
            with _GUARD:
                pending = sorted(_PENDING)
            if not pending:
                return
            for signum in pending:
                if signal.getsignal(signum) is handler:
                    os.kill(os.getpid(), signum)  # the process: this thread may block it

    def handler(signum, frame):
        with _GUARD:
            first = not _PENDING
            _PENDING.add(signum)
        if first:
            threading.Thread(target=again, daemon=True).start()
        if not _importing(frame):
            _raise_for(signum)

    for signum in STOP_SIGNALS:
        signal.signal(signum, handler)


def terminate_raises() -> None:
    """SIGTERM raises ``Terminated`` in this process from now on (a launched rank: outside its
    training loop a forwarded SIGTERM then ends it cleanly instead of by the default action)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda signum, frame: _raise_for(signum))


def reported() -> None:
    """The stop has been reported (``bumblebee: interrupted``): no more retries, and a late
    SIGINT / SIGTERM is ignored (the exit code is decided)."""
    with _GUARD:
        _PENDING.clear()
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
