"""A Hugging Face export directory appears whole, whatever is killed when.

An export (``bumblebee convert``, ``train.export_hf``, ``Engine.export_hf``) is written into a
hidden temporary directory beside its target, ``.<name>.tmp-<pid>``, and moved in by renames:
a new target by one rename; an earlier export by first giving the new one what the earlier
directory holds besides the export itself (other files a user put there, as hard links: no
copy, and the originals stay where they are until the swap), then moving the earlier export
aside (``.<name>.replaced-<pid>``), renaming the new one in, and deleting the earlier one. A
reader of the target sees the earlier export or the new one, never a mix, and the user's files
are in the target at every moment.

One export at a time per target: the writer holds a kernel lock beside it
(``.<name>.lock``, process_lock.py), which dies with the writer, so a second export into the
same target is refused with one line instead of interleaving its files, and a killed export
blocks nothing. Under that lock, what killed exports left beside the target is tidied first:
temporaries are deleted, and an earlier export moved aside whose replacement never appeared is
put back (or, when it did, its extra files are carried over before it goes).
"""

from __future__ import annotations

import os
import re
import shutil
from contextlib import contextmanager
from typing import TYPE_CHECKING

from bumblebee.models.hf import CheckpointError
from bumblebee.runtime.process_lock import ProcessLock

if TYPE_CHECKING:
    import torch

# what an export writes itself (models/hf_write.py WEIGHT_FILE, and config.json)
EXPORT_FILE = re.compile(
    r"^(config\.json|model\.safetensors|model-\d{5}-of-\d{5}\.safetensors|model\.safetensors\.index\.json)$"
)


def _beside(out_dir: str, kind: str) -> str:
    parent, base = os.path.split(os.path.abspath(out_dir))
    return os.path.join(parent, f".{base}.{kind}")


def temporary(out_dir: str) -> str:
    """Where the export into ``out_dir`` is written before it is moved in."""
    return f"{_beside(out_dir, 'tmp')}-{os.getpid()}"


@contextmanager
def export_lock(out_dir: str):
    """Hold ``out_dir``'s export lock for the block (refused with a one-line
    ``CheckpointError`` while another export holds it); tidies what killed exports left."""
    parent = os.path.dirname(os.path.abspath(out_dir))
    try:
        os.makedirs(parent, exist_ok=True)
        lock = ProcessLock(_beside(out_dir, "lock"))
        taken = lock.acquire(wait=False)
    except OSError as e:
        raise CheckpointError(f"{out_dir}: cannot write the export ({e.strerror or e})") from None
    if not taken:
        raise CheckpointError(
            f"{out_dir}: another export is writing this directory; wait for it to finish, or "
            "export to another directory"
        )
    try:
        _tidy(out_dir)
        yield
    finally:
        lock.release()


def to_hf(
    model,
    out_dir: str,
    max_shard_bytes: int = 5 * 2**30,
    *,
    dtype: torch.dtype | None = None,
    source: str = "",
) -> None:
    """``bumblebee.to_hf``: ``models.hf.to_hf`` (``model`` as a HF directory, in ``dtype``,
    sharded at ``max_shard_bytes``, ``source``'s extra tensors carried over) under ``out_dir``'s
    export lock, as every export: one at a time per target, and what a killed one left beside
    the target is tidied first."""
    from bumblebee.models.hf import to_hf as write

    with export_lock(out_dir):
        write(model, out_dir, max_shard_bytes, dtype=dtype, source=source)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:  # no hard links here (or a special file): a copy
        shutil.copy2(src, dst, follow_symlinks=False)


def _extras(old: str, new: str, move: bool = False) -> None:
    """Give ``new`` what ``old`` (an earlier export) holds besides an export and ``new`` lacks:
    hard links (a tree of them for a directory), or with ``move`` the entries themselves."""
    for name in sorted(os.listdir(old)):
        src, dst = os.path.join(old, name), os.path.join(new, name)
        if EXPORT_FILE.match(name) or os.path.lexists(dst):
            continue
        if move:
            os.rename(src, dst)
        elif os.path.isdir(src) and not os.path.islink(src):
            shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(src, dst)


def _tidy(out_dir: str) -> None:
    parent = os.path.dirname(os.path.abspath(out_dir))
    tmp, replaced = os.path.basename(_beside(out_dir, "tmp")), _beside(out_dir, "replaced")
    for name in sorted(os.listdir(parent)):
        path = os.path.join(parent, name)
        if name.startswith(tmp + "-"):
            shutil.rmtree(path, ignore_errors=True)
        elif name.startswith(os.path.basename(replaced) + "-"):
            if not os.path.lexists(out_dir):
                os.rename(path, out_dir)  # its replacement never appeared
            else:
                _extras(path, out_dir, move=True)
                shutil.rmtree(path, ignore_errors=True)


def publish_export(tmp: str, out_dir: str) -> None:
    """Move the finished export ``tmp`` to ``out_dir`` (the caller holds ``export_lock``): into a
    new or empty directory by one rename; over an earlier export by the swap of the module doc."""
    if os.path.isdir(out_dir) and not os.path.islink(out_dir) and not os.listdir(out_dir):
        os.rmdir(out_dir)
    if not os.path.lexists(out_dir):
        os.rename(tmp, out_dir)
        return
    _extras(out_dir, tmp)
    old = f"{_beside(out_dir, 'replaced')}-{os.getpid()}"
    os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)
