"""``bumblebee train`` under ``torchrun`` (the multi-node path): the workers join the process
group torchrun set up (no local launcher) and the 2-rank run gives the single-process run's
losses (``train.global_batch`` is layout-invariant)."""

import io
import json
import os
import shutil
import subprocess

from bumblebee import load_config
from bumblebee.runtime.trainer import Trainer

SETS = [
    "model.arch.num_hidden_layers=2",
    "model.arch.hidden_size=32",
    "model.arch.head_dim=8",
    "model.arch.moe_intermediate_size=16",
    "model.arch.num_experts=4",
    "model.arch.num_experts_per_tok=2",
    "train.seq_len=64",
    "train.global_batch=4",
    "train.micro_batch=1",
    "data.min_records=2",
    "data.max_records=4",
    "train.steps=3",
    "train.deterministic=true",
    "primitives.sharding=fsdp2",
    "parallel.ep=2",
]


def test_torchrun_two_ranks_match_one_process(tmp_path):
    torchrun = shutil.which("torchrun") or ""
    assert torchrun, "torchrun (installed with torch) is not on PATH"
    sets = [x for s in SETS + [f"train.out_dir={tmp_path / 'tr'}"] for x in ("--set", s)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "bumblebee.cli", "train", *sets],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [
        json.loads(line) for line in (tmp_path / "tr" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rows] == [1, 2, 3]
    single = Trainer(
        load_config(None, SETS[:-2] + [f"train.out_dir={tmp_path / 'one'}"]), stream=io.StringIO()
    )
    single.run()
    ref = [r["loss"] for r in single.metrics.history]
    assert all(abs(r["loss"] - x) <= 1e-5 * abs(x) for r, x in zip(rows, ref)), (
        [r["loss"] for r in rows],
        ref,
    )


def test_two_agents_nnodes_2_on_one_host(tmp_path):
    """The multi-node launch as docs/commands.md gives it (two torchrun agents with a c10d rendezvous),
    both on this host: the run trains, and a second attempt of the same job (same --rdzv-id) may take
    over the out_dir lock its first attempt left (a restart can put rank 0 on another host)."""
    import socket

    torchrun = shutil.which("torchrun") or ""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "nn"
    out.mkdir()
    # a lock left by an earlier attempt of this job, whose rank 0 ran on another host
    (out / "bumblebee.lock").write_text(
        json.dumps({"host": "node-that-died", "pid": 1, "job": "bb-test-job"})
    )
    sets = [x for s in SETS + [f"train.out_dir={out}"] for x in ("--set", s)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    agents = [
        subprocess.Popen(
            [
                torchrun,
                "--nnodes",
                "2",
                "--nproc-per-node",
                "1",
                "--node-rank",
                str(n),
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                "bb-test-job",
                "-m",
                "bumblebee.cli",
                "train",
                *sets,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for n in range(2)
    ]
    results = [a.communicate(timeout=600) for a in agents]
    for a, (_, err) in zip(agents, results):
        assert a.returncode == 0, err[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert any("earlier attempt of job bb-test-job" in err for _, err in results)
