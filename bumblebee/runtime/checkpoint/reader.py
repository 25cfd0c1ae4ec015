"""Reading a checkpoint: every name and size inside it is untrusted.

A checkpoint often comes from elsewhere (downloaded, shared, copied from another machine), and
what is inside it names other things: ``complete.json`` names files, their sizes and checksums;
DCP's ``.metadata`` names the file and byte range of every tensor chunk; a run directory lists
``step_<N>`` directories. So a name found inside a checkpoint is taken only as the name of a
regular file directly inside that checkpoint directory:

- a plain name: a string without ``/`` or a control character (NUL included), not ``.`` or
  ``..``, at most ``NAME_MAX`` bytes (so it cannot reach another directory, an absolute path or
  a device such as ``/dev/zero``);
- not a symbolic link (a link could point anywhere), checked with ``lstat`` and again by opening
  with ``O_NOFOLLOW``;
- a regular file: opened with ``O_NONBLOCK`` and checked with ``fstat`` before a byte is read, so
  a fifo, a device or a socket is refused instead of blocking or reading forever;
- of the size the marker claims (checked before reading), read no further than that size.

Every reader of a checkpoint (resume, ``Engine.load``, ``checkpoint verify``, ``convert``) opens its
files here. Only the directory the user named may itself be a link; a directory found inside it
(a run's ``checkpoints/``, a ``step_<N>``) must be a real directory (``subdirectory``).
"""

from __future__ import annotations

import errno
import os
import stat
from typing import BinaryIO

from bumblebee.errors import CheckpointError

NAME_MAX = 255  # bytes: the longest file name POSIX filesystems take
_SHOWN = 80  # characters of an untrusted name quoted in an error


def shown(name: object) -> str:
    """An untrusted name as an error quotes it: ``repr`` (control characters escaped, so a
    name cannot rewrite the terminal), at most ``_SHOWN`` characters."""
    text = repr(name)
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."


def check_name(path: str, name: object, what: str) -> str:
    """``name`` (found in ``what`` of checkpoint ``path``) as the name of a file directly inside
    ``path``; a one-line ``CheckpointError`` for anything else."""
    ok = isinstance(name, str) and name not in ("", ".", "..") and "/" not in name
    ok = ok and not (os.altsep and os.altsep in name)
    # NUL ends a path in the kernel; other control characters would reach the terminal in errors
    ok = ok and not any(ord(c) < 32 or ord(c) == 127 for c in name)
    if ok:
        try:
            ok = len(os.fsencode(name)) <= NAME_MAX
        except UnicodeError:  # a lone surrogate: no file can have that name
            ok = False
    if not ok:
        raise CheckpointError(
            f"{path}: {what} names {shown(name)}, not a file inside the checkpoint (a plain "
            f"file name: no '/' or control character, not '.' or '..', at most {NAME_MAX} bytes)"
        )
    return name


def _kind(mode: int) -> str:
    for test, kind in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a fifo"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return kind
    return "not a regular file"


def _check(path: str, name: str, st: os.stat_result, size: int | None) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(
            f"{path}: {name} is {_kind(st.st_mode)}; a checkpoint holds regular files only "
            "(a link could point outside it, a fifo or a device could block or never end)"
        )
    if size is not None and st.st_size != size:
        raise CheckpointError(
            f"{path}: truncated checkpoint: {name} has {st.st_size} bytes, {size} expected"
        )


def stat_file(path: str, name: object, size: int | None, what: str) -> None:
    """Check, without opening it, that ``name`` (found in ``what``) is a regular file directly in
    checkpoint ``path`` of ``size`` bytes (None: any size)."""
    name = check_name(path, name, what)
    try:
        st = os.lstat(os.path.join(path, name))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: truncated checkpoint: {name} is missing") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read {name} ({e.strerror or e})") from None
    _check(path, name, st, size)


_FLAGS = (
    os.O_RDONLY
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_NONBLOCK", 0)
    | getattr(os, "O_CLOEXEC", 0)
)


def open_file(path: str, name: object, size: int | None, what: str) -> BinaryIO:
    """``name`` (found in ``what``) of checkpoint ``path``, open for reading, once checked as
    ``stat_file`` says on the open file itself (no race between the check and the read)."""
    stat_file(path, name, size, what)  # the error messages; the open below is what is trusted
    try:
        fd = os.open(os.path.join(path, name), _FLAGS)
    except OSError as e:
        if e.errno == errno.ELOOP:  # replaced by a link since the lstat
            raise CheckpointError(
                f"{path}: {name} is a symbolic link; a checkpoint holds regular files only"
            ) from None
        raise CheckpointError(f"{path}: cannot read {name} ({e.strerror or e})") from None
    try:
        _check(path, name, os.fstat(fd), size)
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_file(path: str, name: object, size: int | None, what: str, limit: int) -> bytes:
    """The bytes of ``name`` (``open_file``), refused past ``limit`` bytes."""
    with open_file(path, name, size, what) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise CheckpointError(f"{path}: {name} is larger than {limit} bytes: not a checkpoint file")
    return data


def subdirectory(root: str, name: str) -> str | None:
    """``root/name``, found inside a directory the user named (a run's ``checkpoints``, a
    ``step_<N>``); None when nothing is there, a one-line ``CheckpointError`` for a link."""
    path = os.path.join(root, name)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
    if stat.S_ISLNK(st.st_mode):
        raise CheckpointError(
            f"{path}: a symbolic link; a checkpoint found inside a directory is read only from a "
            "real directory (name the checkpoint itself to read it)"
        )
    return path
