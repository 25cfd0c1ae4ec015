"""User data from JSONL: one sample per line, ``{"input_ids": [...], "loss_mask": [...]}``.

``loss_mask`` (optional, default all ones) marks which tokens are prediction
targets. Samples are packed greedily, in file order, into rows of ``seq_len``;
a sample longer than a row is split into row-sized pieces. Rows are shuffled
per epoch with the run's seed. Any malformed line fails the run up front with
``file:line: what is wrong``.
"""

from __future__ import annotations

import json
import random

import torch

from bumblebee.data.errors import DataError
from bumblebee.data.packing import Batch, RowPacker, stack_rows

__all__ = ["DataError", "JsonlSource", "read_samples"]

_COMPRESSED = [(b"\x1f\x8b", "gzip"), (b"BZh", "bzip2"), (b"\xfd7zXZ", "xz"), (b"\x28\xb5\x2f\xfd", "zstd"),
               (b"PK\x03\x04", "zip")]


def read_samples(path: str, vocab_size: int) -> list[tuple[list[int], list[bool]]]:
    samples = []
    try:
        with open(path, "rb") as f:
            head = f.read(6)
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from None
    for magic, kind in _COMPRESSED:
        if head.startswith(magic):
            raise DataError(f"{path}: a {kind}-compressed file; data.path must be plain UTF-8 JSONL "
                            f"(decompress it first)")
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{where}: not UTF-8 text (byte {e.start}); data.path must be UTF-8 JSONL") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except (json.JSONDecodeError, RecursionError) as e:
                raise DataError(f"{where}: not valid JSON ({getattr(e, 'msg', 'nested too deeply')})") from None
            if not isinstance(obj, dict) or "input_ids" not in obj:
                raise DataError(f"{where}: expected an object with 'input_ids' (and optional 'loss_mask')")
            ids, mask = obj["input_ids"], obj.get("loss_mask")
            if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool)
                                                              for i in ids):
                raise DataError(f"{where}: 'input_ids' must be a non-empty list of integers")
            bad = [i for i in ids if not 0 <= i < vocab_size]
            if bad:
                raise DataError(f"{where}: token id {bad[0]} outside the vocabulary [0, {vocab_size})")
            if mask is None:
                mask = [1] * len(ids)
            if not isinstance(mask, list) or len(mask) != len(ids) or not all(m in (0, 1, True, False)
                                                                               for m in mask):
                raise DataError(f"{where}: 'loss_mask' must be a list of 0/1 of the same length as 'input_ids'")
            samples.append((ids, [bool(m) for m in mask]))
    if not samples:
        raise DataError(f"{path}: no samples")
    return samples


class JsonlSource:
    def __init__(self, path: str, *, seq_len: int, global_batch: int, seed: int, vocab_size: int, pad_id: int = 0):
        self.global_batch, self.seed = global_batch, seed
        rows, packer = [], RowPacker(seq_len, pad_id)
        for ids, mask in read_samples(path, vocab_size):
            for s in range(0, len(ids), seq_len):
                piece, piece_mask = ids[s:s + seq_len], mask[s:s + seq_len]
                if len(piece) > packer.free:
                    rows.append(packer.finish())
                    packer = RowPacker(seq_len, pad_id)
                packer.add(piece, piece_mask)
        if packer.ids:
            rows.append(packer.finish())
        self.rows = stack_rows(rows)

    def global_batch_at(self, step: int) -> Batch:
        """Rows step*B .. step*B+B-1 of the endless stream of per-epoch shuffles."""
        n = self.rows.input_ids.shape[0]
        perms: dict[int, list[int]] = {}
        order = []
        for g in range(step * self.global_batch, (step + 1) * self.global_batch):
            epoch = g // n
            if epoch not in perms:
                perms[epoch] = list(range(n))
                random.Random(self.seed * 7919 + epoch).shuffle(perms[epoch])
            order.append(perms[epoch][g % n])
        idx = torch.tensor(order)
        return Batch(self.rows.input_ids[idx], self.rows.labels[idx], self.rows.position_ids[idx])
