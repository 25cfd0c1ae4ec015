"""User data from JSONL: one sample per line, ``{"input_ids": [...], "loss_mask": [...]}``.

``loss_mask`` (optional, default all ones) marks which tokens are prediction
targets. Samples are packed greedily, in file order, into rows of ``seq_len``;
a sample longer than a row is split into continuations at row boundaries, cut,
or left out (``too_long``, rowplan.py; default split). Rows are shuffled per
epoch with the run's seed. Any malformed line fails the run up front with
``file:line: what is wrong``.

The file is not held in memory: one pass at start validates every line and keeps,
per sample, its byte offset, and per row, which pieces of which samples it packs
(a ``RowPlan``) and its label count; a rank then reads only the samples of the rows it is asked
for (``rows_at``), so memory is a few integers per sample and per row whatever
the file's size. For large corpora ``bumblebee data prepare`` + the ``tokens``
source is still the better path (no JSON parsing per step).
"""

from __future__ import annotations

import json
import random
from array import array
from collections.abc import Callable

from bumblebee.data.errors import DataError
from bumblebee.data.packing import Batch, RowPacker, stack_rows
from bumblebee.data.rowplan import RowPlan, describe_cost, resolve_too_long

__all__ = ["DataError", "JsonlSource", "read_samples", "scan_samples"]

_COMPRESSED = [
    (b"\x1f\x8b", "gzip"),
    (b"BZh", "bzip2"),
    (b"\xfd7zXZ", "xz"),
    (b"\x28\xb5\x2f\xfd", "zstd"),
    (b"PK\x03\x04", "zip"),
]


