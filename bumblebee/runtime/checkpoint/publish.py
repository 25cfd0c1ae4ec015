"""How a ``step_<N>`` directory appears and disappears: never half of one, whatever is killed when.

A published checkpoint is never modified in place. It appears by one rename (``.tmp-step_N`` ->
``step_N``); it disappears (pruned by ``keep_last``, or replaced by a newer save of the same
step) by first being renamed out of the way (``.pruned-*`` / ``.replaced-*``) and only then
deleted, so a process killed in the middle of a deletion leaves a hidden directory, never a
``step_N`` with files missing. Readers (``--resume``, ``convert``, ``checkpoint verify``) only
look at ``step_N`` names.

``sweep`` tidies what a killed save left: temporaries and half-deleted directories go, and a
checkpoint moved aside for a replacement that never got published is put back. Saves into one
``checkpoints`` directory take ``save_lock`` (rank 0, for the whole save: a second process
saving there, e.g. two ``Engine.save`` calls, waits for the first instead of writing into its
temporary directory), and ``sweep`` runs under it, so it never removes a live save's files.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid

from bumblebee.runtime.process_lock import ProcessLock

SAVE_LOCK = ".save.lock"
_TMP = ".tmp-"
_PRUNED = ".pruned-"
_REPLACED = re.compile(r"^\.replaced-(step_\d+)-[0-9a-f]+$")


def save_lock(root: str) -> ProcessLock:
    return ProcessLock(os.path.join(root, SAVE_LOCK))


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _aside(root: str, name: str, kind: str) -> str:
    path = os.path.join(root, f".{kind}-{name}-{uuid.uuid4().hex[:8]}")
    os.rename(os.path.join(root, name), path)
    return path


def publish(root: str, tmp: str, name: str) -> None:
    """Make the finished ``tmp`` the checkpoint ``root/name``; an older save of that step is
    moved aside first and deleted after (the caller holds ``save_lock``)."""
    final = os.path.join(root, name)
    old = _aside(root, name, "replaced") if os.path.lexists(final) else None
    os.rename(tmp, final)  # the publication: atomic within one filesystem
    fsync_dir(root)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def discard(root: str, name: str) -> None:
    """Delete checkpoint ``root/name``: out of sight first, then its files."""
    shutil.rmtree(_aside(root, name, "pruned"), ignore_errors=True)


def sweep(root: str) -> None:
    """Tidy what killed saves left in ``root`` (the caller holds ``save_lock``, or knows that
    nobody saves there)."""
    names = sorted(os.listdir(root)) if os.path.isdir(root) else []
    for name in names:
        path = os.path.join(root, name)
        if m := _REPLACED.match(name):
            if not os.path.lexists(os.path.join(root, m.group(1))):
                os.rename(path, os.path.join(root, m.group(1)))  # its replacement never appeared
                continue
            shutil.rmtree(path, ignore_errors=True)
        elif name.startswith((_TMP, _PRUNED)):
            shutil.rmtree(path, ignore_errors=True)
