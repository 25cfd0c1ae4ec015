"""A lock that dies with its holder: ``fcntl.flock`` on a small hidden file.

Where two writers must not interleave (two saves into one ``checkpoints`` directory, two
converts into one target, two runs deciding whether an ``out_dir`` lock is stale), a lock file
that holds a pid goes stale when its holder is killed and has to be judged. An ``flock`` is
released by the kernel when the holder's process dies, SIGKILL included, so it is never stale.
The file is removed on release; a waiter that locked a file removed meanwhile sees that its
inode is no longer the one at the path and takes the new one. On a filesystem that refuses
``flock`` (some network filesystems) the lock degrades to none: the callers' other checks (the
out_dir lock, atomic renames) still hold there.
"""

from __future__ import annotations

import errno
import os

from bumblebee.runtime.launch.interrupts import signals_held

try:
    import fcntl
except ImportError:  # not POSIX: no advisory locks
    fcntl = None

_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.EBADF}


class ProcessLock:
    """``ProcessLock(path).acquire(wait=True)`` ... ``release()``; or ``with ProcessLock(path):``
    (waits)."""

    def __init__(self, path: str):
        self.path = path
        self._fd: int | None = None
        self.held = False

    def acquire(self, wait: bool = True) -> bool:
        """Take the lock (``wait``: until it is free); False if another process holds it and
        ``wait`` is False."""
        if fcntl is None:
            self.held = True
            return True
        while True:
            fd = os.open(
                self.path,
                os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0),
                0o644,
            )
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                os.close(fd)
                return False
            except OSError as e:
                os.close(fd)
                if e.errno not in _UNSUPPORTED:
                    raise
                self.held = True  # no advisory locks here: go on without
                return True
            except BaseException:  # an interrupt while waiting
                os.close(fd)
                raise
            try:
                same = os.stat(self.path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                self._fd, self.held = fd, True
                return True
            os.close(fd)  # the holder we waited for removed this file: lock the current one

    def release(self) -> None:
        if self._fd is not None:
            with signals_held():  # a Ctrl-C here must not leave the file behind
                try:
                    os.unlink(self.path)  # while still held: nobody can have locked it since
                except FileNotFoundError:
                    pass
                os.close(self._fd)
        self._fd, self.held = None, False

    def __enter__(self) -> ProcessLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
