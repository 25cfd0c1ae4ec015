"""Long documents split, not cut (``data.too_long = "split"``): every token of the corpus appears
exactly once in the packed rows, in order; each continuation is packed as a document (positions
from 0, its own mask, no label across a cut); the label counts the plan computes without reading
tokens match the built rows; the shares of tokens dropped and padded are reported (run start,
summary, ``data inspect``); ``"auto"`` splits text / tokens / jsonl and truncates chat."""

import io
import json
import random

import numpy as np
import pytest

from bumblebee.data.encode import Encoder
from bumblebee.data.jsonl import JsonlSource
from bumblebee.data.packing import IGNORE
from bumblebee.data.prepare import encode_in_memory, prepare
from bumblebee.data.store import from_documents, open_store
from bumblebee.data.stream import PackedRows, TokenSource


def corpus(seed: int, n: int, T: int, ones: bool):
    """Documents of 1..3.5 T tokens (ids unique over the corpus, so order is checkable), random masks."""
    rng, docs, nxt = random.Random(seed), [], 1
    for _ in range(n):
        k = rng.choice(
            [rng.randint(1, T // 2), rng.randint(T // 2, T), rng.randint(T + 1, 7 * T // 2)]
        )
        ids = list(range(nxt, nxt + k))
        nxt += k
        docs.append((ids, [1] * k if ones else [int(rng.random() < 0.6) for _ in range(k)]))
    return docs


def walk(b, T):
    """(tokens, [(first pos, piece tokens, labels)]) of a batch's non-padding pieces, row by row."""
    pieces = []
    for r in range(b.input_ids.shape[0]):
        ids, lab, pos = b.input_ids[r].tolist(), b.labels[r].tolist(), b.position_ids[r].tolist()
        starts = [t for t in range(T) if pos[t] == 0] + [T]
        for s, e in zip(starts, starts[1:]):
            if ids[s] == 0:  # the padding tail (id 0 is never a corpus token here)
                assert all(x == IGNORE for x in lab[s:e]) and all(x == 0 for x in ids[s:e])
                continue
            assert pos[s:e] == list(range(e - s))
            pieces.append((ids[s:e], lab[s:e]))
    return pieces


def check_split(docs, b, T, row_labels):
    """Token-exact: the pieces, in row order, are the corpus in order; labels follow each piece's mask."""
    tokens = [t for ids, _ in docs for t in ids]
    mask = {t: m for ids, ms in docs for t, m in zip(ids, ms)}
    length = {t: len(ids) for ids, _ in docs for t in ids}
    pieces = walk(b, T)
    assert [t for ids, _ in pieces for t in ids] == tokens  # every token once, in order
    for ids, lab in pieces:
        assert lab == [ids[i + 1] if mask[ids[i + 1]] else IGNORE for i in range(len(ids) - 1)] + [
            IGNORE
        ]
        if len(ids) < length[ids[0]] and ids[0] - 1 in length and length[ids[0]] <= T:
            raise AssertionError("a document that fits in a row was cut")
    assert row_labels.tolist() == [
        int((b.labels[r] != IGNORE).sum()) for r in range(b.labels.shape[0])
    ]
    return pieces


@pytest.mark.parametrize(
    "ones", [True, False]
)  # all-ones masks (text: counted without reading) or read
def test_split_is_token_exact(ones):
    T = 32
    docs = corpus(1 + ones, 60, T, ones)
    store = from_documents(docs, {"kind": "tokens"})
    rows = PackedRows(store, T, "split")
    b = rows.build(np.arange(rows.num_rows))
    pieces = check_split(docs, b, T, rows.row_labels)
    long = sum(len(ids) > T for ids, _ in docs)
    s = rows.stats
    assert s["split"] == long > 10 and s["truncated"] == s["dropped"] == s["dropped_tokens"] == 0
    assert s["documents"] == 60 and s["pieces"] == len(pieces) and s["rows"] == rows.num_rows
    n = sum(len(ids) for ids, _ in docs)
    assert s["padding_tokens"] == rows.num_rows * T - n == int((b.input_ids == 0).sum())
    # a split document fills what is left of its row: a row has padding only when the next row
    # starts with a whole document longer than that padding
    start_of = {ids[0]: len(ids) for ids, _ in docs}
    for r in range(rows.num_rows - 1):
        pad, first = int((b.input_ids[r] == 0).sum()), int(b.input_ids[r + 1, 0])
        assert pad == 0 or (first in start_of and pad < start_of[first] <= T)


def test_truncate_and_drop_report_their_cost():
    T = 16
    docs = [
        (list(range(1, 6)), [1] * 5),
        (list(range(6, 46)), [1] * 40),
        (list(range(46, 49)), [1] * 3),
    ]
    store = from_documents(docs, {"kind": "text"})
    cut = PackedRows(store, T, "truncate").stats
    assert (cut["truncated"], cut["dropped_tokens"], cut["rows"]) == (1, 24, 3)  # 5 | 16 | 3
    assert cut["dropped_share"] == pytest.approx(24 / 48) and cut["padding_share"] == pytest.approx(
        24 / 48
    )
    drop = PackedRows(store, T, "drop").stats
    assert (drop["dropped"], drop["dropped_tokens"], drop["documents"]) == (1, 40, 2)
    split = PackedRows(store, T).stats  # auto = split for text
    assert (split["split"], split["dropped_tokens"], split["rows"]) == (1, 0, 3)
    assert split["padding_share"] == pytest.approx(
        0 / 48
    )  # 5 + 11 | 16 | 13 + 3: no padding at all
    assert PackedRows(from_documents(docs, {"kind": "chat"}), T).too_long == "truncate"


def test_jsonl_split_is_token_exact(tmp_path):
    T = 24
    docs = corpus(5, 40, T, ones=False)
    f = tmp_path / "d.jsonl"
    f.write_text("".join(json.dumps({"input_ids": ids, "loss_mask": m}) + "\n" for ids, m in docs))
    vocab = sum(len(ids) for ids, _ in docs) + 1
    src = JsonlSource(str(f), seq_len=T, global_batch=2, seed=0, vocab_size=vocab)
    b = src.all_rows()
    check_split(docs, b, T, np.array(src.valid))
    assert (
        src.stats["split"] == sum(len(ids) > T for ids, _ in docs)
        and src.stats["dropped_tokens"] == 0
    )
    assert "tokens dropped 0.0%" in src.describe()
    drop = JsonlSource(str(f), seq_len=T, global_batch=2, seed=0, vocab_size=vocab, too_long="drop")
    assert (
        drop.stats["dropped"] == src.stats["split"]
        and drop.stats["documents"] == 40 - drop.stats["dropped"]
    )


def test_split_source_start_line_and_inspect(tmp_path):
    """A text run splits by default; the share of tokens dropped or padded is on the start line and in
    ``data inspect``; one global batch's label count is read from the plan."""
    from bumblebee.data.cli import inspect

    T = 16
    docs = corpus(9, 30, T, ones=True)
    f = tmp_path / "t.jsonl"
    f.write_text("".join(json.dumps({"input_ids": ids}) + "\n" for ids, _ in docs))
    prepare(str(f), str(tmp_path / "p"), Encoder("tokens"), progress=False)
    src = TokenSource(
        open_store(str(tmp_path / "p")), seq_len=T, global_batch=4, seed=0, vocab_size=10**5
    )
    assert src.rows.too_long == "split" and src.stats["dropped_tokens"] == 0
    assert src.num_valid_at(3) == src.global_batch_at(3).num_valid
    pad = 100 * src.stats["padding_share"]
    assert (
        f"{src.stats['split']} split; tokens dropped 0.0%, padding {pad:.1f}% of row tokens"
        in src.describe()
    )
    out = io.StringIO()
    inspect(str(tmp_path / "p"), seq_len=T, row=0, tokenizer=None, stream=out)
    assert (
        f"long documents (split): {src.stats['split']} split; tokens dropped 0.0%" in out.getvalue()
    )
    out = io.StringIO()
    inspect(str(tmp_path / "p"), seq_len=T, row=0, tokenizer=None, stream=out, too_long="truncate")
    share = 100 * sum(max(len(ids) - T, 0) for ids, _ in docs) / sum(len(ids) for ids, _ in docs)
    assert f"truncated; tokens dropped {share:.1f}%" in out.getvalue()


def test_text_encoded_corpus_split_token_exact(tmp_path):
    """Real text through a tokenizer: long texts come back whole from the split rows."""
    from data_helpers import make_tokenizer, sentence

    tok = make_tokenizer(tmp_path / "tok")
    rng = random.Random(2)
    recs = [
        {"text": ". ".join(sentence(rng, 4, 12) for _ in range(rng.randint(1, 12)))}
        for _ in range(20)
    ]
    f = tmp_path / "t.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in recs))
    store = encode_in_memory(str(f), Encoder("text", tok))
    rows = PackedRows(store, 32)
    assert rows.stats["split"] > 3
    b = rows.build(np.arange(rows.num_rows))
    used = [
        int(rows.piece_len[rows.row_ptr[r] : rows.row_ptr[r + 1]].sum())
        for r in range(rows.num_rows)
    ]
    flat = [
        t for r in range(rows.num_rows) for t in b.input_ids[r, : used[r]].tolist()
    ]  # EOS = pad id here
    assert flat == store.tokens.tolist()
    assert rows.row_labels.tolist() == [
        int((b.labels[r] != IGNORE).sum()) for r in range(rows.num_rows)
    ]
