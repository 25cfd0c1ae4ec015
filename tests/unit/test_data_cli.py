"""`bumblebee data prepare | inspect` on a multi-MB input with a progress bar, bad data as one-line
errors (exit 2) or counted skips, and the one-line message naming the [data] extra."""

import json
import random
import subprocess
import sys

import pytest
from data_helpers import conversation, make_tokenizer, sentence

from bumblebee.cli import main
from bumblebee.config import ConfigError


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer")


def bumblebee(*args):
    return subprocess.run(
        [sys.executable, "-m", "bumblebee.cli", *args], capture_output=True, text=True, timeout=600
    )


def test_prepare_and_inspect_multi_mb_text(tok_dir, tmp_path):
    rng = random.Random(0)
    path = tmp_path / "text.jsonl"
    with open(path, "w") as f:
        for _ in range(5000):
            f.write(
                json.dumps(
                    {"text": ". ".join(sentence(rng, 4, 12) for _ in range(rng.randint(1, 20)))}
                )
                + "\n"
            )
    assert path.stat().st_size > 2 * 2**20
    out = tmp_path / "out"
    r = bumblebee(
        "data",
        "prepare",
        "--source",
        "text",
        "--tokenizer",
        tok_dir,
        str(path),
        str(out),
        "--workers",
        "2",
    )
    assert r.returncode == 0, r.stderr
    bars = [line for line in r.stderr.splitlines() if line.startswith("prepare [")]
    assert (
        len(bars) >= 5 and "100%" in bars[-1] and "5000 docs" in bars[-1]
    )  # a progress line per 10%
    assert "5000 documents" in r.stdout
    r = bumblebee("data", "inspect", str(out), "--seq-len", "1024")
    assert r.returncode == 0, r.stderr
    assert (
        "documents 5000" in r.stdout
        and "length histogram" in r.stdout
        and "rows of 1024 tokens" in r.stdout
    )
    row = r.stdout.split("padding not shown):\n", 1)[1]
    docs = row.rstrip("\n").split("||")
    assert len(docs) > 1  # several documents per row
    for (
        d
    ) in docs:  # text: every token but a document's first is a target, up to and including its EOS
        assert (
            "[[" not in d.split("[[", 1)[0] and d.endswith("<|endoftext|>]]") and d.count("[[") == 1
        )


def test_inspect_shows_the_chat_mask(tok_dir, tmp_path, capsys):
    path = tmp_path / "chat.jsonl"
    path.write_text(
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": "a lazy dog"},
                    {"role": "assistant", "content": "seven red bees"},
                ]
            }
        )
        + "\n"
    )
    out = tmp_path / "out"
    assert (
        main(
            [
                "data",
                "prepare",
                "--source",
                "chat",
                "--tokenizer",
                tok_dir,
                str(path),
                str(out),
                "--workers",
                "1",
                "--no-progress",
            ]
        )
        == 0
    )
    assert main(["data", "inspect", str(out), "--seq-len", "64"]) == 0
    text = capsys.readouterr().out
    assert "documents 1" in text
    assert (
        "<|im_start|>user\na lazy dog<|im_end|>\n<|im_start|>assistant\n[[seven red bees<|im_end|>\n]]"
        in text
    )


def test_bad_data_exits_2_or_is_counted(tok_dir, tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    good = json.dumps(conversation(random.Random(0)))
    path.write_text(f"{good}\n{{oops\n{good}\n")
    args = [
        "data",
        "prepare",
        "--source",
        "chat",
        "--tokenizer",
        tok_dir,
        str(path),
        "--no-progress",
    ]
    assert main(args + [str(tmp_path / "o1")]) == 2
    assert not (tmp_path / "o1").exists()  # nothing half-written left behind
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"bumblebee: error: {path}:2: not valid JSON (Expecting property name enclosed in double quotes)"
    ]
    assert main(args + [str(tmp_path / "o2"), "--on-error", "skip"]) == 0
    out = capsys.readouterr().out
    assert "2 documents" in out and "skipped 1 {'not valid JSON': 1}" in out
    meta = json.loads((tmp_path / "o2" / "meta.json").read_text())
    assert meta["skipped"] == {"not valid JSON": 1}
    # the same file read directly by a run: one line, exit 2, before any step
    assert (
        main(
            [
                "train",
                "--set",
                "data.source=chat",
                "--set",
                f"data.path={path}",
                "--set",
                f"data.tokenizer={tok_dir}",
                "--set",
                "model.arch.vocab_size=320",
                "--set",
                f"train.out_dir={tmp_path / 'run'}",
            ]
        )
        == 2
    )
    assert capsys.readouterr().err.strip() == (
        f"bumblebee: error: {path}:2: not valid JSON "
        "(Expecting property name enclosed in double quotes)"
    )
    assert main(["data", "inspect", str(tmp_path / "nothing")]) == 2
    assert "not a prepared token directory" in capsys.readouterr().err


def test_missing_optional_package_names_the_extra(monkeypatch):
    from bumblebee.data.errors import require
    from bumblebee.report import pyplot

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(
        ConfigError,
        match=r"needs the optional package 'matplotlib': pip install 'bumblebee\[data\]'",
    ):
        pyplot()
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ConfigError, match=r"reading Parquet needs the optional package 'pyarrow'"):
        require("pyarrow.parquet", "reading Parquet")
