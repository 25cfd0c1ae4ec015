"""Preemption signals: SIGTERM / SIGUSR1 ask a run to stop at the next step boundary.

A scheduler that preempts a job sends SIGTERM (SLURM can be told to send SIGUSR1
ahead of time) and kills the job some seconds later. ``Preemption`` is a context
manager the training loop runs under: the first such signal only records its
number; the loop finishes the step in flight, all ranks agree on stopping (a
one-element MAX all-reduce per step, so ranks that received the signal a step apart
still stop at the same step), save a checkpoint and exit. The handler then restores
the default disposition, so a second signal ends the process at once, even inside
a collective. Handlers can only be installed from the main thread; elsewhere the
context manager does nothing. Ctrl-C (SIGINT) is not handled here: the CLI turns it
into exit 130.
"""

from __future__ import annotations

import signal
import threading

import torch
import torch.distributed as dist

PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(Exception):
    """Raised by the training loop after it saved on a preemption signal."""

    def __init__(self, step: int, path: str, signum: int, finished: bool = False):
        self.step, self.path, self.signum = step, path, signum
        if finished:  # the signal came during the final save or export, which completed
            saved = f"saved {path}; training is complete" if path else "training is complete"
        elif path:
            saved = f"saved {path}; resume with --resume auto"
        else:
            saved = "nothing saved (train.out_dir not writable?)"
        super().__init__(f"preempted at step {step} ({signal.Signals(signum).name}); {saved}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class Preemption:
    """``with Preemption() as p:`` ... ``p.requested(group)`` after each step."""

    def __init__(self):
        self.signum = 0
        self._previous: dict[int, object] = {}

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():
            for s in PREEMPT_SIGNALS:
                self._previous[s] = signal.signal(s, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

    def _on_signal(self, signum, frame) -> None:
        self.signum = signum
        for s in PREEMPT_SIGNALS:  # a second signal: the default action (terminate now)
            signal.signal(s, signal.SIG_DFL)

    def requested(self, group=None, device: torch.device | None = None) -> int:
        """The signal number if any rank of ``group`` received one (collective when
        ``group`` is given), else 0."""
        if group is None:
            return self.signum
        flag = torch.tensor([self.signum], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return int(flag.item())
