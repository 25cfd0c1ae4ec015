"""A run's output directory: checked up front, and locked for the run's lifetime.

``check_out_dir`` runs before any model is built (in the launching process): the
path must not be a file, must fit the filesystem's name limits, and the directory
(and ``checkpoints/`` when the run saves) must be creatable and writable, so a bad
``train.out_dir`` fails in milliseconds instead of after the first step.

``OutDirLock`` keeps two runs from sharing one ``out_dir`` (and two ``data prepare`` one OUT) (interleaved
``metrics.jsonl``, one run's config beside the other's checkpoints): a lock file
``out_dir/bumblebee.lock`` whose first line holds the owner's host, pid and process start
time, created whole and atomically (written to a temporary, then hard-linked into place, which
fails if the lock exists). The ranks a launcher started run under their parent's lock and add a
line each (``join``: pid and start time), so the lock names every process that writes the
directory. A lock none of whose processes is running (same host; a pid not running, a zombie,
or running but started at another time: a reused pid) is stale and taken over with a notice; a
lock with any live process is refused with one line. Deciding that a lock is stale and taking
it over is one step: takers queue on a kernel lock (process_lock.py), so two runs that meet
one stale lock never both take it. A lock taken by an earlier attempt of the same torchrun job
(same rendezvous id) is taken over: a restart may put rank 0 on another host, where the old
owner cannot be checked.

Taking the lock is whole: a Ctrl-C or SIGTERM meanwhile waits for its end and then releases it
(it left the lock, and the lock's temporary, behind). The taker then removes what a killed
run's writes left (``.metrics.jsonl.tmp-...``, ``.config.toml.tmp-...``): nobody else writes
there now.

``LockWatch`` lets a run notice that its lock is gone (its ``out_dir`` was deleted, and
another run may now start there): the run stops with one line instead of writing into a
directory that is no longer its own. Releasing removes the lock only while it is still this
run's.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import sys
import time
from contextlib import contextmanager

import bumblebee.outputs as outputs
from bumblebee import safe_write
from bumblebee.config import ConfigError
from bumblebee.runtime.checkpoint.record import FILES, PREVIOUS, RECORD
from bumblebee.runtime.launch.interrupts import signals_held
from bumblebee.runtime.process_lock import ProcessLock

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
            outputs.probe_write(d)  # leaves no name behind, even if killed
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


def _zombie(pid: int) -> bool:
    """Dead but not reaped (an orphan whose new parent does not reap it): ``kill(pid, 0)``
    still succeeds."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def _alive(pid, started: str | None) -> bool:
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, another user's
    except OverflowError:  # not a pid this system has
        return False
    if _zombie(pid):
        return False
    now = _start_time(pid)
    return started is None or now is None or now == started


def _me() -> dict:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": _start_time(os.getpid()),
    }


