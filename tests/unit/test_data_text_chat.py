"""Text and chat data through a locally built tokenizer: which tokens are targets (checked token by
token against an independent ChatML rendering), readers for JSONL / Parquet / datasets
directories, the memory-mapped store, rows read per rank, and bad records."""

import json
import random

import numpy as np
import pytest
from data_helpers import conversation, make_tokenizer

from bumblebee.data.encode import Encoder
from bumblebee.data.errors import BadRecord, DataError
from bumblebee.data.packing import IGNORE
from bumblebee.data.prepare import encode_in_memory, prepare
from bumblebee.data.store import open_store
from bumblebee.data.stream import PackedRows, TokenSource


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer")


def expected_chatml(tok, msgs):
    """(ids, mask) built piece by piece: role headers are never targets; an assistant turn's content,
    its <|im_end|> and the newline after it are."""
    ids, mask = [], []
    for m in msgs:
        head = tok.encode(f"<|im_start|>{m['role']}\n", add_special_tokens=False)
        body = tok.encode(f"{m['content']}<|im_end|>\n", add_special_tokens=False)
        ids += head + body
        mask += [0] * len(head) + [int(m["role"] == "assistant")] * len(body)
    return ids, mask


def test_chat_mask_token_by_token(tok_dir):
    enc = Encoder("chat", tok_dir)
    rng = random.Random(3)
    for _ in range(20):
        rec = conversation(rng, turns=rng.randint(1, 3), system=rng.random() < 0.5)
        ids, mask = enc.encode(rec)
        want_ids, want_mask = expected_chatml(enc.tok, rec["messages"])
        assert ids == want_ids
        assert mask == want_mask
    # the targets decode to exactly the assistant turns
    rec = {
        "messages": [
            {"role": "user", "content": "the fox"},
            {"role": "assistant", "content": "seven bees"},
            {"role": "user", "content": "a dog"},
            {"role": "assistant", "content": "red flowers"},
        ]
    }
    ids, mask = enc.encode(rec)
    assert (
        enc.tok.decode([i for i, m in zip(ids, mask) if m])
        == "seven bees<|im_end|>\nred flowers<|im_end|>\n"
    )
    ids_all, mask_all = Encoder("chat", tok_dir, chat_loss="all").encode(rec)
    assert ids_all == ids and all(mask_all)


def test_text_appends_eos_once(tok_dir):
    enc = Encoder("text", tok_dir)
    ids, mask = enc.encode({"text": "the quick fox"})
    eos = enc.tok.eos_token_id
    assert ids[-1] == eos and ids.count(eos) == 1 and all(mask)
    assert enc.tok.decode(ids[:-1]) == "the quick fox"
    ids2, _ = enc.encode({"text": "the quick fox<|endoftext|>"})
    assert ids2 == ids  # already ends with EOS: not doubled


def test_packed_labels_are_assistant_tokens(tok_dir, tmp_path):
    path = tmp_path / "chat.jsonl"
    rng = random.Random(0)
    recs = [conversation(rng) for _ in range(12)]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    enc = Encoder("chat", tok_dir)
    store = encode_in_memory(str(path), enc)
    rows = PackedRows(store, seq_len=256)
    b = rows.build(np.arange(rows.num_rows))
    expected = [expected_chatml(enc.tok, r["messages"]) for r in recs]
    # walk the packed rows document by document: label[t] = token t+1 exactly where t+1 is an assistant token
    d = 0
    for r in range(rows.num_rows):
        ids, labels, pos = b.input_ids[r].tolist(), b.labels[r].tolist(), b.position_ids[r].tolist()
        starts = [t for t in range(len(ids)) if pos[t] == 0]
        for s in starts[: int(rows.row_ptr[r + 1] - rows.row_ptr[r])]:
            want_ids, want_mask = expected[d]
            n = len(want_ids)
            assert ids[s : s + n] == want_ids
            want_labels = [
                want_ids[t + 1] if want_mask[t + 1] else IGNORE for t in range(n - 1)
            ] + [IGNORE]
            assert labels[s : s + n] == want_labels
            d += 1
        assert all(x == IGNORE for x in labels[s + n :])  # padding after the last document
    assert d == len(recs)


