"""The embedded default task: long-range key-value retrieval over bytes.

Each document is a list of records ``key=value;`` (3 random lowercase letters,
4 random digits, keys unique within the document) followed by a query
``?key:`` for one record chosen at random and its answer ``value``. Loss is
taken on the answer digits only. A model can only beat chance (ln 10 per digit)
by attending back to the queried record, which may be hundreds to thousands of
tokens earlier: the task needs long-range attention, and nothing else helps.

Tokens are bytes (0-255); 256 is BOS, 257 is padding. Several documents are
packed per row (see packing.py). The global batch of a step is a pure function
of (seed, step).
"""

from __future__ import annotations

import random
import string

from bumblebee.data.packing import Batch, RowPacker, stack_rows

BOS, PAD = 256, 257
RECORD_LEN = 9  # "abc=1234;"
QUERY_LEN = 10  # "?abc:1234\n"


class KeyValueRetrieval:
    def __init__(self, *, seq_len: int, global_batch: int, seed: int, min_records: int = 16,
                 max_records: int = 96):
        if seq_len < 1 + RECORD_LEN + QUERY_LEN:
            raise ValueError(f"the key-value task needs seq_len >= {1 + RECORD_LEN + QUERY_LEN}, got {seq_len}")
        self.seq_len, self.global_batch, self.seed = seq_len, global_batch, seed
        self.min_records, self.max_records = min_records, max_records

    @staticmethod
    def document(rng: random.Random, n_records: int) -> tuple[list[int], list[bool]]:
        keys: set[str] = set()
        while len(keys) < n_records:
            keys.add("".join(rng.choices(string.ascii_lowercase, k=3)))
        order = sorted(keys)  # a set's iteration order varies per process (string hashing)
        rng.shuffle(order)
        records = [(k, "".join(rng.choices(string.digits, k=4))) for k in order]
        key, value = records[rng.randrange(n_records)]
        body = "".join(f"{k}={v};" for k, v in records) + f"?{key}:"
        tokens = [BOS] + list(body.encode()) + list(value.encode()) + [ord("\n")]
        mask = [False] * (1 + len(body)) + [True] * len(value) + [False]
        return tokens, mask

    def global_batch_at(self, step: int) -> Batch:
        rng = random.Random(self.seed * 1_000_003 + step)
        rows = []
        for _ in range(self.global_batch):
            packer = RowPacker(self.seq_len, PAD)
            while True:
                fit = (packer.free - 1 - QUERY_LEN) // RECORD_LEN
                if fit < 1:
                    break
                n = min(rng.randint(self.min_records, self.max_records), fit)
                packer.add(*self.document(rng, n))
            rows.append(packer.finish())
        return stack_rows(rows)
