"""The one way bumblebee writes a file: metrics, configs, checkpoint markers, prepared data,
Hugging Face exports, adapters, plots and reports all go through here.

The rules, for every path written:

- **No link is followed inside what bumblebee owns.** A writer names a ``root`` (default: the
  directory the file goes in): ``root`` and the path above it are the user's (runs kept on a
  linked scratch disk are fine), everything below it is opened one component at a time with
  ``O_NOFOLLOW`` and then used through that directory's descriptor, so a symbolic link planted
  in an out_dir, a prepared-data directory or an export target (or swapped in while writing)
  is refused with one line naming it, never written through.
- **A file appears whole or not at all.** It is written to a temporary beside it
  (``.<name>.tmp-<random>``, created with ``O_EXCL``) and renamed over the target only when
  complete, so a reader, a crash or a full disk leaves the previous file or the new one, never
  a part of one. A failure removes the temporary.
- **Records are durable.** ``durable`` (the default) fsyncs the file before the rename and the
  directory after it: on a power loss the rename never outlives the data.
- **Failures are one line.** A write that runs out of room (disk full, quota, file-size limit)
  is ``errors.disk_full``'s ``DiskFullError``; a directory removed while its file was written,
  a permission or any other ``OSError`` is a ``ConfigError`` naming the path.

The API: ``AtomicFile`` (a file written in pieces: ``write``, then ``commit`` or ``discard``; a
context manager), ``write_file`` and ``copy_file`` (a whole file), ``RecordFile`` (an
append-only log such as ``metrics.jsonl``: each append lands whole or is cut back),
``make_dirs``, ``staged_dir`` (a directory of files built beside its target and moved in when
complete: exports) and ``refuse_links`` (a check for what another library writes). Every byte
goes through ``_write_all``, the one place a test simulates a full disk.
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
import stat
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from bumblebee.errors import ConfigError, disk_full, out_of_room

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
COPY_CHUNK = 2**20


def _write_all(fd: int, data) -> None:
    """Write every byte of ``data`` to ``fd`` (a short write is continued)."""
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view) :]


def _link_error(path: str) -> ConfigError:
    try:
        to = f" (to {os.readlink(path)})"
    except OSError:
        to = ""
    return ConfigError(
        f"{path}: is a symbolic link{to}; bumblebee writes nothing through a link there: "
        "remove it, or write elsewhere"
    )


def _error(path: str, doing: str, e: OSError, dir_fd: int | None = None) -> ConfigError:
    """The one line for ``e``, raised while ``doing`` at ``path``."""
    if out_of_room(e):
        return disk_full(path, doing, e)
    if e.errno == errno.ENOENT and dir_fd is not None and os.fstat(dir_fd).st_nlink == 0:
        return ConfigError(
            f"{path}: its directory was removed while it was being written; nothing was kept"
        )
    if e.errno == errno.ENOENT:
        return ConfigError(
            f"{path}: removed (or its directory) while it was being written; nothing was kept"
        )
    return ConfigError(f"{path}: cannot {doing} ({e.strerror or e})")


def refuse_links(*paths: str) -> None:
    """Raise the one-line ``ConfigError`` if any of ``paths`` is a symbolic link (a check before
    or after a writer bumblebee does not control, e.g. torch's checkpoint files)."""
    for path in paths:
        if os.path.islink(path):
            raise _link_error(path)


def _inside(root: str, path: str) -> list[str]:
    """The components of ``path`` below ``root`` (both absolute)."""
    rel = os.path.relpath(path, root)
    if rel == "." or not rel:
        return []
    parts = rel.split(os.sep)
    if parts[0] == os.pardir:
        raise ValueError(f"{path} is not inside {root}")
    return parts


def _open_dir(path: str, root: str | None = None, *, create: bool = False) -> int:
    """A descriptor of directory ``path``, every component below ``root`` (default: ``path``
    itself, or with ``create`` its nearest existing ancestor) opened without following a
    link; ``create`` makes the missing ones."""
    path = os.path.abspath(path)
    if root is None:
        root = path
        while create and not os.path.lexists(root) and os.path.dirname(root) != root:
            root = os.path.dirname(root)
    root = os.path.abspath(root)
    parts = _inside(root, path)
    if create and not os.path.lexists(root):
        make_dirs(root)  # the caller's own path: links above and at it are followed
    try:
        fd = os.open(root, _DIR_FLAGS)
    except OSError as e:
        if e.errno == errno.ENOTDIR:
            raise ConfigError(f"{root}: is a file, not a directory") from None
        raise _error(root, "open the directory", e) from None
    cur = root
    try:
        for part in parts:
            cur = os.path.join(cur, part)
            if create:
                try:
                    os.mkdir(part, 0o777, dir_fd=fd)
                except FileExistsError:
                    pass
                except OSError as e:
                    raise _error(cur, "create the directory", e, fd) from None
            try:
                sub = os.open(part, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    if os.path.islink(cur):
                        raise _link_error(cur) from None
                    raise ConfigError(f"{cur}: is a file, not a directory") from None
                raise _error(cur, "open the directory", e, fd) from None
            os.close(fd)
            fd = sub
    except BaseException:
        os.close(fd)
        raise
    return fd


def make_dirs(path: str, *, root: str | None = None) -> None:
    """``os.makedirs(path, exist_ok=True)`` that follows no link below ``root`` (default: the
    nearest existing ancestor: only what is created here is checked)."""
    os.close(_open_dir(path, root, create=True))


def _check_target(dir_fd: int, name: str, path: str) -> None:
    """Refuse a target that is a link or a directory (a rename would replace it)."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise _link_error(path)
    if stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{path}: is a directory; give a file name")


def _new_temp(dir_fd: int, name: str) -> tuple[str, int]:
    while True:
        tmp = f".{name[:200]}.tmp-{secrets.token_hex(4)}"
        try:
            return tmp, os.open(tmp, _NEW_FILE, 0o666, dir_fd=dir_fd)
        except FileExistsError:
            continue


def sweep_temporaries(directory: str, names: Iterable[str]) -> list[str]:
    """Remove the temporaries ``AtomicFile`` left in ``directory`` for ``names`` when its writer
    was killed (``.<name>.tmp-<8 hex>``); returns the names removed. Only for a writer that holds
    the directory (its lock): a live writer's temporaries look the same. Unlinking never follows
    a link, and nothing but those exact names is touched."""
    wanted = {f".{n[:200]}.tmp-" for n in names}
    removed = []
    try:
        entries = os.listdir(directory)
    except FileNotFoundError:
        return removed
    for entry in entries:
        head, _, tail = entry.rpartition(".tmp-")
        if (
            f"{head}.tmp-" in wanted
            and len(tail) == 8
            and all(c in "0123456789abcdef" for c in tail)
        ):
            try:
                os.remove(os.path.join(directory, entry))
                removed.append(entry)
            except (FileNotFoundError, IsADirectoryError, PermissionError):
                pass
    return removed


class AtomicFile:
    """``path`` written in pieces: ``write`` (bytes or str) appends to a temporary beside it,
    ``commit`` renames it over ``path``, ``discard`` removes it. As a context manager it commits
    when the block ends normally and discards otherwise. ``doing`` completes the error line
    ("no room to {doing}"); ``root``: see the module doc."""

    def __init__(
        self, path: str, *, doing: str = "write", durable: bool = True, root: str | None = None
    ):
        self.path, self.doing, self.durable = path, doing, durable
        self.size = 0  # bytes written so far
        parent, self._name = os.path.split(os.path.abspath(path))
        self._dir = _open_dir(parent, root or parent)
        self._fd = -1
        try:
            _check_target(self._dir, self._name, path)
            self._tmp, self._fd = _new_temp(self._dir, self._name)
        except OSError as e:
            self._close_dir()
            raise _error(path, doing, e) from None
        except BaseException:
            self._close_dir()
            raise

    def write(self, data) -> None:
        view = memoryview(data.encode() if isinstance(data, str) else data).cast("B")
        try:
            _write_all(self._fd, view)
        except OSError as e:
            self.discard()
            raise _error(self.path, self.doing, e) from None
        self.size += len(view)

    def commit(self, *, keep_open: bool = False) -> None:
        """Publish what was written. ``keep_open``: the descriptor stays open for appends to the
        published file (``RecordFile``)."""
        try:
            if self.durable:
                os.fsync(self._fd)
            _check_target(self._dir, self._name, self.path)
            os.replace(self._tmp, self._name, src_dir_fd=self._dir, dst_dir_fd=self._dir)
            self._tmp = ""
            if self.durable:
                os.fsync(self._dir)
        except OSError as e:
            err = _error(self.path, self.doing, e, self._dir)
            self.discard()
            raise err from None
        except BaseException:
            self.discard()
            raise
        if not keep_open:
            os.close(self._fd)
            self._fd = -1
            self._close_dir()

    def discard(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._tmp and self._dir >= 0:
            try:
                os.unlink(self._tmp, dir_fd=self._dir)
            except OSError:
                pass  # gone with its directory
            self._tmp = ""
        self._close_dir()

    def _close_dir(self) -> None:
        if self._dir >= 0:
            os.close(self._dir)
            self._dir = -1

    def __enter__(self) -> AtomicFile:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.discard()


def write_file(
    path: str, data, *, doing: str = "write", durable: bool = True, root: str | None = None
) -> None:
    """``path`` holds ``data`` (bytes or str, UTF-8) afterwards, or is as it was."""
    with AtomicFile(path, doing=doing, durable=durable, root=root) as f:
        f.write(data)


def copy_file(src: str, dst: str, *, doing: str = "copy", root: str | None = None) -> None:
    """``dst`` becomes a copy of the file ``src`` (the rules of ``write_file``)."""
    with open(src, "rb") as fin, AtomicFile(dst, doing=doing, root=root) as f:
        while chunk := fin.read(COPY_CHUNK):
            f.write(chunk)


class RecordFile:
    """An append-only log at ``path`` (``metrics.jsonl``): it starts as ``initial`` (replacing
    what was there, as ``write_file``), then each ``append`` lands whole and fsynced, or is cut
    back (a full disk leaves the lines before it, never a torn one) and raises the one line."""

    def __init__(
        self, path: str, *, doing: str = "write", initial: str = "", root: str | None = None
    ):
        self.path, self.doing = path, doing
        self._file = AtomicFile(path, doing=doing, root=root)
        self._file.write(initial)
        self._file.commit(keep_open=True)
        self._fd, self.size = self._file._fd, self._file.size

    def append(self, text: str) -> None:
        data = text.encode()
        try:
            _write_all(self._fd, data)
            os.fsync(self._fd)
        except OSError as e:
            try:  # the torn part goes, and the next line starts where it started
                os.ftruncate(self._fd, self.size)
                os.lseek(self._fd, self.size, os.SEEK_SET)
            except OSError:
                pass
            raise _error(self.path, self.doing, e) from None
        self.size += len(data)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = self._file._fd = -1
            self._file._close_dir()


class Stage:
    """The directory ``staged_dir`` yields: write into ``path``; ``remove(names)`` names files
    of ``out_dir`` that go when the stage is moved in (an earlier export's shards)."""

    def __init__(self, path: str):
        self.path, self.removed = path, []

    def remove(self, names: Iterable[str]) -> None:
        self.removed += [n for n in names if n not in self.removed]


@contextmanager
def staged_dir(
    out_dir: str, *, doing: str = "write", root: str | None = None, last: Iterable[str] = ()
) -> Iterator[Stage]:
    """A ``Stage``: a new hidden directory beside ``out_dir`` (``root``: see the module doc;
    default ``out_dir`` itself, which may be the user's link). When the block ends normally its
    files are moved into ``out_dir``: the whole directory at once when ``out_dir`` is missing or
    empty; over an earlier directory, the stage is given what that one holds besides the
    stage's files and its ``removed`` ones (hard links) and the two are swapped in one step
    (``_exchange``), so a reader or a kill at any moment sees the earlier directory or the new
    one, never a mix; where no swap can be made (not Linux, a filesystem without it, an
    ``out_dir`` that is the user's link) file by file (each replacing its namesake, no link
    followed), the files named in ``last`` (an entry point such as ``model.safetensors``) after
    the others, and then the stage's ``removed`` files deleted. On any failure the stage is
    removed and ``out_dir`` is as it was."""
    out = os.path.abspath(out_dir)
    parent, base = os.path.split(out)
    make_dirs(parent, root=None if root is None or root == out else root)
    pfd = _open_dir(parent, None if root is None or root == out else root)
    try:
        while True:
            name = f".{base[:200]}.tmp-{secrets.token_hex(4)}"
            try:
                os.mkdir(name, 0o777, dir_fd=pfd)
                break
            except FileExistsError:
                continue
            except OSError as e:
                raise _error(out_dir, doing, e, pfd) from None
        stage = Stage(os.path.join(parent, name))
        try:
            yield stage
            _move_in(stage, out, name, pfd, root, list(last), doing)
        finally:
            shutil.rmtree(stage.path, ignore_errors=True)  # a no-op once moved in whole
    finally:
        os.close(pfd)


_RENAME_EXCHANGE = 2  # linux/fs.h
_renameat2 = None


def _exchange(dir_fd: int, a: str, b: str) -> bool:
    """Swap entries ``a`` and ``b`` of directory ``dir_fd`` in one step (Linux ``renameat2``
    with ``RENAME_EXCHANGE``): a reader of either name sees the one or the other, never neither.
    False where the kernel, the C library or the filesystem cannot (nothing was changed)."""
    global _renameat2
    if _renameat2 is None:
        _renameat2 = False
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            fn = libc.renameat2
            fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p]
            fn.argtypes += [ctypes.c_uint]
            _renameat2 = fn
        except (OSError, AttributeError):  # not Linux, or a C library without it
            pass
    if not _renameat2:
        return False
    import ctypes

    if _renameat2(dir_fd, os.fsencode(a), dir_fd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
        return False  # this filesystem cannot swap: the file-by-file move
    raise OSError(err, os.strerror(err))


def _link_into(src_fd: int, dst_fd: int, n: str, src: str, dst: str) -> None:
    """Entry ``n`` of directory ``src_fd`` also in ``dst_fd``: a hard link (a link is copied as
    a link, a directory as a tree of hard links), a copy where no hard link can be made."""
    st = os.stat(n, dir_fd=src_fd, follow_symlinks=False)
    if stat.S_ISDIR(st.st_mode):
        shutil.copytree(src, dst, symlinks=True, copy_function=_hard_link_or_copy)
        return
    try:
        os.link(n, n, src_dir_fd=src_fd, dst_dir_fd=dst_fd, follow_symlinks=False)
    except OSError:  # no hard links here (another filesystem, a special file)
        _hard_link_or_copy(src, dst)


def _hard_link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        if os.path.islink(src):
            os.symlink(os.readlink(src), dst)
        else:
            shutil.copy2(src, dst, follow_symlinks=False)


def _move_in(stage: Stage, out: str, name: str, pfd: int, root, last, doing) -> None:
    base = os.path.basename(out)
    owned = root is not None and root != out  # out_dir is below root: a link there is refused
    try:
        st = os.stat(base, dir_fd=pfd, follow_symlinks=False)
    except FileNotFoundError:
        st = None
    if st is not None and stat.S_ISLNK(st.st_mode) and owned:
        raise _link_error(out)
    try:
        if st is not None and stat.S_ISDIR(st.st_mode) and not os.listdir(out):
            os.rmdir(base, dir_fd=pfd)
            st = None
        if st is None:
            os.rename(name, base, src_dir_fd=pfd, dst_dir_fd=pfd)
            os.fsync(pfd)
            return
        ofd = _open_dir(out, root if owned else out)
        sfd = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=pfd)
        try:
            names = sorted(os.listdir(sfd), key=lambda n: n in last)
            for n in names + stage.removed:
                _check_target(ofd, n, os.path.join(out, n))
            if not stat.S_ISLNK(st.st_mode):  # out_dir is a directory here: swap it whole
                keep = set(names) | set(stage.removed)
                for n in sorted(os.listdir(ofd)):  # what else it holds (a user's files) stays
                    if n not in keep:
                        _link_into(ofd, sfd, n, os.path.join(out, n), os.path.join(stage.path, n))
                os.chmod(name, stat.S_IMODE(st.st_mode), dir_fd=pfd)  # the earlier one's mode
                os.fsync(sfd)
                if _exchange(pfd, name, base):  # the stage now holds the earlier directory
                    os.fsync(pfd)
                    return
            for n in stage.removed:
                if n not in names:
                    try:
                        os.unlink(n, dir_fd=ofd)
                    except FileNotFoundError:
                        pass
            for n in names:
                os.replace(n, n, src_dir_fd=sfd, dst_dir_fd=ofd)
            os.fsync(ofd)
        finally:
            os.close(sfd)
            os.close(ofd)
    except OSError as e:
        raise _error(out, doing, e, pfd) from None
