"""Launched ranks and bad input / Ctrl-C: a rank's ConfigError-family failure ends the
launch with the single-process run's one line and exit 2 (not elastic's traceback), and
Ctrl-C during ``bumblebee train --nproc 2`` exits 130 with one line."""

import os
import signal
import subprocess
import sys

import pytest
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from bumblebee.config import ConfigError
from bumblebee.runtime.checkpoint.directory import find_checkpoint
from bumblebee.runtime.launch.launcher import init_distributed, launch_local

SMALL = [
    "model.arch.num_hidden_layers=1",
    "model.arch.hidden_size=32",
    "model.arch.head_dim=8",
    "model.arch.moe_intermediate_size=16",
    "model.arch.num_experts=2",
    "model.arch.num_experts_per_tok=1",
    "primitives.loss=ce",
    "primitives.recompute=none",
    "train.seq_len=32",
    "train.global_batch=2",
    "data.min_records=1",
    "data.max_records=2",
]


@record
def _rank1_bad_data(cfg):
    from bumblebee.data.jsonl import DataError

    init_distributed(timeout_s=120)
    if dist.get_rank() == 1:
        raise DataError("data.jsonl:7: not valid JSON (Expecting value)")
    dist.barrier()


def test_a_ranks_config_error_is_one_line_and_exit_2(capfd):
    with pytest.raises(ConfigError, match=r"^data.jsonl:7: not valid JSON \(Expecting value\)$"):
        launch_local(None, 2, worker=_rank1_bad_data)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "elastic" not in err, err


def test_ctrl_c_with_nproc_exits_130_with_one_line(tmp_path):
    argv = [sys.executable, "-m", "bumblebee.cli", "train", "--nproc", "2"]
    argv += [
        a
        for s in SMALL + ["train.steps=1000", "train.save_every=1", f"train.out_dir={tmp_path}"]
        for a in ("--set", s)
    ]
    p = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        for line in p.stdout:  # wait until the ranks are training
            if "step 2/1000" in line:
                break
        os.killpg(p.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole process group
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 130 and err == "bumblebee: interrupted\n", err
    ckpts = os.listdir(tmp_path / "checkpoints")
    assert all(n.startswith("step_") for n in ckpts), ckpts  # no half-written save left
    assert not (tmp_path / "bumblebee.lock").exists()
    assert (
        find_checkpoint("auto", str(tmp_path)) is not None
    )  # every published checkpoint is complete


def _gone(pid: int) -> bool:
    """The process has ended (a zombie no one reaped yet has ended too)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_ranks_die_with_a_sigkilled_launcher_and_the_lock_named_them(tmp_path):
    """SIGKILL of ``bumblebee train --nproc 2``'s launcher alone (the OOM killer's way): its
    ranks, which the lock named while they ran, die with it instead of training on as orphans,
    and the lock is then stale: a second run may take the out_dir over."""
    import io
    import json
    import time

    from bumblebee.runtime.launch.outdir import LOCK_NAME, OutDirLock

    argv = [sys.executable, "-m", "bumblebee.cli", "train", "--nproc", "2"]
    argv += [
        a
        for s in SMALL + ["train.steps=1000", "train.save_every=0", f"train.out_dir={tmp_path}"]
        for a in ("--set", s)
    ]
    p = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    ranks: list[int] = []
    try:
        for line in p.stdout:  # wait until the ranks are training
            if "step 2/1000" in line:
                break
        lock = [json.loads(x) for x in (tmp_path / LOCK_NAME).read_text().splitlines()]
        assert lock[0]["pid"] == p.pid, lock
        ranks = [x["pid"] for x in lock[1:] if "rank" in x]
        assert sorted(x["rank"] for x in lock[1:]) == [0, 1], lock
        os.kill(p.pid, signal.SIGKILL)  # the launcher only, not its process group
        p.wait(timeout=60)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(_gone(r) for r in ranks):
            time.sleep(0.2)
        alive = [r for r in ranks if not _gone(r)]
        assert not alive, f"ranks {alive} outlived their launcher"
        with OutDirLock(str(tmp_path), stream=io.StringIO()) as held:  # stale now
            assert held.owned
    finally:
        for pid in [p.pid, *ranks]:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
