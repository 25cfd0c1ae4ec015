"""Data: packing (labels, positions, padding), the synthetic task, the JSONL loader."""

import json

import pytest

from bumblebee.data.jsonl import DataError, JsonlSource, read_samples
from bumblebee.data.packing import IGNORE, RowPacker
from bumblebee.data.synthetic import BOS, KeyValueRetrieval


def test_row_packer_labels_and_positions():
    p = RowPacker(10, pad_id=0)
    p.add([5, 6, 7], [False, True, True])
    p.add([8, 9], [False, True])
    ids, labels, pos = p.finish()
    assert ids == [5, 6, 7, 8, 9, 0, 0, 0, 0, 0]
    assert pos == [0, 1, 2, 0, 1, 0, 1, 2, 3, 4]
    # target of t is token t+1 of the same document, only where marked; never across documents
    assert labels == [6, 7, IGNORE, 9, IGNORE] + [IGNORE] * 5


def test_synthetic_answer_is_retrievable_and_deterministic():
    src = KeyValueRetrieval(seq_len=1024, global_batch=3, seed=1, max_doc_len=400)
    b1, b2 = src.global_batch_at(5), src.global_batch_at(5)
    assert b1.input_ids.equal(b2.input_ids) and not b1.input_ids.equal(
        src.global_batch_at(6).input_ids
    )
    assert src.rows_at(5, 1, 3).input_ids.equal(
        b1.input_ids[1:3]
    )  # a rank can build its rows alone
    row, labels = b1.input_ids[0].tolist(), b1.labels[0].tolist()
    starts = [i for i, t in enumerate(row) if t == BOS]
    assert len(starts) >= 2  # several documents per row
    doc = bytes(t for t in row[starts[0] + 1 : starts[1]]).decode()
    body, *queries = doc.rstrip("\n").split("?")
    assert len(queries) >= 4  # every record is asked about
    for q in queries:
        key, value = q.strip()[0], q.strip()[1:]
        assert (
            len(value) == 3 and f" {key}{value};" in body and body.count(f" {key}") == 1
        )  # stated once, earlier
    targets = [labels[i] for i in range(starts[0], starts[1]) if labels[i] != IGNORE]
    assert bytes(targets).decode() == "".join(q.strip()[1:] for q in queries)


def test_synthetic_curriculum_and_held_out_distances():
    src = KeyValueRetrieval(
        seq_len=2048,
        global_batch=2,
        seed=0,
        min_records=1,
        max_records=16,
        min_doc_len=16,
        max_doc_len=2048,
        ramp_steps=100,
    )
    docs = lambda step: int((src.global_batch_at(step).input_ids == BOS).sum())  # noqa: E731
    assert docs(0) > 4 * docs(200)  # short documents first, then long ones
    ev = src.eval_batch(2, min_distance=1024)
    assert len(ev.distances) == 32 and min(ev.distances) >= 1024
    assert ev.batch.input_ids.shape == (2, 2048)
    assert not ev.batch.input_ids.equal(
        src.eval_batch(2, min_distance=1024, index=1).batch.input_ids
    )
    # every answer label belongs to exactly one query, every query has value_len labels
    q = ev.query_ids[ev.query_ids >= 0]
    assert q.bincount().tolist() == [3] * 32


