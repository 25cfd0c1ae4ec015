"""Launching ranks: `bumblebee train --nproc 2` trains; a failing rank ends the job
with a non-zero exit, naming the rank, instead of hanging."""

import json
import subprocess
import sys

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from bumblebee.runtime.launch import init_distributed, launch_local

SMALL = ["--set", "model.arch.num_hidden_layers=2", "--set", "model.arch.hidden_size=64",
         "--set", "train.seq_len=256", "--set", "data.min_records=4", "--set", "data.max_records=12", "--set", "train.steps=3"]


def test_cli_nproc_trains_with_expert_parallelism(tmp_path):
    r = subprocess.run([sys.executable, "-m", "bumblebee.cli", "train", "--nproc", "2", "--set", "parallel.ep=2",
                        "--set", f"train.out_dir={tmp_path}", *SMALL], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3]  # only rank 0 writes
    assert "dp_shard=2" in r.stdout and "ep=2" in r.stdout


def test_impossible_layout_is_rejected_before_launch(tmp_path):
    r = subprocess.run([sys.executable, "-m", "bumblebee.cli", "train", "--nproc", "2", "--set", "parallel.ep=3"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "ep = 3 must divide" in r.stderr and "Traceback" not in r.stderr


@record
def _rank1_raises(cfg):
    init_distributed(timeout_s=120)
    if dist.get_rank() == 1:
        raise ValueError("bad sample in shard 1")
    dist.barrier()  # rank 0 would wait here forever without the agent stopping it


def test_failing_rank_stops_the_job(capfd):
    code = launch_local(None, 2, worker=_rank1_raises)
    err = capfd.readouterr().err
    print(err)
    assert code == 1
    assert "rank 1 failed" in err and "bad sample in shard 1" in err
