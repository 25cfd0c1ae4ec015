"""The embedded default task: key-value retrieval at long range, over bytes.

A document hides ``n`` records `` K123;`` (a distinct uppercase key letter, then
``value_len`` random digits) at random places in filler text (random lowercase
words), then asks about every record once, in random order: ``?K123\\n``. The key
is the token right before the value in both places, so the lookup is the
classic induction pattern ("after K came 1 back there, so 1 comes now").
Loss is taken on the answer digits only. Filler and keys carry no information
about the values, so a model can only beat chance (ln 10 per digit) by attending
back to the record, which may be thousands of tokens earlier: the task needs
long-range attention, and nothing else helps. (A multi-key "needle in a
haystack" with several queries per document, cf. the passkey task of Mohtashami
and Jaggi 2023 and multi-query associative recall of Arora et al. 2023.)

Curriculum on record count and distance: with ``ramp_steps > 0`` the largest
record count of a training document grows linearly from ``min_records`` to
``max_records`` and the longest document from ``min_doc_len`` to ``max_doc_len``
over the first ``ramp_steps`` steps: a document with one record teaches copying
the value, a few short ones teach the lookup by key (many documents per row, so
many answers per step), long ones stretch it to thousands of tokens.

Held-out evaluation (``eval_queries``: ``eval_docs`` documents in batches of
``global_batch`` rows) draws from a separate seed stream one document of
``seq_len`` tokens per row, with every record at least ``eval_min_distance``
tokens before the queries (less if ``seq_len`` leaves no room), so its accuracy
measures retrieval at long range only.

Tokens are bytes (0-255); 256 is BOS, 257 is padding. Several documents are
packed per row (see packing.py). The global batch of a step is a pure function
of (seed, step).
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass, fields

import torch

from bumblebee.data.packing import IGNORE, Batch, RowPacker, stack_rows

BOS, PAD = 256, 257
KEYS = string.ascii_uppercase


def min_doc_len(n_records: int, value_len: int) -> int:
    """Tokens of the shortest document: BOS, the records " K123;" and the queries "?K123\\n"."""
    return 1 + n_records * 2 * (value_len + 3)


def eval_distance_warning(data_cfg, seq_len: int) -> str | None:
    """A warning when a set ``eval_min_distance`` is more than rows of ``seq_len`` tokens hold
    (the held-out queries then ask at the largest distance the rows allow); None when it is met
    or is the default, which adapts to short rows by design."""
    default = next(f.default for f in fields(data_cfg) if f.name == "eval_min_distance")
    if data_cfg.source != "synthetic" or data_cfg.eval_min_distance == default:
        return None
    room = max(seq_len - min_doc_len(data_cfg.max_records, data_cfg.value_len), 0)
    if data_cfg.eval_min_distance <= room:
        return None
    return (
        f"data.eval_min_distance = {data_cfg.eval_min_distance} cannot be met in rows of "
        f"train.seq_len = {seq_len} tokens: held-out queries ask at distance >= {room}; raise "
        "train.seq_len or lower data.eval_min_distance"
    )


@dataclass
class EvalBatch:
    """Held-out rows plus, per token, the query its label belongs to (-1: none)."""

    batch: Batch
    query_ids: (
        torch.Tensor
    )  # [B, T] int64: query index (unique over the batch) of each answer label
    distances: list[int]  # per query: tokens from the record's value to the query's answer


class KeyValueRetrieval:
    def __init__(
        self,
        *,
        seq_len: int,
        global_batch: int,
        seed: int,
        min_records: int = 4,
        max_records: int = 16,
        min_doc_len: int = 64,
        max_doc_len: int = 4096,
        ramp_steps: int = 0,
        value_len: int = 3,
        eval_min_distance: int = 1024,
        eval_docs: int = 32,
    ):
        if not 1 <= min_records <= max_records <= len(KEYS):
            raise ValueError(
                f"the key-value task needs 1 <= min_records <= max_records <= {len(KEYS)}, "
                f"got {min_records}, {max_records}"
            )
        self.record_len, self.query_len = value_len + 3, value_len + 3  # " K123;" and "?K123\n"
        self.seq_len, self.global_batch, self.seed = seq_len, global_batch, seed
        self.min_records, self.max_records, self.value_len = min_records, max_records, value_len
        self.eval_min_distance, self.eval_docs, self._eval = eval_min_distance, eval_docs, None
        self.stats: dict = {}
        self.min_doc_len = max(min_doc_len, self.doc_len(min_records))
        self.max_doc_len, self.ramp_steps = max(max_doc_len, self.min_doc_len), ramp_steps
        if seq_len < self.min_doc_len:
            raise ValueError(
                f"the key-value task needs seq_len >= {self.min_doc_len} "
                f"({min_records} records and their queries), got {seq_len}"
            )

    def doc_len(self, n_records: int) -> int:
        """Shortest document with ``n_records`` records (no filler)."""
        return 1 + n_records * (self.record_len + self.query_len)

    def document(self, rng: random.Random, n_records: int, length: int, min_distance: int = 0):
        """(tokens, loss mask, [(answer start, distance) per query]) of one ``length``-token document
        whose records all sit >= ``min_distance`` tokens before the first query."""
        keys = rng.sample(KEYS, n_records)
        values = ["".join(rng.choices(string.digits, k=self.value_len)) for _ in keys]
        n_filler = length - self.doc_len(n_records)
        words, size = [], 0
        while size < n_filler:
            words.append("".join(rng.choices(string.ascii_lowercase, k=rng.randint(1, 8))) + " ")
            size += len(words[-1])
        filler = "".join(words)[:n_filler]
        # records go at random cut points of the filler, all within its first (n_filler - min_distance) chars
        cuts = sorted(rng.randint(0, max(0, n_filler - min_distance)) for _ in keys)
        body, value_at, prev = [], {}, 0
        for cut, key, value in zip(cuts, keys, values):
            body.append(filler[prev:cut])
            start = 1 + sum(map(len, body))  # BOS + text so far
            value_at[key] = start + 2  # " K" then the value
            body.append(f" {key}{value};")
            prev = cut
        body.append(filler[prev:])
        tokens = [BOS] + list("".join(body).encode())
        mask = [False] * len(tokens)
        answers = []
        order = list(range(n_records))
        rng.shuffle(order)
        for i in order:
            tokens += list(f"?{keys[i]}".encode())
            answers.append((len(tokens), len(tokens) - value_at[keys[i]]))
            tokens += list(values[i].encode()) + [ord("\n")]
        mask += [False] * (len(tokens) - len(mask))
        for start, _ in answers:
            mask[start : start + self.value_len] = [True] * self.value_len
        assert len(tokens) == length
        return tokens, mask, answers

    def _ramp(self, lo: int, hi: int, step: int) -> int:
        if self.ramp_steps <= 0 or step >= self.ramp_steps:
            return hi
        return lo + (hi - lo) * step // self.ramp_steps

    def max_doc_len_at(self, step: int) -> int:
        return self._ramp(self.min_doc_len, self.max_doc_len, step)

    def max_records_at(self, step: int) -> int:
        return self._ramp(self.min_records, self.max_records, step)

    def _plan(self, step: int, row: int) -> tuple[random.Random, list[tuple[int, int]]]:
        """(content RNG, [(length, records) per document]) of one row. The plan has its own RNG so
        that the label count of a step (``num_valid_at``) needs no document built."""
        base = ((self.seed * 1_000_003 + step) * 65_537 + row) * 2
        rng, plan, free = random.Random(base), [], self.seq_len
        top, top_records = min(self.max_doc_len_at(step), self.seq_len), self.max_records_at(step)
        while free >= self.doc_len(self.min_records):
            length = min(rng.randint(self.min_doc_len, max(top, self.min_doc_len)), free)
            n = rng.randint(self.min_records, top_records)
            while self.doc_len(n) > length:
                n -= 1
            plan.append((length, n))
            free -= length
        return random.Random(base + 1), plan

    def global_batch_at(self, step: int) -> Batch:
        return self.rows_at(step, 0, self.global_batch)

    def rows_at(self, step: int, lo: int, hi: int) -> Batch:
        """Rows [lo, hi) of the global batch of ``step``: each row is drawn from its own seeds,
        so a data-parallel rank builds only its own rows."""
        rows = []
        for row in range(lo, hi):
            rng, plan = self._plan(step, row)
            packer = RowPacker(self.seq_len, PAD)
            for length, n in plan:
                packer.add(*self.document(rng, n, length)[:2])
            rows.append(packer.finish())
        return stack_rows(rows)

    def num_valid_at(self, step: int) -> int:
        """Answer labels in the global batch of ``step`` (value_len per record), without building it."""
        return self.value_len * sum(
            n for row in range(self.global_batch) for _, n in self._plan(step, row)[1]
        )

    def eval_batch_list(self) -> list[Batch]:
        return [ev.batch for ev in self.eval_queries()]

    def eval_queries(self) -> list[EvalBatch]:
        """The held-out batches (``eval_docs`` documents, one per row, in batches of ``global_batch``
        rows), built once."""
        if self._eval is None:
            room = self.seq_len - self.doc_len(self.max_records)
            self._eval = (
                []
                if room < 0
                else [
                    self.eval_batch(
                        self.global_batch, min_distance=min(self.eval_min_distance, room), index=i
                    )
                    for i in range(-(-self.eval_docs // self.global_batch))
                ]
            )
        return self._eval

    def describe(self) -> str:
        return ""

    def eval_batch(self, rows: int, *, min_distance: int, index: int = 0) -> EvalBatch:
        """``rows`` held-out documents of ``seq_len`` tokens with ``max_records`` records each,
        from a seed stream disjoint from training; every record sits >= ``min_distance`` tokens
        before the queries. ``index`` picks another batch of the same stream."""
        if self.doc_len(self.max_records) + min_distance > self.seq_len:
            raise ValueError(
                f"seq_len {self.seq_len} is too short for records {min_distance} tokens "
                "before the queries"
            )
        rng = random.Random(
            f"bumblebee-eval:{self.seed}:{index}"
        )  # str seeds never meet the int seeds
        packed, qids, distances = [], [], []
        for _ in range(rows):
            tokens, mask, answers = self.document(rng, self.max_records, self.seq_len, min_distance)
            packer = RowPacker(self.seq_len, PAD)
            packer.add(tokens, mask)
            packed.append(packer.finish())
            q = [-1] * self.seq_len
            for (
                start,
                distance,
            ) in answers:  # labels[t] is token t + 1: an answer's labels sit one earlier
                q[start - 1 : start - 1 + self.value_len] = [len(distances)] * self.value_len
                distances.append(distance)
            qids.append(q)
        batch = stack_rows(packed)
        query_ids = torch.tensor(qids, dtype=torch.long)
        assert bool(((query_ids >= 0) == (batch.labels != IGNORE)).all())
        return EvalBatch(batch, query_ids, distances)
