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

import signal
import threading
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