def read_lock(path: str) -> dict | None:
    """The lock at ``path``: its owner's record (its first line) with ``members``, the records
    the owner's ranks added (lines after the first); None if there is no lock. A lock that does
    not parse (foreign, or torn by a crash of an older bumblebee) has pid -1: stale."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
    try:  # a link, a fifo or a device planted there is never followed, waited on or read
        fd = os.open(path, flags)
    except FileNotFoundError:
        return None
    except OSError:
        fd = None
    text = ""
    if fd is not None:
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                text = os.read(fd, 1 << 20).decode("utf-8", "replace")
        except OSError:
            pass
        finally:
            os.close(fd)
    lines = [line for line in text.splitlines() if line.strip()]
    holder = None
    for candidate in (lines[0] if lines else "", text):
        try:
            holder = json.loads(candidate)
            break
        except ValueError:
            continue
    if not isinstance(holder, dict) or not isinstance(holder.get("pid"), int):
        return {"host": socket.gethostname(), "pid": -1, "members": []}
    members = []
    for line in lines[1:]:
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a torn last line: its writer is starting (and listed once it is whole)
        if isinstance(rec, dict) and isinstance(rec.get("pid"), int):
            members.append(rec)
    return {**holder, "members": members}


def _same(a: dict, b: dict) -> bool:
    return (a.get("host"), a.get("pid"), a.get("started")) == (
        b.get("host"),
        b.get("pid"),
        b.get("started"),
    )


def join(path: str, rank: int) -> None:
    """A rank started by the lock's owner adds itself to the lock at ``path`` (one appended
    line: the lock stays live while any of the run's processes lives). No lock: nothing to do."""
    line = json.dumps({**_me(), "rank": rank}) + "\n"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return
    try:
        os.write(fd, line.encode())  # one short write with O_APPEND: never torn by another's
    finally:
        os.close(fd)


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
        self.record: dict = {}

    def __enter__(self) -> OutDirLock:
        me = {
            **_me(),
            "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "job": _elastic_job(),
        }
        try:
            # taking the lock is whole: a Ctrl-C / SIGTERM meanwhile waits for its end, and then
            # (the block has not started) releases the lock it took before it stops the run
            with signals_held():
                self._enter(me)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _enter(self, me: dict) -> None:
        try:  # one taker at a time decides (and takes over a stale lock); see the module doc
            guard = ProcessLock(
                f"{os.path.join(os.path.dirname(self.path), '.' + LOCK_NAME)}.guard"
            )
            guard.acquire()
        except OSError as e:
            raise ConfigError(
                f"{self.what}: cannot create {self.path} ({e.strerror or e})"
            ) from None
        try:
            self._take(me)
        finally:
            guard.release()
        if self.owned:  # what a killed run's writes left (nobody else writes here now)
            safe_write.sweep_temporaries(os.path.dirname(self.path) or ".", FILES)

    def _take(self, me: dict) -> OutDirLock:
        folder = os.path.dirname(self.path) or "."
        for name in os.listdir(folder):  # left by a taker killed while creating the lock
            if name.startswith(f".{LOCK_NAME}.") and name.endswith(".tmp"):
                _remove(os.path.join(folder, name))
        for _ in range(3):
            try:
                created = self._create(me)
            except OSError as e:
                raise ConfigError(
                    f"{self.what}: cannot create {self.path} ({e.strerror or e})"
                ) from None
            if created:
                self.owned, self.record = True, me
                return self
            holder = read_lock(self.path)
            if holder is None:
                continue  # released meanwhile: look again
            if holder.get("host") == me["host"] and holder.get("pid") in (os.getppid(), me["pid"]):
                return self  # a rank started by the launcher that holds the lock, or this process
            if me["job"] and holder.get("job") == me["job"]:
                # the same torchrun job, restarted by its agents: its rank 0 may be on another host
                self.stream.write(
                    f"bumblebee: note: taking over {self.path} from an earlier attempt of job "
                    f"{me['job']} (pid {holder.get('pid')} on {holder.get('host')})\n"
                )
                _remove(self.path)
                continue
            live = [
                r["pid"]
                for r in [holder, *holder["members"]]
                if r.get("host", holder.get("host")) == me["host"]
                and _alive(r.get("pid"), r.get("started"))
            ]
            if holder.get("host") != me["host"] or live:
                ranks = [p for p in live if p != holder.get("pid")]
                also = (
                    f"; its launcher is gone but pid {', '.join(map(str, ranks))} still run"
                    if ranks and holder.get("pid") not in live
                    else ""
                )
                raise ConfigError(
                    f"{self.what} {os.path.dirname(self.path) or '.'} is in use by another run "
                    f"(pid {holder.get('pid')} on {holder.get('host')} since "
                    f"{holder.get('since')}{also}); use another directory, or delete {self.path} if "
                    "that run is gone"
                ) from None
            self.stream.write(
                f"bumblebee: note: taking over a stale lock {self.path} (pid {holder.get('pid')} "
                "is not running)\n"
            )
            _remove(self.path)
        raise ConfigError(
            f"{self.what}: could not take the lock {self.path} (another run keeps taking it)"
        )

    def _create(self, me: dict) -> bool:
        """Put a lock holding ``me`` at the path, whole, unless one is there (False)."""
        text = (json.dumps(me) + "\n").encode()
        tmp = f"{os.path.join(os.path.dirname(self.path), '.' + LOCK_NAME)}.{os.getpid()}.tmp"
        flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0)
        _remove(tmp)
        fd = os.open(tmp, flags, 0o644)
        try:
            os.write(fd, text)
        finally:
            os.close(fd)
        try:
            os.link(tmp, self.path)  # fails if a lock exists: never a moment with an empty lock
            return True
        except FileExistsError:
            return False
        except OSError:  # no hard links on this filesystem: create in place
            try:
                fd = os.open(self.path, flags, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "wb") as f:
                f.write(text)
            return True
        finally:
            _remove(tmp)

    def __exit__(self, *exc) -> None:
        if self.owned:
            self.owned = False
            with signals_held():  # a second Ctrl-C / SIGTERM must not leave the lock behind
                holder = read_lock(self.path)
                if holder is not None and _same(holder, self.record):  # not another run's lock
                    _remove(self.path)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
    except IsADirectoryError:
        raise ConfigError(
            f"{path}: is a directory, not bumblebee's lock; remove it, or use another directory"
        ) from None


class OutDirLost(ConfigError):
    """The out_dir lock of a running run is gone or another run's."""


class LockWatch:
    """``LockWatch(out_dir)`` in a run's rank 0: ``check(step)`` raises ``OutDirLost`` once the lock
    that named this process (or its launcher) when the watch started is gone or replaced. With no
    such lock (a Python caller that took none) it never raises."""

    def __init__(self, out_dir: str, what: str = "train.out_dir"):
        self.path, self.what = os.path.join(out_dir, LOCK_NAME), what
        holder, me = read_lock(self.path), _me()
        mine = holder is not None and (
            _same(holder, me)
            or any(_same(m, me) for m in holder["members"])
            or (holder.get("host") == me["host"] and holder.get("pid") == os.getppid())
        )
        self.holder = holder if mine else None

    def check(self, step: int) -> None:
        if self.holder is None:
            return
        now = read_lock(self.path)
        if now is None or not _same(now, self.holder):
            raise OutDirLost(
                f"{self.what} {os.path.dirname(self.path)}: its lock {LOCK_NAME} "
                + (
                    "was removed"
                    if now is None
                    else f"now names another run (pid {now.get('pid')})"
                )
                + f" during this run (the directory deleted?): stopped at step {step} before writing "
                "it, so that two runs never write one directory"
            )


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
    """Tidy ``checkpoints/`` after a launch (saves that never got published, half-deleted
    checkpoints: runtime/checkpoint/publish.py). Only for a caller that knows no rank is still
    writing: the launcher, after every rank has stopped (a Ctrl-C can reach rank 0's cleanup
    before another rank's last write lands in the directory); skipped while another process
    holds the directory's save lock."""
    from bumblebee.runtime.checkpoint.publish import save_lock, sweep

    root = os.path.join(out_dir, "checkpoints")
    if not os.path.isdir(root):
        return
    lock = save_lock(root)
    try:
        if not lock.acquire(wait=False):
            return
    except OSError:
        return
    try:
        sweep(root)
    finally:
        lock.release()
