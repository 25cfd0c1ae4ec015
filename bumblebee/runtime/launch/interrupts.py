"""Ctrl-C (SIGINT): stop the run once, cleanly.

SIGINT raises ``KeyboardInterrupt`` as Python does by default; once the run has
stopped on it, any later one while the process shuts down (a second Ctrl-C, or the
launcher forwarding the signal to its ranks) is ignored, so that a clean stop never turns into a traceback
from an atexit or finalizer callback. Saves are crash-safe (written to a hidden
temporary directory, published by a rename), so an interrupted save leaves nothing
half-written where a resume or convert would look. SIGTERM (preemption) is handled
elsewhere; this module only covers SIGINT.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from contextlib import contextmanager


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


_PENDING = threading.Event()  # a Ctrl-C the program has not reported yet


def defer_during_imports() -> None:
    """For the program's whole life (``bumblebee ...``, not an in-process caller): Ctrl-C while a
    module is being imported is raised once the import has finished, and an interrupt that was
    swallowed is raised again until the program reports it (``reported``). A KeyboardInterrupt
    inside numpy's or torch's import leaves them half-initialized (the next import fails with an
    ImportError), and one that lands in a callback Python runs for itself (logging's at-fork
    hook while an import forks a helper) is printed as "Exception ignored" and lost: the
    command ran to the end and exited 0."""

    def again():  # while unreported, signal again whenever this handler is the one installed
        while _PENDING.is_set():
            time.sleep(0.2)
            if _PENDING.is_set() and signal.getsignal(signal.SIGINT) is handler:
                os.kill(os.getpid(), signal.SIGINT)  # the process: this thread may block SIGINT

    def handler(signum, frame):
        if not _PENDING.is_set():
            _PENDING.set()
            threading.Thread(target=again, daemon=True).start()
        if not _importing(frame):
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, handler)


def reported() -> None:
    """The interrupt has been reported (``bumblebee: interrupted``): no more retries."""
    _PENDING.clear()
