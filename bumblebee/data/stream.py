"""Packed rows over a token store, read row by row: each rank builds only the rows it trains on.

Documents are packed greedily in stored order into rows of ``seq_len`` tokens
(positions restart at every document, labels never cross a document, the tail is
unlabelled padding; the same rules as packing.py). A document longer than
``seq_len`` is split into continuations, cut, or left out (``too_long``,
rowplan.py); all three are counted, with the share of tokens dropped and padded.
The packing plan needs only the document lengths and per-document label counts
(store.py), so building it reads no tokens (a split or truncated document's
labels are counted from its mask unless every mask is all ones).

Step s of the run trains on global rows s*B .. s*B+B-1 of an endless stream of
per-epoch shuffles of the training rows (``numpy`` PCG64 seeded with
(seed, epoch)): a pure function of (seed, step), so every layout sees the same
stream and a resumed run continues it. ``rows_at(step, lo, hi)`` reads rows
lo..hi-1 of that global batch only; ``num_valid_at(step)`` counts the global
batch's labels from the plan, without reading tokens.

Held-out rows (``eval_fraction``) are a fixed seeded subset of the rows, never
trained on.

Legend: B global batch rows, T = seq_len.
"""

from __future__ import annotations

import numpy as np
import torch

from bumblebee.data.errors import DataError
from bumblebee.data.packing import IGNORE, Batch
from bumblebee.data.rowplan import RowPlan, describe_cost, resolve_too_long
from bumblebee.data.store import TokenStore


class PackedRows:
    """The rows of one store (plan only; tokens are read when a row is built)."""

    def __init__(self, store: TokenStore, seq_len: int, too_long: str = "auto", pad_id: int = 0):
        self.store, self.seq_len, self.pad_id = store, seq_len, pad_id
        self.too_long = resolve_too_long(too_long, store.meta.get("kind"))
        lengths, offsets = store.lengths, store.offsets
        # text data (and any store whose masks are all ones past each document's first token):
        # a piece of n tokens has n - 1 labels, no mask read needed
        ones = int(store.doc_loss.sum()) == len(store.tokens) - store.num_docs
        plan, labels = RowPlan(seq_len, self.too_long), []
        for d, n in enumerate(lengths.tolist()):
            pieces = plan.add(d, n)
            if len(pieces) == 1 and pieces[0][1] == n:  # whole
                labels.append(int(store.doc_loss[d]))
            elif pieces:
                if ones:
                    labels += [k - 1 for _, k in pieces]
                    continue
                s = int(offsets[d])
                c = np.cumsum(np.asarray(store.mask[s : s + n], dtype=np.int64))
                labels += [
                    int(c[a + k - 1] - c[a]) for a, k in pieces
                ]  # mask[a+1:a+k]: no label at a cut
        plan.finish()
        self.plan = plan
        docs = np.asarray(plan.doc, dtype=np.int64)
        self.start = offsets[:-1][docs] + np.asarray(
            plan.start, dtype=np.int64
        )  # every piece's first token
        self.piece_len = np.asarray(plan.length, dtype=np.int64)
        self.row_ptr = np.asarray(plan.row_ptr, dtype=np.int64)
        csum = np.concatenate([[0], np.cumsum(np.asarray(labels, dtype=np.int64))])
        self.row_labels = csum[self.row_ptr[1:]] - csum[self.row_ptr[:-1]]
        self.stats = plan.stats

    @property
    def num_rows(self) -> int:
        return len(self.row_ptr) - 1

    def build(self, rows: np.ndarray) -> Batch:
        """Rows (by index) as a [len(rows), T] batch."""
        T = self.seq_len
        ids = np.full((len(rows), T), self.pad_id, dtype=np.int64)
        labels = np.full((len(rows), T), IGNORE, dtype=np.int64)
        pos = np.zeros((len(rows), T), dtype=np.int64)
        for b, r in enumerate(rows.tolist()):
            t = 0
            for k in range(int(self.row_ptr[r]), int(self.row_ptr[r + 1])):
                n, s = int(self.piece_len[k]), int(self.start[k])
                tok = np.asarray(self.store.tokens[s : s + n], dtype=np.int64)
                m = np.asarray(self.store.mask[s + 1 : s + n], dtype=bool)
                ids[b, t : t + n] = tok
                labels[b, t : t + n - 1] = np.where(m, tok[1:], IGNORE)
                pos[b, t : t + n] = np.arange(n)
                t += n
            pos[b, t:] = np.arange(T - t)  # padding: its own pseudo-document
        return Batch(torch.from_numpy(ids), torch.from_numpy(labels), torch.from_numpy(pos))


