"""Real-size defaults and the export dtype: real presets compute in bf16 unless train.dtype is
given; a run prints one line of per-rank static memory; ``convert --dtype`` writes the chosen
dtype (the bf16 export equals the fp32 one cast to bf16, bit for bit; the default follows the
run's train.dtype)."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file

from bumblebee import load_config
from bumblebee.cli import main

TINY = [
    "model.arch.num_hidden_layers=1",
    "model.arch.hidden_size=32",
    "model.arch.head_dim=8",
    "model.arch.moe_intermediate_size=16",
    "model.arch.num_experts=4",
    "model.arch.num_experts_per_tok=2",
    "train.seq_len=64",
    "train.global_batch=1",
    "train.steps=1",
    "train.save_every=1",
    "train.eval_every=0",
]


def test_real_presets_default_to_bf16_compute():
    assert load_config(None, ["model.preset=qwen3-30b-a3b"]).train.dtype == "bfloat16"
    assert (
        load_config(None, ["model.preset=qwen3-30b-a3b", "train.dtype=float32"]).train.dtype
        == "float32"
    )
    assert load_config(None, []).train.dtype == "float32"  # tiny


def run(tmp_path, name, extra=()):
    argv = ["train"] + [
        a for s in TINY + list(extra) + [f"train.out_dir={tmp_path / name}"] for a in ("--set", s)
    ]
    assert main(argv) == 0
    return tmp_path / name


def test_static_memory_line_and_export_dtypes(tmp_path, capsys):
    fp32_run = run(tmp_path, "fp32")
    out = capsys.readouterr().out
    line = next(
        line for line in out.splitlines() if line.startswith("bumblebee: static memory per rank")
    )
    assert (
        "params" in line and "grads" in line and "optimizer" in line and "float32 compute" in line
    )
    for dtype in ("float32", "bfloat16"):
        assert (
            main(["convert", "--to", "hf", str(fp32_run), str(tmp_path / dtype), "--dtype", dtype])
            == 0
        )
    full, half = (load_file(tmp_path / d / "model.safetensors") for d in ("float32", "bfloat16"))
    assert full.keys() == half.keys()
    for k, v in full.items():
        assert v.dtype == torch.float32 and half[k].dtype == torch.bfloat16
        assert torch.equal(half[k], v.to(torch.bfloat16)), k
    assert json.loads((tmp_path / "bfloat16" / "config.json").read_text())["dtype"] == "bfloat16"
    bf16_run = run(tmp_path, "bf16", ["train.dtype=bfloat16"])
    assert main(["convert", "--to", "hf", str(bf16_run), str(tmp_path / "default")]) == 0
    assert all(
        t.dtype == torch.bfloat16
        for t in load_file(tmp_path / "default" / "model.safetensors").values()
    )
    assert os.path.isfile(tmp_path / "default" / "config.json")
