"""The one writer guard every command that writes runs before it writes: ``train`` (out_dir),
``data prepare`` (OUT), ``convert`` (OUT_DIR), ``report`` (-o), ``plan --plot`` and
``rl --plot``; the writes themselves go through safe_write.py.

``check_target`` refuses, each with one line naming the path: an empty path; a file target
that is a symbolic link; a target of the wrong kind (a file where a directory goes, a
directory where a file goes); a target that is one of the command's inputs or lies inside an
input directory (writing there would destroy or mix with what is being read); and a place
that cannot be written (checked by creating a probe file in the nearest existing directory,
so a read-only filesystem fails as well as a permission). ``writing`` turns a write that
runs out of room into errors.disk_full's line. Whatever a command adds on top (convert's
"an earlier export", train's lock) stays its own.
"""

from __future__ import annotations

import errno
import os
import secrets
from contextlib import contextmanager

from bumblebee import safe_write
from bumblebee.errors import ConfigError, disk_full, out_of_room


def _contains(outer: str, inner: str) -> bool:
    return inner == outer or inner.startswith(outer.rstrip(os.sep) + os.sep)


def check_target(
    path: str, what: str, *, kind: str = "dir", inputs=(), nested: bool = True
) -> None:
    """Raise ``ConfigError("{what} {path}: ...")`` unless ``path`` may be written as a ``kind``
    ("dir" or "file"); ``inputs``: the paths the command reads; ``nested``: whether a target
    inside an input directory is refused too (convert's run_dir/hf is not)."""
    assert kind in ("dir", "file")
    if not str(path).strip():
        raise ConfigError(f"{what} is empty; give the path to write to")
    label = f"{what} {path}"
    if kind == "file":  # a directory given may be the user's link; a file written is never one
        safe_write.refuse_links(path)
    if os.path.exists(path):
        if kind == "dir" and not os.path.isdir(path):
            raise ConfigError(f"{label}: exists and is not a directory")
        if kind == "file" and os.path.isdir(path):
            raise ConfigError(f"{label}: is a directory; give a file name")
    real = os.path.realpath(path)
    for src in inputs:
        if not src:
            continue
        src_real = os.path.realpath(src)
        if real == src_real or (nested and _contains(src_real, real)):
            where = "is" if real == src_real else "lies inside"
            raise ConfigError(f"{label}: {where} the input {src}; write elsewhere")
    parent = real if kind == "dir" and os.path.isdir(real) else os.path.dirname(real)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ConfigError(f"{label}: {parent} is a file, not a directory")
    if os.path.exists(real) and kind == "file" and not os.access(real, os.W_OK):
        raise ConfigError(f"{label}: not writable")
    try:
        probe_write(parent)
    except OSError as e:
        if out_of_room(e):
            raise disk_full(parent, f"write {what}", e) from None
        raise ConfigError(f"{label}: not writable ({parent}: {e.strerror or e})") from None


def probe_write(directory: str) -> None:
    """Write a few bytes into ``directory`` (raises the OSError a real write would) without
    leaving a name there even if the process is killed meanwhile: an unnamed file (Linux
    ``O_TMPFILE``) where the filesystem has them, else a probe file removed at once."""
    tmpfile = getattr(os, "O_TMPFILE", 0)
    if tmpfile:
        try:
            fd = os.open(directory, tmpfile | os.O_WRONLY, 0o600)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise
        else:
            try:
                os.write(fd, b"ok")
            finally:
                os.close(fd)
            return
    # "x": created here (O_EXCL), never a planted file or link written through
    probe = os.path.join(directory, f".bumblebee-write-test-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        with open(probe, "x") as f:
            f.write("ok")
    finally:
        if os.path.lexists(probe):
            os.remove(probe)


@contextmanager
def writing(path: str, doing: str):
    """Within the block, a write that runs out of room is ``disk_full``'s one line."""
    try:
        yield
    except (OSError, RuntimeError) as e:
        if out_of_room(e):
            raise disk_full(path, doing, e) from None
        raise