def test_jsonl_packing_exact_rows_and_errors(tmp_path):
    """Greedy packing in file order; a sample longer than a row is split into row-sized
    pieces, each starting at position 0; the padding tail is its own pseudo-document."""
    f = tmp_path / "d.jsonl"
    f.write_text(
        "\n".join(
            json.dumps(s)
            for s in [
                {"input_ids": [1, 2, 3, 4]},
                {"input_ids": [5, 6], "loss_mask": [0, 1]},
                {"input_ids": list(range(9))},
            ]
        )
    )
    src = JsonlSource(str(f), seq_len=6, global_batch=2, seed=0, vocab_size=16)
    rows = src.all_rows()
    I = IGNORE  # noqa: E741
    assert rows.input_ids.tolist() == [[1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5], [6, 7, 8, 0, 0, 0]]
    assert rows.labels.tolist() == [[2, 3, 4, I, 6, I], [1, 2, 3, 4, 5, I], [7, 8, I, I, I, I]]
    assert rows.position_ids.tolist() == [
        [0, 1, 2, 3, 0, 1],
        [0, 1, 2, 3, 4, 5],
        [0, 1, 2, 0, 1, 2],
    ]
    # the stream: global batch g covers rows g*B .. g*B+B-1 of per-epoch shuffles of all rows
    table = [tuple(r) for r in rows.input_ids.tolist()]
    seen = []
    for step in range(3):  # 6 rows = two epochs of 3
        b = src.global_batch_at(step)
        for r in range(2):
            i = table.index(tuple(b.input_ids[r].tolist()))
            assert b.labels[r].tolist() == rows.labels[i].tolist()
            assert b.position_ids[r].tolist() == rows.position_ids[i].tolist()
            seen.append(i)
        assert b.num_valid == src.num_valid_at(step)
        assert src.rows_at(step, 1, 2).input_ids.equal(
            b.input_ids[1:2]
        )  # a rank reads its rows alone
    assert sorted(seen[:3]) == sorted(seen[3:]) == [0, 1, 2]
    assert src.global_batch_at(1).input_ids.equal(src.global_batch_at(1).input_ids)
    bad = tmp_path / "bad.jsonl"
    for text, msg in [
        ('{"input_ids": [1, 2]}\nnot json\n', ":2: not valid JSON"),
        ('{"input_ids": [1, 99]}\n', ":1: token id 99 outside"),
        ('{"input_ids": [1, 2], "loss_mask": [1]}\n', ":1: 'loss_mask' must be"),
        ('{"tokens": [1]}\n', ":1: expected an object"),
    ]:
        bad.write_text(text)
        with pytest.raises(DataError, match=msg):
            read_samples(str(bad), vocab_size=16)


def test_jsonl_loss_mask_token_by_token(tmp_path):
    """A chat-like sample (prompt unmasked, two answer spans): position t has a label iff
    token t+1 is marked, and the label is that token."""
    ids = [3, 10, 11, 12, 4, 20, 21, 5, 13, 14, 4, 22, 6]
    mask = [0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1]
    f = tmp_path / "chat.jsonl"
    f.write_text(json.dumps({"input_ids": ids, "loss_mask": mask}) + "\n")
    rows = JsonlSource(str(f), seq_len=16, global_batch=1, seed=0, vocab_size=32).all_rows()
    labels = rows.labels[0].tolist()
    want = [ids[t + 1] if t + 1 < len(ids) and mask[t + 1] else IGNORE for t in range(16)]
    assert labels == want
    # written out: targets 20 21 5 (first answer) and 22 6 (second), predicted one position early
    assert [(t, labels[t]) for t in range(16) if labels[t] != IGNORE] == [
        (4, 20),
        (5, 21),
        (6, 5),
        (10, 22),
        (11, 6),
    ]
    assert rows.position_ids[0].tolist() == list(range(13)) + [0, 1, 2]
    assert rows.input_ids[0].tolist() == ids + [0, 0, 0]


def test_synthetic_stream_is_identical_across_processes():
    """The batch must not depend on per-process state such as string-hash randomization."""
    import subprocess
    import sys

    code = (
        "from bumblebee.data.synthetic import KeyValueRetrieval as K;"
        "print(K(seq_len=512, global_batch=2, seed=3).global_batch_at(4).input_ids.sum().item())"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            env={"PYTHONHASHSEED": str(h), "PATH": ""},
        ).stdout
        for h in (1, 2)
    }
    assert len(outs) == 1 and outs.pop().strip().isdigit()


def test_jsonl_source_holds_no_samples(tmp_path):
    """The source keeps offsets and row plans, not tokens: Python memory while it validates and
    plans a 0.5 M-token file and builds a batch stays far below the file's token lists (measured
    with tracemalloc: holding every sample, the previous loader, peaked at ~16x the file's bytes)."""
    import random
    import tracemalloc

    rng = random.Random(0)
    f = tmp_path / "big.jsonl"
    f.write_text(
        "".join(
            json.dumps({"input_ids": [rng.randrange(1000) for _ in range(500)]}) + "\n"
            for _ in range(1000)
        )
    )
    size = f.stat().st_size
    tracemalloc.start()
    try:
        src = JsonlSource(str(f), seq_len=1024, global_batch=4, seed=0, vocab_size=1000)
        batch = src.global_batch_at(3)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(src) == 500 and batch.input_ids.shape == (4, 1024)
    assert peak < size // 4, f"peak {peak} bytes for a {size}-byte file"
