"""Stopping an operation at every filesystem step it takes: the fault points of the kill tests.

``run_stopped(fn, at, signum)`` runs ``fn()`` in a forked copy of the test process (everything
imported and built is there already: no interpreter start per point) with the filesystem calls
that change something counted: each ``os`` call that creates, renames or removes an entry
(``rename``, ``replace``, ``unlink``, ``remove``, ``rmdir``, ``mkdir``, ``link``), each file opened
for writing (``open`` / ``io.open`` / ``os.open`` with a write flag), the first write into each
such file, and a write into it from the middle of a ``torch.save`` (its second: torch's zip
writer calls the file back from C++, and an exception raised there after the first write comes
out as ``RuntimeError: ... unexpected pos``, which reads like a full disk). Just before step ``at`` the child sends
itself ``signum``: SIGKILL is a kill at that point (nothing of the process's own cleanup runs),
SIGINT / SIGTERM reach its Python handlers there, as a Ctrl-C or a scheduler's signal would.
``at = 0`` runs to the end and returns the list of steps, which names the points.
"""

from __future__ import annotations

import builtins
import io
import json
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field

_MUTATIONS = ("rename", "replace", "unlink", "remove", "rmdir", "mkdir", "link")
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


@dataclass
class Outcome:
    signal: int | None  # what ended the child (None: it exited)
    code: int | None  # its exit code (None: killed by a signal)
    steps: list[str] = field(default_factory=list)  # with at = 0: every step taken
    error: str = ""  # a traceback the child reported (fn raised)
    stderr: str = ""  # what the child wrote to sys.stderr


def _name(path) -> str:
    if isinstance(path, int):
        return f"fd {path}"
    return os.path.basename(os.fsdecode(path)) or os.fsdecode(path)


class _Counter:
    def __init__(self, at: int, signum: int | None, active: bool):
        self.at, self.signum, self.steps, self.active = at, signum, [], active
        self.in_torch_save = False

    def tick(self, what: str) -> None:
        if not self.active:
            return
        self.steps.append(what)
        if len(self.steps) == self.at:
            os.kill(os.getpid(), self.signum)


class _Written:
    """A file opened for writing whose first ``write`` is a step."""

    def __init__(self, f, counter: _Counter, name: str):
        self._f, self._counter, self._name = f, counter, name
        self._first, self._zip_writes = True, 0

    def write(self, data):
        if self._first:
            self._first = False
            self._counter.tick(f"first write into {self._name}")
        if self._counter.in_torch_save and self._zip_writes < 2:
            self._zip_writes += 1
            if self._zip_writes == 2:
                self._counter.tick(f"a write of torch's zip writer into {self._name}")
        return self._f.write(data)

    def __enter__(self):
        self._f.__enter__()
        return self

    def __exit__(self, *exc):
        return self._f.__exit__(*exc)

    def __iter__(self):
        return iter(self._f)

    def __getattr__(self, name):
        return getattr(self._f, name)


def _install(counter: _Counter) -> None:
    for name in _MUTATIONS:
        real = getattr(os, name)

        def counted(*args, _real=real, _op=name, **kwargs):
            counter.tick(f"{_op} {_name(args[0])}")
            return _real(*args, **kwargs)

        setattr(os, name, counted)
    real_os_open = os.open

    def os_open(path, flags, *args, **kwargs):
        if flags & _WRITE_FLAGS:
            counter.tick(f"os.open {_name(path)}")
        return real_os_open(path, flags, *args, **kwargs)

    os.open = os_open
    real_open = io.open

    def opened(file, mode="r", *args, **kwargs):
        if not any(c in mode for c in "wax+"):
            return real_open(file, mode, *args, **kwargs)
        counter.tick(f"open {_name(file)}")
        return _Written(real_open(file, mode, *args, **kwargs), counter, _name(file))

    io.open = builtins.open = opened
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        real_save = torch.save

        def save(*args, **kwargs):
            counter.in_torch_save = True
            try:
                return real_save(*args, **kwargs)
            finally:
                counter.in_torch_save = False

        torch.save = save


def _count_within(counter: _Counter, owner, method: str) -> None:
    inner = getattr(owner, method)

    def counted(*args, **kwargs):
        counter.active = True
        try:
            return inner(*args, **kwargs)
        finally:
            counter.active = False

    setattr(owner, method, counted)


def run_stopped(
    fn, at: int = 0, signum: int = signal.SIGKILL, within=None, timeout: float = 120
) -> Outcome:
    """``fn()`` in a forked child stopped by ``signum`` just before its filesystem step ``at``
    (0: never); ``fn`` returns the child's exit code (anything but an int: 0). ``within``:
    (class or module, name): count only the steps taken inside calls of that function."""
    r, w = os.pipe()
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the test
        os.close(r)
        os.close(err_r)
        sys.stderr = os.fdopen(err_w, "w", buffering=1)  # before the counting starts
        counter, code, error = _Counter(at, signum, active=within is None), 0, ""
        try:
            if "torch" in sys.modules:  # the parent's OpenMP workers are not in the child
                sys.modules["torch"].set_num_threads(1)
            _install(counter)
            if within is not None:
                _count_within(counter, *within)
            result = fn()
            code = result if isinstance(result, int) else 0
        except BaseException:  # noqa: BLE001 - reported to the parent
            code, error = 99, traceback.format_exc()
        os.write(w, json.dumps({"steps": counter.steps, "error": error}).encode())
        os._exit(code)
    os.close(w)
    os.close(err_w)
    chunks, errs, deadline = [], [], time.monotonic() + timeout
    for fd in (r, err_r):
        os.set_blocking(fd, False)  # read while waiting: a long report must not block the child
    while True:
        for fd, into in ((r, chunks), (err_r, errs)):
            try:
                while data := os.read(fd, 1 << 16):
                    into.append(data)
            except BlockingIOError:
                pass
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise TimeoutError(f"the child did not end within {timeout} s (stopped at {at})")
        time.sleep(0.01)
    for fd, into in ((r, chunks), (err_r, errs)):
        os.set_blocking(fd, True)
        while data := os.read(fd, 1 << 16):
            into.append(data)
        os.close(fd)
    report = json.loads(b"".join(chunks) or b'{"steps": [], "error": ""}')
    err = b"".join(errs).decode(errors="replace")
    if os.WIFSIGNALED(status):
        return Outcome(os.WTERMSIG(status), None, report["steps"], report["error"], err)
    return Outcome(None, os.WEXITSTATUS(status), report["steps"], report["error"], err)
