"""Three ways a run used to lose or mix data, each refused or made safe:

1. resuming from an older checkpoint: pruning kept the abandoned future's newest step and
   deleted the one just written; newer checkpoints are now moved aside (to ``out_dir/previous/``) at the start;
2. ``convert`` into a used directory mixed two exports (an old index beside a new single
   file); a non-empty target is refused unless ``--overwrite``, which removes the old files;
3. two runs on one ``out_dir``; a lock file (host, pid) refuses the second, stale locks are
   taken over.
"""

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch

from bumblebee.cli import main
from bumblebee.models.hf import from_hf
from bumblebee.runtime.checkpoint.directory import find_checkpoint, read_marker
from bumblebee.runtime.launch.outdir import LOCK_NAME, OutDirLock, _start_time

TINY = [
    "model.arch.num_hidden_layers=1",
    "model.arch.hidden_size=32",
    "model.arch.head_dim=8",
    "model.arch.moe_intermediate_size=16",
    "model.arch.num_experts=2",
    "model.arch.num_experts_per_tok=1",
    "primitives.loss=ce",
    "primitives.recompute=none",
    "primitives.attention=sdpa",
    "train.seq_len=32",
    "train.global_batch=1",
    "data.min_records=1",
    "data.max_records=2",
    "train.warmup_steps=0",
]


def train(out, *extra, resume=None) -> int:
    argv = ["train"] + [
        a for s in TINY + list(extra) + [f"train.out_dir={out}"] for a in ("--set", s)
    ]
    return main(argv + (["--resume", str(resume)] if resume else []))


@pytest.fixture(scope="module")
def four_checkpoints(tmp_path_factory):
    out = tmp_path_factory.mktemp("run4")
    assert (
        train(out, "train.steps=4", "train.save_every=1", "train.keep_last=0", "train.lr=1e-3") == 0
    )
    assert sorted(os.listdir(out / "checkpoints")) == [f"step_0000000{i}" for i in (1, 2, 3, 4)]
    return out


def test_resume_from_an_older_checkpoint_never_prunes_what_it_wrote(four_checkpoints, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(four_checkpoints, out)
    ckpts = out / "checkpoints"
    code = train(
        out,
        "train.steps=2",
        "train.save_every=1",
        "train.keep_last=1",
        "train.lr=5e-3",
        resume=ckpts / "step_00000001",
    )
    assert code == 0
    assert sorted(n for n in os.listdir(ckpts) if n.startswith("step_")) == ["step_00000002"]
    assert (
        "lr = 0.005" in (ckpts / "step_00000002" / "config.toml").read_text()
    )  # the new run's, not the stale one
    (aside,) = os.listdir(
        out / "previous"
    )  # the abandoned future, set aside with the record it belongs to
    assert sorted(os.listdir(out / "previous" / aside / "checkpoints")) == [
        "step_00000002",
        "step_00000003",
        "step_00000004",
    ]
    assert find_checkpoint("auto", str(out)) == str(
        ckpts / "step_00000002"
    )  # what --resume auto / convert take
    assert read_marker(str(ckpts / "step_00000002"))["step"] == 2


def test_a_fresh_run_in_a_used_out_dir_sets_the_old_checkpoints_aside(four_checkpoints, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(four_checkpoints, out)
    assert train(out, "train.steps=1", "train.save_every=1", "train.keep_last=1") == 0
    assert sorted(n for n in os.listdir(out / "checkpoints") if n.startswith("step_")) == [
        "step_00000001"
    ]


def test_convert_refuses_a_used_directory_and_overwrite_replaces_the_old_export(
    four_checkpoints, tmp_path, capsys
):
    run, d = four_checkpoints, tmp_path / "hf"
    assert main(["convert", "--to", "hf", str(run), str(d), "--max-shard-bytes", "10000"]) == 0
    assert (d / "model.safetensors.index.json").exists()
    step1 = run / "checkpoints" / "step_00000001"
    capsys.readouterr()
    assert main(["convert", "--to", "hf", str(step1), str(d)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not empty" in err and "--overwrite" in err
    assert main(["convert", "--to", "hf", str(step1), str(d), "--overwrite"]) == 0
    assert sorted(os.listdir(d)) == ["config.json", "model.safetensors"]  # no stale index or shards
    model = from_hf(str(d))
    assert main(["convert", "--to", "hf", str(step1), str(tmp_path / "ref")]) == 0
    ref = from_hf(str(tmp_path / "ref"))
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p, q), n


@pytest.mark.parametrize(
    "target, fragment",
    [
        ("run", "is the input"),  # the run itself: the writer guard names it first
        ("other_run", "a training run directory"),
        ("run/checkpoints/step_00000001", "a training checkpoint directory"),
        ("run/checkpoints", "a training checkpoint directory"),
        ("run/config.toml", "not a directory"),
        ("other", "holds none"),
    ],
)
def test_convert_never_writes_into_a_run_checkpoint_or_foreign_directory(
    four_checkpoints, tmp_path, capsys, target, fragment
):
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    (tmp_path / "other_run").mkdir()  # another run's record
    (tmp_path / "other_run" / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    os.symlink(four_checkpoints, tmp_path / "run")
    before = {
        p: os.path.getsize(os.path.join(r, p)) for r, _, fs in os.walk(four_checkpoints) for p in fs
    }
    assert (
        main(
            ["convert", "--to", "hf", str(four_checkpoints), str(tmp_path / target), "--overwrite"]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and fragment in err, err
    after = {
        p: os.path.getsize(os.path.join(r, p)) for r, _, fs in os.walk(four_checkpoints) for p in fs
    }
    assert after == before and (tmp_path / "other" / "notes.txt").read_text() == "mine"


def _write_lock(out, pid, started):
    os.makedirs(out, exist_ok=True)
    (out / LOCK_NAME).write_text(
        json.dumps({"host": socket.gethostname(), "pid": pid, "started": started, "since": "then"})
    )


def test_a_second_run_on_a_locked_out_dir_is_refused(tmp_path, capsys):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _write_lock(tmp_path, other.pid, _start_time(other.pid))
        assert train(tmp_path, "train.steps=1") == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"in use by another run (pid {other.pid}" in err
        assert not (tmp_path / "metrics.jsonl").exists()
    finally:
        other.kill()
        other.wait()
    assert train(tmp_path, "train.steps=1") == 0  # the owner is gone: a stale lock is taken over
    assert "stale lock" in capsys.readouterr().err
    assert not (tmp_path / LOCK_NAME).exists()  # released at the end of the run


def test_a_lock_whose_pid_was_reused_is_stale(tmp_path):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _write_lock(tmp_path, other.pid, "1")  # a live pid, but not the process that wrote the lock
        with OutDirLock(str(tmp_path), stream=open(os.devnull, "w")) as lock:
            assert (
                lock.owned and json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
            )
        assert not (tmp_path / LOCK_NAME).exists()
    finally:
        other.kill()
        other.wait()
