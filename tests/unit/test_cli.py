"""The CLI: one-line errors with exit code 2 and no traceback; `primitives` lists slots."""

import os
import subprocess
import sys

import pytest

import bumblebee.primitives  # noqa: F401  (registers every implementation; the package root is lazy)
from bumblebee import registry
from bumblebee.cli import main


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "bumblebee.cli", *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    "args",
    [
        ["train", "--set", "train.steps=-2"],
        ["train", "--set", "primitives.experts=fast"],
        ["train", "--config", "/does/not/exist.toml"],
        ["train", "--set", "model.arch.num_attention_heads=3"],
    ],
)
def test_bad_input_exits_2_with_one_line(args):
    r = run_cli(*args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bumblebee: error: ")
    assert "Traceback" not in r.stderr


def test_malformed_jsonl_exits_2(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"input_ids": [1, 2, 3]}\n{"input_ids": [1, "x"]}\n')
    r = run_cli("train", "--set", "data.source=jsonl", "--set", f"data.path={f}")
    assert r.returncode == 2
    assert f"{f}:2: 'input_ids' must be a non-empty list of integers" in r.stderr


def test_primitives_lists_every_slot_and_reference(capsys):
    assert main(["primitives"]) == 0
    out = capsys.readouterr().out
    for slot in registry.SLOTS:
        assert f"{slot}:" in out
        ref = registry.reference(slot)
        if ref:
            assert any(ref in line and "reference" in line for line in out.splitlines())


def test_cuda_allocator_default_is_expandable_segments_unless_set(monkeypatch, capsys):
    from bumblebee.cli import main

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert main(["primitives"]) == 0
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    assert main(["primitives"]) == 0
    assert (
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128"
    )  # the user's choice stays
