"""``plan --emit-config`` writes what the plan decided and marks what it cannot decide.

A real-size config carries no CPU-demo setting (lr 2e-3, synthetic data, no checkpoints,
runs/default, a fixed dp_shard); its weights, data, lr schedule, checkpoint cadence and
out_dir are ``"REQUIRED: ..."`` markers, and ``bumblebee train`` refuses the file (one line,
exit 2, before launch) until each is filled, in the file or by ``--set``. Filled, it passes
the launch checks at the planned world size. DeepSeek-V3's config names no router (the run
takes the architecture's sigmoid_bias instead of replacing a written one silently).
"""

import contextlib
import io
import re

import pytest

from bumblebee import load_config
from bumblebee.cli import main
from bumblebee.plan.cli import main as plan_main
from bumblebee.runtime.resolve import check_run

REQUIRED = [
    "model.hf_path",
    "train.steps",
    "train.lr",
    "train.warmup_steps",
    "train.min_lr",
    "train.save_every",
    "train.out_dir",
    "data.source",
    "data.path",
]


def emit(*args) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert plan_main([*args, "--emit-config", "0"]) == 0
    return out.getvalue()


def filled(tmp_path) -> dict[str, str]:
    data = tmp_path / "train.jsonl"
    data.write_text('{"input_ids": [1, 2, 3]}\n')
    return {
        "model.hf_path": '""',
        "train.steps": "1000",
        "train.lr": "3e-4",
        "train.warmup_steps": "100",
        "train.min_lr": "3e-5",
        "train.save_every": "200",
        "train.out_dir": f'"{tmp_path / "run"}"',
        "data.source": '"jsonl"',
        "data.path": f'"{data}"',
    }


def fill(text: str, values: dict[str, str]) -> str:
    section = None
    out = []
    for line in text.splitlines():
        if m := re.match(r"\[(\w+)\]", line):
            section = m.group(1)
        key = line.split(" = ")[0]
        if f"{section}.{key}" in values and '"REQUIRED:' in line:
            line = f"{key} = {values[f'{section}.{key}']}"
        out.append(line)
    return "\n".join(out) + "\n"


def test_real_size_config_refused_until_filled(tmp_path, capsys):
    text = emit("--model", "qwen3-30b-a3b", "--gpus", "16", "--seq", "65536")
    for demo in ("synthetic", "runs/default", "0.002"):  # no CPU-demo default reaches a 16-GPU run
        assert demo not in text
    assert re.search(r'^dp_shard = "auto"$', text, re.M)
    path = tmp_path / "run.toml"
    path.write_text(text)
    capsys.readouterr()
    assert main(["train", "--config", str(path)]) == 2  # before launch: no out_dir, no process
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("bumblebee: error:") and "not filled in" in err
    assert all(key in err for key in REQUIRED), err
    assert not (tmp_path / "run").exists()

    values = filled(tmp_path)
    sets = [f"{k}={v}" for k, v in values.items() if k != "train.lr"]  # all but one given by --set
    with pytest.raises(Exception, match=r"not filled in: train\.lr;"):
        load_config(str(path), sets)
    cfg = load_config(str(path), sets + ["train.lr=3e-4"])
    assert cfg.train.lr == 3e-4

    path.write_text(fill(text, values))  # filled in the file: the launch checks pass at 16 GPUs
    cfg = load_config(str(path))
    layout = check_run(cfg, 16).layout
    assert (cfg.train.seq_len, cfg.train.global_batch, cfg.train.dtype) == (65536, 16, "bfloat16")
    assert (cfg.train.lr, cfg.train.save_every, cfg.data.source) == (3e-4, 200, "jsonl")
    assert layout.world == 16 and cfg.parallel.dp_shard == "auto"


def test_deepseek_config_names_no_router(tmp_path):
    text = emit(
        "--model",
        "deepseek-v3-671b",
        "--gpus",
        "256",
        "--seq",
        "32768",
        "--layout",
        "tp=1 pp=16 ep=8 cp=2",
    )
    assert not re.search(r"^router\s*=", text, re.M)
    path = tmp_path / "run.toml"
    path.write_text(fill(text, filled(tmp_path)))
    cfg = load_config(str(path))
    check_run(cfg, 256)
    assert cfg.primitives.router == "sigmoid_bias"  # the architecture's, as the run trains it


def test_tiny_preset_keeps_the_demo_config(tmp_path):
    """The laptop flow (docs/planner.md): plan a tiny model, train it as emitted."""
    text = emit("--model", "qwen3_moe/tiny", "--gpus", "2", "--seq", "512")
    assert "REQUIRED" not in text
    path = tmp_path / "run.toml"
    path.write_text(text)
    check_run(load_config(str(path)), 2)
