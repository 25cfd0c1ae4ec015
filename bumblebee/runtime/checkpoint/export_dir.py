"""A Hugging Face export directory appears whole, whatever is killed when.

An export (``bumblebee convert``, ``train.export_hf``, ``Engine.export_hf``) is written into a
hidden temporary directory beside its target, ``.<name>.tmp-<pid>``, and moved in by renames:
a new target by one rename; an earlier export by moving it aside (``.<name>.replaced-<pid>``),
renaming the new one in, and carrying over what the earlier directory held besides the export
itself (other files a user put there), then deleting the earlier export. A reader of the target
sees the earlier export or the new one, never a mix.

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

from bumblebee.models.hf import CheckpointError
from bumblebee.runtime.process_lock import ProcessLock

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


def _extras(old: str, new: str) -> None:
    """Move what ``old`` (an earlier export) holds besides an export and ``new`` lacks into
    ``new``."""
    for name in sorted(os.listdir(old)):
        if not EXPORT_FILE.match(name) and not os.path.lexists(os.path.join(new, name)):
            os.rename(os.path.join(old, name), os.path.join(new, name))


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
                _extras(path, out_dir)
                shutil.rmtree(path, ignore_errors=True)


def publish_export(tmp: str, out_dir: str) -> None:
    """Move the finished export ``tmp`` to ``out_dir`` (the caller holds ``export_lock``): into a
    new or empty directory by one rename; over an earlier export by the swap of the module doc."""
    if os.path.isdir(out_dir) and not os.path.islink(out_dir) and not os.listdir(out_dir):
        os.rmdir(out_dir)
    if not os.path.lexists(out_dir):
        os.rename(tmp, out_dir)
        return
    old = f"{_beside(out_dir, 'replaced')}-{os.getpid()}"
    os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    _extras(old, out_dir)
    shutil.rmtree(old, ignore_errors=True)