def _sample(raw: bytes, where: str, vocab_size: int) -> tuple[list[int], list[bool]] | None:
    """One line: (token ids, loss mask), None for a blank line; a DataError naming ``where``."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"{where}: not UTF-8 text (byte {e.start}); data.path must be UTF-8 JSONL"
        ) from None
    if not line.strip():
        return None
    try:
        obj = json.loads(line)
    except (json.JSONDecodeError, RecursionError) as e:
        raise DataError(
            f"{where}: not valid JSON ({getattr(e, 'msg', 'nested too deeply')})"
        ) from None
    if not isinstance(obj, dict) or "input_ids" not in obj:
        raise DataError(f"{where}: expected an object with 'input_ids' (and optional 'loss_mask')")
    ids, mask = obj["input_ids"], obj.get("loss_mask")
    if (
        not isinstance(ids, list)
        or not ids
        or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
    ):
        raise DataError(f"{where}: 'input_ids' must be a non-empty list of integers")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise DataError(f"{where}: token id {bad[0]} outside the vocabulary [0, {vocab_size})")
    if mask is None:
        mask = [1] * len(ids)
    if (
        not isinstance(mask, list)
        or len(mask) != len(ids)
        or not all(m in (0, 1, True, False) for m in mask)
    ):
        raise DataError(
            f"{where}: 'loss_mask' must be a list of 0/1 of the same length as 'input_ids'"
        )
    return ids, [bool(m) for m in mask]


def scan_samples(
    path: str, vocab_size: int, visit: Callable[[int, list[int], list[bool]], None]
) -> int:
    """Validate every line of ``path``, calling ``visit(byte offset, ids, mask)`` per sample in
    file order without keeping any; returns the number of samples (a DataError if none)."""
    try:
        with open(path, "rb") as f:
            head = f.read(6)
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from None
    for magic, kind in _COMPRESSED:
        if head.startswith(magic):
            raise DataError(
                f"{path}: a {kind}-compressed file; data.path must be plain UTF-8 JSONL "
                f"(decompress it first)"
            )
    count, offset = 0, 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            sample = _sample(raw, f"{path}:{lineno}", vocab_size)
            if sample is not None:
                visit(offset, *sample)
                count += 1
            offset += len(raw)
    if not count:
        raise DataError(f"{path}: no samples")
    return count


def read_samples(path: str, vocab_size: int) -> list[tuple[list[int], list[bool]]]:
    """Every sample of ``path`` in memory (small files, tests); the source streams instead."""
    samples: list = []
    scan_samples(path, vocab_size, lambda _offset, ids, mask: samples.append((ids, mask)))
    return samples


class JsonlSource:
    """Rows of a global batch from a JSONL file, read by offset (see the module docstring).
    ``rows_at`` / ``num_valid_at`` as every source; ``global_batch_at`` for a whole batch."""

    def __init__(
        self,
        path: str,
        *,
        seq_len: int,
        global_batch: int,
        seed: int,
        vocab_size: int,
        pad_id: int = 0,
        too_long: str = "auto",
    ):
        self.path, self.seq_len, self.pad_id, self.vocab_size = path, seq_len, pad_id, vocab_size
        self.global_batch, self.seed = global_batch, seed
        self.too_long = resolve_too_long(too_long, "jsonl")
        self.offsets = array("q")  # byte offset of every sample's line
        self.plan = RowPlan(
            seq_len, self.too_long
        )  # per row: (sample, start, length) pieces in order
        labels = array("q")  # per piece: its label count

        def visit(offset: int, ids: list[int], mask: list[bool]) -> None:
            sample = len(self.offsets)
            self.offsets.append(offset)
            for s, n in self.plan.add(sample, len(ids)):
                labels.append(
                    sum(mask[s + 1 : s + n])
                )  # position t has a label iff token t + 1 is marked

        scan_samples(path, vocab_size, visit)
        self.plan.finish()
        if not self.plan.num_rows:
            raise DataError(
                f"{path}: no rows: every sample is longer than train.seq_len = {seq_len} and "
                f"data.too_long = 'drop'"
            )
        ptr = self.plan.row_ptr
        self.valid = array(
            "q", (sum(labels[ptr[r] : ptr[r + 1]]) for r in range(self.plan.num_rows))
        )
        self._perm: tuple[int, list[int]] | None = None  # the last epoch's shuffle
        self.stats: dict = self.plan.stats

    def __len__(self) -> int:
        return self.plan.num_rows

    def _read(self, f, sample: int) -> tuple[list[int], list[bool]]:
        f.seek(self.offsets[sample])
        got = _sample(f.readline(), f"{self.path} (sample {sample})", self.vocab_size)
        if got is None:  # the file changed under the run
            raise DataError(
                f"{self.path}: sample {sample} is no longer at byte {self.offsets[sample]}"
            )
        return got

    def _rows(self, rows: list[int]) -> Batch:
        with open(self.path, "rb") as f:
            built = []
            p = self.plan
            for r in rows:
                packer = RowPacker(self.seq_len, self.pad_id)
                for k in range(p.row_ptr[r], p.row_ptr[r + 1]):
                    sample, s, e = p.doc[k], p.start[k], p.start[k] + p.length[k]
                    ids, mask = self._read(f, sample)
                    if e > len(ids):
                        raise DataError(
                            f"{self.path}: sample {sample} changed since the run started"
                        )
                    packer.add(ids[s:e], mask[s:e])
                built.append(packer.finish())
        return stack_rows(built)

    def order(self, step: int) -> list[int]:
        """Row indices of global batch ``step``: rows step*B .. step*B+B-1 of the endless stream of
        per-epoch shuffles."""
        n = self.plan.num_rows
        out = []
        for g in range(step * self.global_batch, (step + 1) * self.global_batch):
            epoch = g // n
            if self._perm is None or self._perm[0] != epoch:
                perm = list(range(n))
                random.Random(self.seed * 7919 + epoch).shuffle(perm)
                self._perm = (epoch, perm)
            out.append(self._perm[1][g % n])
        return out

    def rows_at(self, step: int, lo: int, hi: int) -> Batch:
        return self._rows(self.order(step)[lo:hi])

    def num_valid_at(self, step: int) -> int:
        return sum(self.valid[r] for r in self.order(step))

    def global_batch_at(self, step: int) -> Batch:
        return self.rows_at(step, 0, self.global_batch)

    def all_rows(self) -> Batch:
        """Every packed row in file order (reads the whole file: small files and tests)."""
        return self._rows(list(range(self.plan.num_rows)))

    def eval_batch_list(self) -> list[Batch]:
        return []

    def describe(self) -> str:
        s = self.stats
        return (
            f"data: {s['documents']} samples in {s['rows']} rows of {self.seq_len} tokens; "
            f"{describe_cost(s, self.too_long)}"
        )