def test_parquet_and_datasets_dir_match_jsonl(tok_dir, tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(1)
    recs = [conversation(rng) for _ in range(30)]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    pq.write_table(pa.Table.from_pylist(recs), tmp_path / "c.parquet", row_group_size=7)
    datasets.Dataset.from_list(recs).save_to_disk(str(tmp_path / "ds"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(recs)}).save_to_disk(
        str(tmp_path / "dd")
    )
    enc = Encoder("chat", tok_dir)
    ref = encode_in_memory(str(tmp_path / "c.jsonl"), enc)
    for p in ("c.parquet", "ds", "dd"):
        got = encode_in_memory(str(tmp_path / p), enc)
        assert np.array_equal(got.tokens, ref.tokens) and np.array_equal(got.mask, ref.mask)
        assert np.array_equal(got.offsets, ref.offsets)


def test_prepare_is_independent_of_workers_and_memory_maps(tok_dir, tmp_path):
    rng = random.Random(2)
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps(conversation(rng)) + "\n" for _ in range(600)))
    enc = Encoder("chat", tok_dir)
    m1 = prepare(str(path), str(tmp_path / "w1"), enc, workers=1, progress=False)
    m2 = prepare(str(path), str(tmp_path / "w2"), enc, workers=2, progress=False)
    s1, s2 = open_store(str(tmp_path / "w1")), open_store(str(tmp_path / "w2"))
    assert isinstance(s1.tokens, np.memmap)
    assert m1["documents"] == 600 and m1["tokens"] == m2["tokens"] == len(s1.tokens)
    for a, b in (
        (s1.tokens, s2.tokens),
        (s1.mask, s2.mask),
        (s1.offsets, s2.offsets),
        (s1.doc_loss, s2.doc_loss),
    ):
        assert np.array_equal(a, b)
    mem = encode_in_memory(str(path), enc)
    assert np.array_equal(mem.tokens, s1.tokens) and np.array_equal(mem.doc_loss, s1.doc_loss)
    with pytest.raises(DataError, match="already holds prepared data"):
        prepare(str(path), str(tmp_path / "w1"), enc, progress=False)


class Recorder:
    """A token array that records which slices are read."""

    def __init__(self, arr):
        self.arr, self.reads = arr, []

    def __getitem__(self, s):
        self.reads.append((s.start, s.stop))
        return self.arr[s]

    def __len__(self):
        return len(self.arr)


def test_tokens_source_reads_only_the_rows_asked_for(tmp_path):
    path = tmp_path / "t.jsonl"
    rng = random.Random(0)
    path.write_text(
        "".join(
            json.dumps({"input_ids": [rng.randrange(1, 50) for _ in range(rng.randint(3, 40))]})
            + "\n"
            for _ in range(200)
        )
    )
    prepare(str(path), str(tmp_path / "out"), Encoder("tokens"), progress=False)

    def mk():
        store = open_store(str(tmp_path / "out"))
        return TokenSource(store, seq_len=64, global_batch=8, seed=5, vocab_size=64)

    src = mk()
    for step in (0, 3, 40):  # 40: several epochs in
        full = src.global_batch_at(step)
        halves = [mk().rows_at(step, 0, 4), mk().rows_at(step, 4, 8)]  # fresh sources: resume-safe
        for name in ("input_ids", "labels", "position_ids"):
            assert full.__dict__[name][:4].equal(halves[0].__dict__[name])
            assert full.__dict__[name][4:].equal(halves[1].__dict__[name])
        assert src.num_valid_at(step) == full.num_valid
    assert not src.global_batch_at(0).input_ids.equal(src.global_batch_at(1).input_ids)
    # a rank asking for rows 2..3 reads the tokens of those rows' documents and nothing else
    rec = Recorder(src.rows.store.tokens)
    src.rows.store.tokens = rec
    rows = src._global_rows(7)[2:4]
    src.rows_at(7, 2, 4)
    pieces = [k for r in rows for k in range(src.rows.row_ptr[r], src.rows.row_ptr[r + 1])]
    assert rec.reads == [
        (int(src.rows.start[k]), int(src.rows.start[k] + src.rows.piece_len[k])) for k in pieces
    ]


