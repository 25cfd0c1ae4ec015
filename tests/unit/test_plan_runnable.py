"""The planner offers only what the runtime runs, and says how to run it.

Every recommended or ranked candidate passes the runtime's own resolver at its world size;
``--emit-config N`` and the JSON ``config`` are configs ``bumblebee train --config`` accepts;
layouts the runtime lacks (tp > 1) appear only with ``--include-unimplemented``, marked.
"""

import contextlib
import io
import json
import os
import subprocess
import sys

import pytest

from bumblebee import load_config
from bumblebee.plan.cli import main as plan_main
from bumblebee.runtime.resolve import check_run

CASES = [("qwen3.5-35b-a3b", 32, 131072), ("qwen3-30b-a3b", 16, 65536)]


def fill_in(tmp_path) -> list[str]:
    """--set values for what an emitted real-size config leaves to the user (REQUIRED markers)."""
    data = tmp_path / "train.jsonl"
    data.write_text('{"input_ids": [1, 2, 3]}\n')
    return [
        'model.hf_path=""',
        "train.steps=100",
        "train.lr=3e-4",
        "train.warmup_steps=10",
        "train.min_lr=3e-5",
        "train.save_every=50",
        f"train.out_dir={tmp_path / 'run'}",
        "data.source=jsonl",
        f"data.path={data}",
    ]


def plan(*args) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert plan_main(list(args)) == 0
    return out.getvalue()


@pytest.mark.parametrize("model,gpus,seq", CASES)
def test_every_ranked_candidate_runs_on_the_runtime(model, gpus, seq, tmp_path):
    res = json.loads(
        plan("--model", model, "--gpus", str(gpus), "--seq", str(seq), "--json", "--top", "50")
    )
    entries = [res["recommended"]] + res["candidates"]
    assert len(entries) > 10
    for entry in entries:
        assert entry["layout"]["tp"] == 1 and entry["runtime_problem"] == "", entry
    for entry in entries[
        :3
    ]:  # the config text is what `train --config` reads: the runtime's own check
        path = tmp_path / "run.toml"
        path.write_text(entry["config"])
        cfg = load_config(str(path), fill_in(tmp_path))
        layout = check_run(cfg, gpus).layout
        assert (layout.dp_shard, layout.cp, layout.ep, layout.pp) == tuple(
            entry["layout"][k] for k in ("dp_shard", "cp", "ep", "pp")
        )
        assert (
            cfg.primitives.moe_comm == entry["primitives"]["moe_comm"] and cfg.train.seq_len == seq
        )


@pytest.mark.parametrize("model,gpus,seq", CASES)
def test_emit_config_round_trips(model, gpus, seq, tmp_path):
    for n in (0, 1):  # the recommendation and the first alternative
        text = plan(
            "--model", model, "--gpus", str(gpus), "--seq", str(seq), "--emit-config", str(n)
        )
        (tmp_path / "run.toml").write_text(text)
        check_run(load_config(str(tmp_path / "run.toml"), fill_in(tmp_path)), gpus)


def test_unimplemented_layouts_only_on_request():
    args = [
        "--model",
        "qwen3.5-35b-a3b",
        "--gpus",
        "32",
        "--seq",
        "131072",
        "--json",
        "--top",
        "400",
    ]
    plain = json.loads(plan(*args))
    assert all(c["layout"]["tp"] == 1 for c in plain["candidates"])
    marked = json.loads(plan(*args, "--include-unimplemented"))
    tp2 = [c for c in marked["candidates"] if c["layout"]["tp"] > 1]
    assert tp2 and all("tp > 1 is not implemented" in c["runtime_problem"] for c in tp2)
    assert all(c["reason"].startswith("not runnable yet") for c in tp2)
    assert marked["recommended"]["layout"]["tp"] == 1


def test_plan_to_train(tmp_path):
    """plan -> config -> train, end to end on 2 CPU ranks with the tiny preset."""
    text = plan("--model", "qwen3_moe/tiny", "--gpus", "2", "--seq", "512", "--emit-config", "0")
    (tmp_path / "run.toml").write_text(text)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bumblebee.cli",
            "train",
            "--config",
            str(tmp_path / "run.toml"),
            "--nproc",
            "2",
            "--set",
            "train.steps=2",
            "--set",
            f"train.out_dir={tmp_path / 'run'}",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]
