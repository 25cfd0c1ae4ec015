"""Training from real data formats: chat JSONL and Parquet text through a locally built tokenizer
(targets checked token by token in the batches the trainer consumes), held-out eval_loss,
skipped-record counts in the summary, TensorBoard scalars, and a report of two runs overlaid."""

import io
import json
import random

import numpy as np
import pytest
from data_helpers import conversation, make_tokenizer, sentence

from bumblebee import load_config
from bumblebee.data.packing import IGNORE
from bumblebee.runtime.trainer import Trainer

SMALL = [
    "model.arch.num_hidden_layers=2",
    "model.arch.hidden_size=64",
    "model.arch.moe_intermediate_size=64",
    "model.arch.vocab_size=320",
    "train.seq_len=128",
    "train.global_batch=4",
    "train.warmup_steps=1",
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer")


def trainer(out, *overrides):
    return Trainer(
        load_config(None, SMALL + [f"train.out_dir={out}", *overrides]), stream=io.StringIO()
    )


def metrics(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_chat_jsonl_trains_on_assistant_tokens_only(tok_dir, tmp_path):
    rng = random.Random(0)
    recs = [conversation(rng, turns=rng.randint(1, 2)) for _ in range(40)]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    t = trainer(
        tmp_path / "run",
        "train.steps=5",
        "data.source=chat",
        f"data.path={path}",
        f"data.tokenizer={tok_dir}",
    )
    # independent expectation: ChatML pieces, assistant content + <|im_end|> + newline are the targets
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tok_dir)
    expected = {}
    for r in recs:
        ids, mask = [], []
        for m in r["messages"]:
            head = hf.encode(f"<|im_start|>{m['role']}\n", add_special_tokens=False)
            body = hf.encode(f"{m['content']}<|im_end|>\n", add_special_tokens=False)
            ids, mask = (
                ids + head + body,
                mask + [0] * len(head) + [int(m["role"] == "assistant")] * len(body),
            )
        expected[tuple(ids)] = mask
    checked = 0
    for step in range(5):
        b = t.source.rows_at(step, 0, 4)
        for row in range(4):
            ids, labels, pos = (
                b.input_ids[row].tolist(),
                b.labels[row].tolist(),
                b.position_ids[row].tolist(),
            )
            starts = [i for i in range(len(ids)) if pos[i] == 0] + [len(ids)]
            for s, e in zip(starts, starts[1:]):
                doc = tuple(ids[s:e])
                if doc not in expected:  # the padding tail: no targets at all
                    assert all(x == IGNORE for x in labels[s:e])
                    continue
                mask = expected[doc]
                for i in range(
                    e - s - 1
                ):  # token by token: target of i is token i+1 iff it is assistant text
                    assert labels[s + i] == (doc[i + 1] if mask[i + 1] else IGNORE)
                assert labels[e - 1] == IGNORE
                checked += 1
    assert checked >= 20
    summary = t.run()
    lines = metrics(tmp_path / "run")
    assert len(lines) == 5 and lines[-1]["loss"] < lines[0]["loss"]
    assert summary["data"]["documents"] == 40 and summary["data"]["skipped"] == 0


def test_parquet_text_with_held_out_eval_and_tensorboard(tok_dir, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(1)
    texts = [
        {"text": ". ".join(sentence(rng, 4, 12) for _ in range(rng.randint(1, 4)))}
        for _ in range(120)
    ]
    texts[7] = {"text": ""}  # a bad row: skipped and counted
    pq.write_table(pa.Table.from_pylist(texts), tmp_path / "t.parquet")
    out = tmp_path / "run"
    t = trainer(
        out,
        "train.steps=4",
        "data.source=text",
        f"data.path={tmp_path / 't.parquet'}",
        f"data.tokenizer={tok_dir}",
        "data.on_error=skip",
        "data.eval_fraction=0.2",
        "train.eval_every=2",
        "train.tensorboard=true",
    )
    held = set(t.source.eval_rows.tolist())
    assert held and not held & set(t.source.train_rows.tolist())
    trained = {int(r) for s in range(4) for r in t.source._global_rows(s)}
    assert not trained & held
    eos = t.source.rows.store.meta["eos_id"]
    assert all(
        int(t.source.rows.store.tokens[e - 1]) == eos for e in t.source.rows.store.offsets[1:]
    )
    summary = t.run()
    lines = metrics(out)
    assert [("eval_loss" in r) for r in lines] == [False, True, False, True]
    assert all(
        np.isfinite(r["eval_loss"]) and r["eval_tokens"] > 0 for r in lines if "eval_loss" in r
    )
    assert summary["data"]["skipped"] == 1 and summary["data"]["skipped_by_reason"] == {
        "'text' must be a non-empty string": 1
    }
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("loss")] == pytest.approx([r["loss"] for r in lines])
    assert [e.step for e in acc.Scalars("eval_loss")] == [2, 4]


def test_report_overlays_two_runs(tmp_path):
    from matplotlib.image import imread

    from bumblebee.cli import main

    for name, lr in (("a", "3e-3"), ("b", "1e-3")):
        trainer(
            tmp_path / name,
            "train.steps=3",
            f"train.lr={lr}",
            "train.min_lr=1e-4",
            "data.min_records=2",
            "data.max_records=6",
            "model.arch.vocab_size=272",
        ).run()
    png = tmp_path / "report.png"
    assert main(["report", str(tmp_path / "a"), str(tmp_path / "b"), "-o", str(png)]) == 0
    img = imread(png)[..., :3]
    assert img.shape[0] > 500 and img.shape[1] > 1000

    def share(rgb):  # fraction of pixels close to a matplotlib default line colour
        return float((np.abs(img - np.array(rgb) / 255).max(axis=-1) < 0.08).mean())

    assert (
        share((31, 119, 180)) > 1e-4 and share((255, 127, 14)) > 1e-4
    )  # tab:blue (run a), tab:orange (run b)
    assert main(["report", str(tmp_path / "nope"), "-o", str(png)]) == 2