def test_over_long_documents_truncate_or_drop(tmp_path):
    path = tmp_path / "t.jsonl"
    docs = [list(range(1, 6)), list(range(1, 30)), [7, 8, 9]]
    path.write_text("".join(json.dumps({"input_ids": d}) + "\n" for d in docs))
    store = encode_in_memory(str(path), Encoder("tokens"))
    cut = PackedRows(store, seq_len=16, too_long="truncate")
    assert cut.stats["truncated"] == 1 and cut.stats["dropped"] == 0
    b = cut.build(np.arange(cut.num_rows))
    assert b.input_ids[1].tolist() == list(range(1, 17))  # the first 16 tokens of the long document
    assert cut.row_labels.tolist() == [
        int((b.labels[r] != IGNORE).sum()) for r in range(cut.num_rows)
    ]
    drop = PackedRows(store, seq_len=16, too_long="drop")
    assert drop.stats["dropped"] == 1 and drop.stats["documents"] == 2 and drop.num_rows == 1
    assert drop.build(np.arange(1)).input_ids[0, :8].tolist() == [1, 2, 3, 4, 5, 7, 8, 9]


BAD = [
    (
        '{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\nnot json\n',
        ":2: not valid JSON",
    ),
    ('{"text": "hello"}\n', ":1: missing field 'messages'"),
    ('{"messages": []}\n', ":1: empty conversation"),
    (
        '{"messages": [{"role": "user", "content": "only a question"}]}\n',
        ":1: no assistant message",
    ),
    (
        '{"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "b"}]}\n',
        ":1: message 0:",
    ),
    (b'{"messages": "\xff\xfe"}\n', ":1: not UTF-8 text"),
    ("[1, 2]\n", ":1: expected a JSON object"),
]


@pytest.mark.parametrize("text,msg", BAD)
def test_bad_chat_records_say_file_line_reason(tok_dir, tmp_path, text, msg):
    path = tmp_path / "bad.jsonl"
    (path.write_bytes if isinstance(text, bytes) else path.write_text)(text)
    enc = Encoder("chat", tok_dir)
    with pytest.raises(DataError, match=f"^{path}{msg}"):
        encode_in_memory(str(path), enc)


def test_skip_counts_bad_records(tok_dir, tmp_path):
    path = tmp_path / "mixed.jsonl"
    good = json.dumps(conversation(random.Random(0)))
    path.write_bytes(
        "\n".join([good, "not json", '{"messages": []}', good, '{"messages": []}', ""]).encode()
        + b'{"messages": "\xff"}\n'
    )
    enc = Encoder("chat", tok_dir)
    store = encode_in_memory(str(path), enc, on_error="skip")
    assert store.num_docs == 2
    assert store.meta["skipped"] == {
        "not valid JSON": 1,
        "empty conversation": 2,
        "not UTF-8 text": 1,
    }
    assert store.meta["skipped_total"] == 4


def test_bad_parquet_row_and_tokens_records(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.Table.from_pylist([{"input_ids": [1, 2]}, {"input_ids": []}]), tmp_path / "t.parquet"
    )
    with pytest.raises(DataError, match=r"t.parquet:row 2: 'input_ids' must be a non-empty list"):
        encode_in_memory(str(tmp_path / "t.parquet"), Encoder("tokens"))
    with pytest.raises(BadRecord, match="'loss_mask' must be"):
        Encoder("tokens").encode({"input_ids": [1, 2], "loss_mask": [1]})
    store = encode_in_memory(str(tmp_path / "t.parquet"), Encoder("tokens"), on_error="skip")
    with pytest.raises(DataError, match="token id 2 outside the model's vocabulary"):
        TokenSource(store, seq_len=8, global_batch=1, seed=0, vocab_size=2)


def test_tokenizer_errors(tmp_path):
    with pytest.raises(DataError, match="need a tokenizer"):
        Encoder("text", "")
    with pytest.raises(DataError, match="no tokenizer.json"):
        Encoder("chat", str(tmp_path))