class TokenSource:
    """Training batches (and held-out batches) from a token store."""

    def __init__(
        self,
        store: TokenStore,
        *,
        seq_len: int,
        global_batch: int,
        seed: int,
        vocab_size: int,
        too_long: str = "auto",
        eval_fraction: float = 0.0,
        eval_store: TokenStore | None = None,
        eval_batches: int = 1,
    ):
        for s in (store, eval_store):
            if s is not None and s.meta.get("max_token_id", -1) >= vocab_size:
                # the prepared directory holds the id; its source file is only where it came from
                where = s.location or s.meta.get("source", "data")
                origin = (
                    f" (prepared from {s.meta['source']})"
                    if s.location and "source" in s.meta
                    else ""
                )
                raise DataError(
                    f"{where}{origin}: token id {s.meta['max_token_id']} outside the model's "
                    f"vocabulary [0, {vocab_size}); the tokenizer does not match the model"
                )
        self.global_batch, self.seed, self.eval_batches = global_batch, seed, eval_batches
        self.vocab_size, self.name = vocab_size, store.meta.get("source", "data")
        self.store_max = store.meta.get("max_token_id")
        self.rows = PackedRows(store, seq_len, too_long)
        n = self.rows.num_rows
        self.train_rows = np.arange(n, dtype=np.int64)
        self.eval_rows, self.eval_pack = np.zeros(0, np.int64), self.rows
        if eval_store is not None:
            self.eval_pack = PackedRows(eval_store, seq_len, too_long)
            self.eval_rows = np.arange(self.eval_pack.num_rows, dtype=np.int64)
        elif eval_fraction > 0:
            k = max(1, int(round(eval_fraction * n)))
            perm = np.random.default_rng([seed, 0xE7A1]).permutation(n)
            self.eval_rows, self.train_rows = np.sort(perm[:k]), np.sort(perm[k:])
        if len(self.train_rows) == 0:
            raise DataError(
                f"{store.meta.get('source', 'data')}: no training rows "
                f"({store.num_docs} documents, {n} rows of {seq_len} tokens after the held-out split)"
            )
        self._perms: dict[int, np.ndarray] = {}
        meta = store.meta
        self.stats = {
            **self.rows.stats,
            "train_rows": len(self.train_rows),
            "eval_rows": len(self.eval_rows),
            "skipped": meta.get("skipped_total", 0),
        }
        if meta.get("skipped"):
            self.stats["skipped_by_reason"] = meta["skipped"]
        if meta.get(
            "notes"
        ):  # records used with a remark (chat: rendered per turn, tool calls not rendered)
            self.stats["notes"] = meta["notes"]

    def describe(self) -> str:
        s = self.stats
        extra = f", {s['eval_rows']} held out" if s["eval_rows"] else ""
        why = lambda d: " (" + ", ".join(f"{k}: {v}" for k, v in d.items()) + ")"  # noqa: E731
        skipped = f"skipped {s['skipped']}" + (
            why(s["skipped_by_reason"]) if s.get("skipped_by_reason") else ""
        )
        notes = "".join(f"; records {k}: {v}" for k, v in s.get("notes", {}).items())
        return (
            f"data: {s['documents']} documents in {s['rows']} rows of {self.rows.seq_len} tokens{extra}; "
            f"{skipped}; {describe_cost(s, self.rows.too_long)}{notes}"
        )

    def _global_rows(self, step: int) -> np.ndarray:
        n, B = len(self.train_rows), self.global_batch
        out = np.empty(B, dtype=np.int64)
        for i, g in enumerate(range(step * B, (step + 1) * B)):
            epoch = g // n
            if epoch not in self._perms:
                if len(self._perms) > 2:
                    self._perms.pop(min(self._perms))
                self._perms[epoch] = self.train_rows[
                    np.random.default_rng([self.seed, epoch]).permutation(n)
                ]
            out[i] = self._perms[epoch][g % n]
        return out

    def rows_at(self, step: int, lo: int, hi: int) -> Batch:
        """Rows lo..hi-1 of step's global batch (only these are read)."""
        return self._in_vocab(self.rows.build(self._global_rows(step)[lo:hi]))

    def _in_vocab(self, batch: Batch) -> Batch:
        """meta.json's max_token_id is checked up front, but the metadata may not match the tokens
        (edited, or files mixed): each built batch is checked too (one max over its ids), so a
        foreign id is a one-line error instead of an IndexError inside the embedding."""
        top = int(batch.input_ids.max()) if batch.input_ids.numel() else -1
        if top >= self.vocab_size:
            raise DataError(
                f"{self.name}: token id {top} outside the model's vocabulary [0, {self.vocab_size}), "
                f"although meta.json's max_token_id is {self.store_max}; the corpus does not match "
                f"its metadata (prepare it again)"
            )
        return batch

    def num_valid_at(self, step: int) -> int:
        return int(self.rows.row_labels[self._global_rows(step)].sum())

    def global_batch_at(self, step: int) -> Batch:
        return self.rows_at(step, 0, self.global_batch)

    def eval_batch_list(self) -> list[Batch]:
        """Held-out global batches: the first ``eval_batches`` x B held-out rows (fewer if fewer exist)."""
        B = self.global_batch
        rows = self.eval_rows[: self.eval_batches * B]
        out = []
        for i in range(0, len(rows), B):
            b = self.eval_pack.build(rows[i : i + B])
            short = B - b.input_ids.shape[0]  # the last batch: unlabelled padding rows up to B
            if short:
                T = self.rows.seq_len
                b = Batch(
                    torch.cat([b.input_ids, torch.zeros(short, T, dtype=torch.long)]),
                    torch.cat([b.labels, torch.full((short, T), IGNORE, dtype=torch.long)]),
                    torch.cat([b.position_ids, torch.arange(T).expand(short, T)]),
                )
            out.append(self._in_vocab(b))
        return out
