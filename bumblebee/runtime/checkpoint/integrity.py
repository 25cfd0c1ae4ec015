"""Checkpoint integrity: a CRC-32 per file in the marker, verified on load and by
``bumblebee checkpoint verify DIR``.

Why CRC-32 (``zlib.crc32``): the threat is corruption (a flipped bit on disk or in
transit, a file overwritten by a stray copy), not an adversary, so a cryptographic
hash buys nothing; CRC-32 catches every error burst up to 32 bits and any odd
number of flipped bits, ships with Python (no dependency), and is the fastest hash
in the standard library (skills/runtime/checkpoints.md has the figures). Tampering is a different question:
checkpoints are loaded without unpickling arbitrary objects (checkpoint/state.py).

The work is spread over the ranks: on save each rank hashes every ``world``-th file
of the directory (sorted names) and rank 0 merges the results into the marker; on
load each rank verifies its share and the ranks agree on the verdict, so a corrupt
file fails every rank with the same one line. A checksum's file name is untrusted: it is read
through reader.py (a listed regular file directly in the checkpoint, of its recorded size).
"""

from __future__ import annotations

import os
import re
import zlib

import torch.distributed as dist

from bumblebee.models.hf import CheckpointError
from bumblebee.runtime.checkpoint.reader import open_file, shown

HASH = "crc32"
_CHUNK = 16 * 2**20
_HEX = re.compile(r"[0-9a-f]{8}")


def file_checksum(path: str) -> str:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


def member_checksum(path: str, name: str, size: int | None) -> str:
    """CRC-32 of file ``name`` of checkpoint ``path`` (``size``: the bytes its marker records, None:
    unrecorded), opened through reader.py and read no further than its size."""
    crc = 0
    with open_file(path, name, size, "the marker's 'checksums'") as f:
        left = os.fstat(f.fileno()).st_size
        while left > 0 and (block := f.read(min(_CHUNK, left))):
            crc = zlib.crc32(block, crc)
            left -= len(block)
    return f"{crc:08x}"


def _share(names: list[str], rank: int, world: int) -> list[str]:
    return sorted(names)[rank::world]


def checksum_files(
    path: str, names: list[str], group=None, rank: int = 0, world: int = 1
) -> dict[str, str]:
    """CRC-32 of ``names`` in ``path``; collective over ``group`` (each rank hashes a share:
    ``rank`` of ``world``, this rank's place in ``group``, which the caller carries)."""
    mine = {n: file_checksum(os.path.join(path, n)) for n in _share(names, rank, world)}
    if group is None:
        return mine
    every = [None] * world
    dist.all_gather_object(every, mine, group=group)
    return {k: v for d in every for k, v in d.items()}


def _errors(path: str, info: dict, names: list[str]) -> list[str]:
    sums, sizes = info.get("checksums", {}), info.get("files", {})
    out = []
    for n in names:
        try:
            got = member_checksum(path, n, sizes.get(n))
        except CheckpointError as e:  # reported with the others: every rank reaches the gather
            out.append(str(e))
            continue
        if got != sums[n]:
            recorded = sums[n] if _HEX.fullmatch(sums[n]) else shown(sums[n])
            out.append(
                f"{path}: corrupt checkpoint: {n} has {HASH} {got}, the marker records {recorded}"
            )
    return out


def verify_checksums(path: str, info: dict, group=None, rank: int = 0, world: int = 1) -> None:
    """Raise a one-line ``CheckpointError`` naming the first corrupt file (collective over
    ``group``, this rank ``rank`` of its ``world``). Markers written before checksums existed are
    accepted as they are."""
    names = sorted(info.get("checksums", {}))
    if not names:
        return
    if info.get("hash", HASH) != HASH:
        raise CheckpointError(
            f"{path}: checksums use {info.get('hash')!r}; this bumblebee knows {HASH}"
        )
    errors = _errors(path, info, _share(names, rank, world))
    if group is not None:
        every = [None] * world
        dist.all_gather_object(every, errors, group=group)
        errors = [e for part in every for e in part]
    if errors:
        raise CheckpointError(
            errors[0] + (f" (and {len(errors) - 1} more files)" if len(errors) > 1 else "")
        )
