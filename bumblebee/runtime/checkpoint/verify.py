"""``bumblebee checkpoint verify DIR``: check every checkpoint under a directory without loading it
(markers, sizes, the per-file checksums of runtime/checkpoint/integrity.py, and that DCP's
``.metadata`` keeps every tensor inside the checkpoint's files: state.py ``check_metadata``).
Every file is opened through reader.py, like a resume's."""

from __future__ import annotations

import os
import sys

from bumblebee.errors import CheckpointError
from bumblebee.runtime.checkpoint.directory import (
    MARKER,
    STEP_DIR,
    checkpoints_in,
    read_marker,
    saved_arch,
)
from bumblebee.runtime.checkpoint.integrity import HASH, verify_checksums
from bumblebee.runtime.checkpoint.reader import subdirectory
from bumblebee.runtime.checkpoint.state import read_dcp_metadata


def verify_command(spec: str) -> int:
    """``bumblebee checkpoint verify DIR``: 0 if every checkpoint under DIR is intact, 1 if
    one is corrupt or incomplete, or cannot be verified (files without a checksum in its marker):
    each printed on one line."""
    if os.path.lexists(os.path.join(spec, MARKER)):
        dirs = [spec]
    else:
        root = checkpoints_in(spec)
        if root is None:
            read_marker(spec)  # raises the one-line reason (missing, not a checkpoint, ...)
        dirs = [os.path.join(root, n) for n in sorted(os.listdir(root)) if STEP_DIR.match(n)]
    bad = 0
    for d in dirs:
        try:
            if d != spec:
                subdirectory(os.path.dirname(d), os.path.basename(d))  # not a link
            info = read_marker(d)
            saved_arch(d, info)  # a model the readers can build
            verify_checksums(d, info)
            read_dcp_metadata(d, info)
        except CheckpointError as e:
            print(f"bumblebee: FAILED {e}", file=sys.stderr)
            bad += 1
            continue
        files, sums = info.get("files", {}), info.get("checksums") or {}
        n, size = len(files), sum(files.values())
        unchecked = sorted(set(files) - set(sums))
        if unchecked:  # a size match says nothing of the contents: not "ok"
            print(
                f"bumblebee: NOT VERIFIED {d}: {len(unchecked)} of {n} files have no checksum in its marker "
                f"(e.g. {unchecked[0]}; written before checksums existed, or edited): only their sizes "
                f"were checked, not their contents",
                file=sys.stderr,
            )
            bad += 1
            continue
        print(f"bumblebee: ok {d}: {n} files, {size / 2**20:.1f} MiB, {len(sums)} {HASH} checksums")
    return 1 if bad else 0
