"""A run's output directory: checked up front, and locked for the run's lifetime.

``check_out_dir`` runs before any model is built (in the launching process): the
path must not be a file, must fit the filesystem's name limits, and the directory
(and ``checkpoints/`` when the run saves) must be creatable and writable, so a bad
``train.out_dir`` fails in milliseconds instead of after the first step.

``OutDirLock`` keeps two runs from sharing one ``out_dir`` (and two ``data prepare`` one OUT) (interleaved
``metrics.jsonl``, one run's config beside the other's checkpoints): a lock file
``out_dir/bumblebee.lock`` holding the owner's host, pid and process start time,
created atomically (``O_EXCL``). A lock whose owner is gone (same host, pid not
running, or running but started at another time: a reused pid) is stale and taken
over with a notice; a live owner's lock is refused with one line. The ranks a
launcher started (children of the lock's owner) run under their parent's lock. A lock
taken by an earlier attempt of the same torchrun job (same rendezvous id) is taken
over: a restart may put rank 0 on another host, where the old owner cannot be checked.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
import socket
import sys
import time
from contextlib import contextmanager

import bumblebee.outputs as outputs
from bumblebee import safe_write
from bumblebee.config import ConfigError
from bumblebee.runtime.checkpoint.record import PREVIOUS, RECORD

LOCK_NAME = "bumblebee.lock"


def check_out_dir(out_dir: str, *, checkpoints: bool, inputs=()) -> None:
    """Everything about ``out_dir`` that can fail later, checked now (creates it); ``inputs``:
    what the run reads (data, model)."""
    if not out_dir.strip():
        raise ConfigError("train.out_dir is empty; give the directory the run writes to")
    outputs.check_target(out_dir, "train.out_dir", kind="dir", inputs=inputs)
    path = os.path.abspath(out_dir)
    name_max = _limit("PC_NAME_MAX", 255)
    long = [part for part in path.split(os.sep) if len(part.encode()) > name_max]
    if long or len(path.encode()) >= _limit("PC_PATH_MAX", 4096):
        what = (
            f"component {long[0][:40]!r}... longer than {name_max} bytes"
            if long
            else "path too long"
        )
        raise ConfigError(f"train.out_dir: {what}")
    # what a run writes in out_dir: a link planted for any of them is refused before the run
    safe_write.refuse_links(*(os.path.join(path, n) for n in RECORD + (PREVIOUS, LOCK_NAME)))
    dirs = [path] + ([os.path.join(path, "checkpoints")] if checkpoints else [])
    for d in dirs:
        if os.path.exists(d) and not os.path.isdir(d):
            raise ConfigError(f"train.out_dir: {d} exists and is not a directory")
        try:
            safe_write.make_dirs(d, root=path if d != path else None)
            probe = os.path.join(d, f".write-test-{os.getpid()}-{secrets.token_hex(4)}")
            try:
                with open(probe, "x") as f:  # O_EXCL: never a planted file or link written through
                    f.write("ok")
            finally:
                if os.path.lexists(probe):
                    os.remove(probe)
        except OSError as e:
            raise ConfigError(f"train.out_dir: cannot write to {d} ({e.strerror or e})") from None


def _limit(name: str, default: int) -> int:
    try:
        return os.pathconf("/", name)
    except (OSError, ValueError):
        return default


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), to tell a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid, started: str | None) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, another user's
    now = _start_time(pid)
    return started is None or now is None or now == started


def _elastic_job() -> str | None:
    """The torchrun job (rendezvous run id) this process belongs to; None outside torchrun. Every
    attempt of a job has the same id, whichever host its rank 0 lands on."""
    return os.environ.get("TORCHELASTIC_RUN_ID") or None


class OutDirLock:
    """``with OutDirLock(out_dir):`` holds the lock file for the block (see the module doc)."""

    def __init__(self, out_dir: str, *, stream=None, what: str = "train.out_dir"):
        self.path = os.path.join(out_dir, LOCK_NAME)
        self.what = what  # how the user named the directory, for the messages
        self.stream, self.owned = stream or sys.stderr, False

    def __enter__(self) -> OutDirLock:
        me = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": _start_time(os.getpid()),
            "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "job": _elastic_job(),
        }
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._read()
                if holder is None:
                    continue  # vanished or being written: look again
                if holder.get("host") == me["host"] and holder.get("pid") == os.getppid():
                    return self  # a rank started by the launcher that holds the lock
                if holder.get("host") == me["host"] and holder.get("pid") == me["pid"]:
                    return self
                if me["job"] and holder.get("job") == me["job"]:
                    # the same torchrun job, restarted by its agents: its rank 0 may be on another host
                    self.stream.write(
                        f"bumblebee: note: taking over {self.path} from an earlier attempt of job "
                        f"{me['job']} (pid {holder.get('pid')} on {holder.get('host')})\n"
                    )
                    try:
                        os.remove(self.path)
                    except FileNotFoundError:
                        pass
                    continue
                if holder.get("host") != me["host"] or _alive(
                    holder.get("pid", -1), holder.get("started")
                ):
                    raise ConfigError(
                        f"{self.what} {os.path.dirname(self.path) or '.'} is in use by another run "
                        f"(pid {holder.get('pid')} on {holder.get('host')} since "
                        f"{holder.get('since')}); use another directory, or delete {self.path} if "
                        "that run is gone"
                    ) from None
                self.stream.write(
                    f"bumblebee: note: taking over a stale lock {self.path} (pid {holder.get('pid')} "
                    "is not running)\n"
                )
                try:
                    os.remove(self.path)
                except FileNotFoundError:
                    pass
                continue
            except OSError as e:
                raise ConfigError(
                    f"{self.what}: cannot create {self.path} ({e.strerror or e})"
                ) from None
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self.owned = True
            return self
        raise ConfigError(
            f"{self.what}: could not take the lock {self.path} (another run keeps taking it)"
        )

    def _read(self) -> dict | None:
        try:
            with open(self.path) as f:
                holder = json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError):  # torn or foreign: give a writer a moment, then call it stale
            time.sleep(0.2)
            try:
                with open(self.path) as f:
                    holder = json.load(f)
            except FileNotFoundError:
                return None
            except (OSError, ValueError):
                return {"host": socket.gethostname(), "pid": -1}
        return (
            holder
            if isinstance(holder, dict) and isinstance(holder.get("pid"), int)
            else {"host": socket.gethostname(), "pid": -1}
        )

    def __exit__(self, *exc) -> None:
        if self.owned:
            self.owned = False
            try:
                os.remove(self.path)
            except OSError as e:
                if e.errno != errno.ENOENT:
                    raise


@contextmanager
def distributed_lock(out_dir: str, check):
    """Under ``torchrun``: every rank runs ``check()`` (preflight: the same inputs give the same
    verdict, and no rank waits out a collective timeout while rank 0 reads a large data file
    alone; a file missing on one node is found there), rank 0 takes the lock; every rank raises
    the same one-line ``ConfigError`` if any of that failed, and none starts the run."""
    import torch.distributed as dist

    lock, error, rank = OutDirLock(out_dir), None, dist.get_rank()
    try:
        check()
        if rank == 0:
            lock.__enter__()
    except ConfigError as e:
        error = str(e)
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        lock.__exit__(None, None, None)
        r, e = failed[0]
        raise ConfigError(e if r == 0 else f"{e} (on rank {r})")
    try:
        yield lock
    finally:
        lock.__exit__(None, None, None)


def remove_partial_saves(out_dir: str) -> None:
    """Remove ``checkpoints/.tmp-*`` (saves that never got published). Only for a caller that
    knows no rank is still writing: the launcher, after every rank has stopped (a Ctrl-C can
    reach rank 0's cleanup before another rank's last write lands in the directory)."""
    root = os.path.join(out_dir, "checkpoints")
    for name in os.listdir(root) if os.path.isdir(root) else []:
        if name.startswith(".tmp-"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
