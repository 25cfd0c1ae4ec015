"""Which pieces of which documents each packed row holds, and what packing cost.

Documents are packed greedily in order into rows of ``seq_len`` tokens. A
document that fits in a row is never cut: if it does not fit in what is left of
the current row it starts the next one. A document longer than ``seq_len``
follows ``too_long``:

- ``"split"``: cut at row boundaries into continuations (its first piece fills
  what is left of the current row, full rows follow, the last piece starts the
  next row and packs with the documents after it), as Megatron-LM's GPT dataset
  and torchtitan concatenate and split. Every token is trained on once, in order;
  each continuation is packed as a document of its own (positions from 0, its
  own loss mask, no label across the cut), so a split costs one label per cut;
- ``"truncate"``: its first ``seq_len`` tokens, the rest never trained on;
- ``"drop"``: left out.

``"auto"`` is ``"split"`` except for chat data (a conversation's continuation would
lose its system prompt and question): ``"truncate"``. The plan only needs document
lengths; callers count each piece's labels. ``stats`` reports the share of tokens
dropped and of row tokens that are padding.
"""

from __future__ import annotations

from array import array

from bumblebee.data.errors import DataError

TOO_LONG = ("auto", "split", "truncate", "drop")


def resolve_too_long(too_long: str, kind: str | None) -> str:
    """``too_long`` with ``"auto"`` made concrete for data of ``kind`` (tokens | text | chat | jsonl)."""
    if too_long not in TOO_LONG:
        raise DataError(f"data.too_long must be one of {', '.join(TOO_LONG)}; got {too_long!r}")
    if too_long != "auto":
        return too_long
    return "truncate" if kind == "chat" else "split"


class RowPlan:
    """Pieces in packing order (``doc``, ``start`` within the document, ``length``); row r holds
    pieces ``row_ptr[r]:row_ptr[r + 1]``. Feed documents with ``add``, then call ``finish``."""

    def __init__(self, seq_len: int, too_long: str):
        assert too_long in TOO_LONG[1:], too_long
        self.seq_len, self.too_long = seq_len, too_long
        self.doc, self.start, self.length = array("q"), array("q"), array("q")
        self.row_ptr = array("q", [0])
        self.free = seq_len
        self.counts = {
            "documents": 0,
            "split": 0,
            "truncated": 0,
            "dropped": 0,
            "tokens": 0,
            "dropped_tokens": 0,
        }

    def _piece(self, doc: int, start: int, n: int) -> None:
        if n > self.free:  # does not fit: close the row (never an empty one)
            self.row_ptr.append(len(self.doc))
            self.free = self.seq_len
        self.doc.append(doc)
        self.start.append(start)
        self.length.append(n)
        self.free -= n

    def add(self, doc: int, n: int) -> list[tuple[int, int]]:
        """Plan document ``doc`` of ``n`` tokens; returns its pieces as (start, length)."""
        c, T = self.counts, self.seq_len
        c["tokens"] += n
        if n <= T:
            pieces = [(0, n)]
        elif self.too_long == "drop":
            c["dropped"] += 1
            c["dropped_tokens"] += n
            return []
        elif self.too_long == "truncate":
            c["truncated"] += 1
            c["dropped_tokens"] += n - T
            pieces = [(0, T)]
        else:  # split: fill the current row, then whole rows, the rest starts the next row
            c["split"] += 1
            first = self.free if 0 < self.free < T else T
            pieces = [(0, first)] + [(s, min(T, n - s)) for s in range(first, n, T)]
        c["documents"] += 1
        for s, k in pieces:
            self._piece(doc, s, k)
        return pieces

    def finish(self) -> RowPlan:
        if self.row_ptr[-1] != len(self.doc):
            self.row_ptr.append(len(self.doc))
        return self

    @property
    def num_rows(self) -> int:
        return len(self.row_ptr) - 1

    @property
    def stats(self) -> dict:
        """Counts, plus the share of the corpus's tokens never trained on (truncated or dropped)
        and the share of row tokens that are padding."""
        c = dict(self.counts)
        packed = c["tokens"] - c["dropped_tokens"]
        room = self.num_rows * self.seq_len
        c.update(
            rows=self.num_rows,
            pieces=len(self.doc),
            padding_tokens=room - packed,
            dropped_share=c["dropped_tokens"] / max(c["tokens"], 1),
            padding_share=(room - packed) / max(room, 1),
        )
        return c


def describe_cost(stats: dict, too_long: str) -> str:
    """One phrase: what too-long documents became and what packing cost."""
    s = stats
    what = {
        "split": f"{s['split']} split",
        "truncated": f"{s['truncated']} truncated",
        "dropped": f"{s['dropped']} dropped",
    }
    done = ", ".join(v for k, v in what.items() if s[k]) or "none over the row length"
    return (
        f"long documents ({too_long}): {done}; tokens dropped {100 * s['dropped_share']:.1f}%, "
        f"padding {100 * s['padding_share']:.1f}% of row tokens"
    )
