"""Faults in one process: root-cause diagnosis, checkpoint checksums, NaN/Inf steps,
preemption by SIGTERM (the multi-rank versions are in tests/distributed/test_launch.py)."""

import io
import itertools
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import zlib

import pytest
import torch

from bumblebee import load_config
from bumblebee.cli import main
from bumblebee.models.hf import CheckpointError
from bumblebee.runtime.checkpoint import integrity
from bumblebee.runtime.launch.failures import classify, diagnose, first_failure
from bumblebee.runtime.launch.signals import Preempted
from bumblebee.runtime.nonfinite import NonFiniteError
from bumblebee.runtime.trainer import Trainer

BASE = [
    "model.arch.num_hidden_layers=2",
    "model.arch.hidden_size=32",
    "model.arch.head_dim=8",
    "model.arch.moe_intermediate_size=16",
    "model.arch.intermediate_size=48",
    "model.arch.num_experts=4",
    "model.arch.num_experts_per_tok=2",
    "model.arch.mlp_only_layers=[1]",
    "primitives.loss=ce",
    "primitives.recompute=none",
    "train.seq_len=64",
    "train.global_batch=2",
    "data.min_records=2",
    "data.max_records=4",
    "train.lr=1e-2",
    "train.warmup_steps=1",
    "train.deterministic=true",
    "train.steps=4",
]


def trainer(out_dir, *extra) -> Trainer:
    return Trainer(
        load_config(None, BASE + [*extra, f"train.out_dir={out_dir}"]), stream=io.StringIO()
    )


# ------------------------------------------------------------------------------ root cause
def _report(rank, t, exc):
    return {
        "rank": rank,
        "time_ns": t,
        "kind": classify(exc),
        "error": f"{type(exc).__name__}: {exc}",
    }


def test_root_cause_wins_whatever_the_arrival_order():
    cause = ValueError("bad sample in shard 1")
    echoes = [
        RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:1234"),
        RuntimeError("Gloo connectFullMesh failed ... Connection reset by peer"),
        RuntimeError("[../gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]: Broken pipe"),
    ]
    for times in itertools.permutations(
        range(4)
    ):  # the echoes may even be stamped before the cause
        reports = {
            1: _report(1, times[0], cause),
            **{r: _report(r, times[i], e) for i, (r, e) in enumerate(zip((0, 2, 3), echoes), 1)},
        }
        assert diagnose(reports, 4) == (
            "rank 1 failed first (exit 1): ValueError: bad sample in shard 1; "
            "3 other ranks stopped after it"
        )
    two = {0: _report(0, 5, ValueError("late")), 3: _report(3, 2, KeyError("early"))}
    assert diagnose(two, 4).startswith("rank 3 failed first (exit 1): KeyError")


def test_first_failure_prefers_a_rank_that_stopped_by_itself():
    from types import SimpleNamespace as F

    killed = F(exitcode=-15, timestamp=100)  # stopped by the agent's teardown
    died = F(exitcode=17, timestamp=101)
    assert first_failure({0: killed, 1: died}) == (1, died)
    early = F(exitcode=1, timestamp=99)
    assert first_failure({0: killed, 1: died, 2: early}) == (2, early)
    assert first_failure({0: F(exitcode=1, timestamp=5), 1: F(exitcode=1, timestamp=5)})[0] == 0


def test_silent_rank_is_blamed_for_the_echoes():
    peer = {0: _report(0, 1, RuntimeError("Connection closed by peer"))}
    assert diagnose(peer, 2, (1, -9)).startswith(
        "rank 1 failed first (killed by SIGKILL); rank 0 then saw"
    )
    # the agent stopped rank 0 before it saw the loss: no report from either rank
    assert diagnose({}, 2, (1, 17)) == "rank 1 failed first (exit 17)"
    hung = {
        0: _report(
            0, 1, RuntimeError("[gloo] Timed out waiting 3000ms for recv operation to complete")
        )
    }
    assert diagnose(hung, 2).startswith(
        "rank 1 did not arrive at a collective within train.collective_timeout_s"
    )


# ------------------------------------------------------------------------------ integrity
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    trainer(out, "train.save_every=2").run()
    return out


def _flip_byte(path, at=None):
    data = bytearray(path.read_bytes())
    at = len(data) // 2 if at is None else at
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def test_flipped_byte_is_refused_by_verify_and_by_load(saved, tmp_path, capsys):
    ckpt = saved / "checkpoints" / "step_00000004"
    marker = json.loads((ckpt / "complete.json").read_text())
    assert marker["hash"] == "crc32" and set(marker["checksums"]) == set(marker["files"])
    assert main(["checkpoint", "verify", str(saved)]) == 0
    assert capsys.readouterr().out.count("bumblebee: ok ") == 2
    victim = max(
        (p for p in ckpt.iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size
    )
    _flip_byte(victim)
    assert main(["checkpoint", "verify", str(ckpt)]) == 1
    err = capsys.readouterr().err
    assert f"corrupt checkpoint: {victim.name} has crc32" in err and err.count("\n") == 1
    with pytest.raises(CheckpointError, match=f"corrupt checkpoint: {victim.name}"):
        trainer(tmp_path, f"train.resume={ckpt}")
    assert (
        main(
            [
                "train",
                *sum((["--set", x] for x in BASE), []),
                "--set",
                f"train.out_dir={tmp_path}",
                "--resume",
                str(ckpt),
            ]
        )
        == 2
    )
    assert "corrupt checkpoint" in capsys.readouterr().err
    _flip_byte(victim)  # flipped back: intact again
    assert main(["checkpoint", "verify", str(ckpt)]) == 0


def test_every_checkpoint_file_is_verified(saved, tmp_path, capsys):
    """Not only the largest file: a flipped byte in any file the marker lists (config.toml,
    .metadata, every shard) fails verify, naming that file; a corrupt config.toml also stops a resume."""
    ckpt = tmp_path / "step_00000004"
    shutil.copytree(saved / "checkpoints" / "step_00000004", ckpt)
    names = sorted(json.loads((ckpt / "complete.json").read_text())["checksums"])
    assert "config.toml" in names and ".metadata" in names and len(names) >= 3
    for name in names:
        _flip_byte(ckpt / name)
        assert main(["checkpoint", "verify", str(ckpt)]) == 1, name
        assert f"corrupt checkpoint: {name} has crc32" in capsys.readouterr().err
        if name == "config.toml":
            with pytest.raises(CheckpointError, match="corrupt checkpoint: config.toml"):
                trainer(tmp_path / "resumed", f"train.resume={ckpt}")
        _flip_byte(ckpt / name)
    assert main(["checkpoint", "verify", str(ckpt)]) == 0


def test_corruption_before_the_last_hash_block_is_found(saved, tmp_path, monkeypatch, capsys):
    """Files are hashed in blocks (integrity._CHUNK, 16 MiB) with a running CRC: a flip in the
    first block of a file that spans several blocks must change its checksum. A real file of
    2.5 blocks, then a real checkpoint hashed in 4 KiB blocks (so its shards span many)."""
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(integrity._CHUNK * 5 // 2))
    assert integrity.file_checksum(str(big)) == f"{zlib.crc32(big.read_bytes()):08x}"
    info = {"checksums": integrity.checksum_files(str(tmp_path), ["big.bin"])}
    _flip_byte(big, at=100)
    with pytest.raises(CheckpointError, match="corrupt checkpoint: big.bin"):
        integrity.verify_checksums(str(tmp_path), info)
    monkeypatch.setattr(integrity, "_CHUNK", 4096)
    ckpt = tmp_path / "step_00000004"
    shutil.copytree(saved / "checkpoints" / "step_00000004", ckpt)
    assert (
        main(["checkpoint", "verify", str(ckpt)]) == 0
    )  # the sum does not depend on the block size
    victim = max(ckpt.iterdir(), key=lambda p: p.stat().st_size)
    assert victim.stat().st_size > 4 * 4096
    _flip_byte(victim, at=10)
    assert main(["checkpoint", "verify", str(ckpt)]) == 1
    assert f"corrupt checkpoint: {victim.name}" in capsys.readouterr().err


def test_a_marker_without_checksums_is_not_verified(saved, tmp_path, capsys):
    """Sizes alone say nothing of the contents: verify says so (exit 1) for a marker with no
    checksums, and for one whose checksums leave a file out."""
    ckpt = tmp_path / "step_00000004"
    shutil.copytree(saved / "checkpoints" / "step_00000004", ckpt)
    marker = ckpt / "complete.json"
    info = json.loads(marker.read_text())
    for sums in ({}, {k: v for k, v in info["checksums"].items() if k != "config.toml"}):
        marker.write_text(json.dumps({**info, "checksums": sums}))
        assert main(["checkpoint", "verify", str(ckpt)]) == 1
        out, err = capsys.readouterr()
        assert "ok" not in out and err.count("\n") == 1, (out, err)
        assert (
            f"NOT VERIFIED {ckpt}: {len(info['files']) - len(sums)} of {len(info['files'])} files have no "
            f"checksum"
            in err
            and "only their sizes were checked" in err
        ), err


def test_resume_past_train_steps_says_there_is_nothing_to_train(saved, tmp_path, capsys):
    """A checkpoint at step 4 with train.steps = 3 used to end at once with exit 0; = 4 says so."""
    ckpt = saved / "checkpoints" / "step_00000004"
    argv = [
        "train",
        *sum((["--set", x] for x in BASE), []),
        "--set",
        f"train.out_dir={tmp_path}",
        "--resume",
        str(ckpt),
    ]
    assert main(argv + ["--set", "train.steps=3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        "bumblebee: error: train.steps = 3 but the checkpoint it resumes is at step 4: nothing to "
        "train; set train.steps above 4 to continue it"
    ), err
    assert not (tmp_path / "metrics.jsonl").exists()
    stream = io.StringIO()
    Trainer(
        load_config(None, BASE + [f"train.out_dir={tmp_path / 'same'}", f"train.resume={ckpt}"]),
        stream=stream,
    )
    assert "the checkpoint is at train.steps = 4 already: nothing to train" in stream.getvalue()


# ------------------------------------------------------------------------------ non-finite steps
def _poison(t: Trainer, at_step: int, value=float("nan")):
    """Make the loss of optimizer step ``at_step`` (1-based) non-finite."""
    inner = t.model.loss_terms

    def loss_terms(*a, **k):
        terms = inner(*a, **k)
        if t.step + 1 == at_step:
            terms.loss_sum = terms.loss_sum * value
        return terms

    t.model.loss_terms = loss_terms


def test_nonfinite_stop_names_the_step_and_applies_nothing(tmp_path):
    t = trainer(tmp_path, "train.save_every=1")
    _poison(t, 3)
    with pytest.raises(NonFiniteError, match="step 3: non-finite loss nan"):
        t.run()
    ref = trainer(tmp_path / "ref", "train.steps=2")
    ref.run()
    for (name, p), q in zip(t.model.named_parameters(), ref.model.parameters()):
        assert torch.equal(p, q), name  # the weights are those after step 2
    for state in t.optimizer.state.values():
        assert all(torch.isfinite(v).all() for v in state.values() if torch.is_tensor(v))
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_00000001", "step_00000002"]
    assert main(["checkpoint", "verify", str(tmp_path)]) == 0


def test_nonfinite_skip_counts_and_keeps_weights_finite(tmp_path):
    t = trainer(tmp_path, "train.on_nonfinite=skip", "train.steps=5")
    _poison(t, 2, float("inf"))
    t.run()
    assert [r["skipped_steps"] for r in t.metrics.history] == [0, 1, 1, 1, 1]
    assert all(torch.isfinite(p).all() for p in t.model.parameters())
    losses = [r["loss"] for r in t.metrics.history]
    assert losses[1] == float("inf") and all(math.isfinite(x) and x < 1e3 for x in losses[2:])


# ------------------------------------------------------------------------------ preemption
def test_sigterm_finishes_the_step_saves_and_resumes_exactly(tmp_path):
    full = trainer(tmp_path / "full", "train.steps=5")
    full.run()
    t = trainer(tmp_path / "run", "train.steps=5")
    inner = t.train_step

    def train_step():
        if t.step == 2:  # arrives during step 3
            os.kill(os.getpid(), signal.SIGTERM)
        return inner()

    t.train_step = train_step
    with pytest.raises(Preempted) as e:
        t.run()
    path = str(tmp_path / "run" / "checkpoints" / "step_00000003")
    assert (e.value.step, e.value.path, e.value.exit_code) == (3, path, 128 + signal.SIGTERM)
    assert str(e.value) == f"preempted at step 3 (SIGTERM); saved {path}; resume with --resume auto"
    assert (
        signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    )  # handlers restored (pytest's default)
    resumed = trainer(tmp_path / "run", "train.steps=5", "train.resume=auto")
    assert resumed.step == 3
    resumed.run()
    assert [r["loss"] for r in resumed.metrics.history] == [
        r["loss"] for r in full.metrics.history
    ][3:]


def test_second_signal_stops_at_once(tmp_path):
    code = (
        "import os, signal, sys, time\n"
        "from bumblebee.runtime.launch.signals import Preemption\n"
        "with Preemption() as p:\n"
        "    os.kill(os.getpid(), signal.SIGUSR1); time.sleep(0.1); assert p.signum == signal.SIGUSR1\n"
        "    os.kill(os.getpid(), signal.SIGUSR1); time.sleep(5); sys.exit(0)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert r.returncode == -signal.SIGUSR1, r.stderr


def test_out_dir_lock_of_another_host_same_torchrun_job(tmp_path, monkeypatch):
    """A lock left on another host is refused (its owner cannot be checked) unless it was taken by
    an earlier attempt of the same torchrun job (TORCHELASTIC_RUN_ID): then it is taken over."""
    import io
    import json

    from bumblebee.config import ConfigError
    from bumblebee.runtime.launch.outdir import OutDirLock

    lock = tmp_path / "bumblebee.lock"
    lock.write_text(json.dumps({"host": "elsewhere", "pid": 1, "job": "job-a"}))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-b")
    with pytest.raises(ConfigError, match="in use by another run"):
        OutDirLock(str(tmp_path)).__enter__()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    note = io.StringIO()
    with OutDirLock(str(tmp_path), stream=note) as held:
        assert held.owned and json.loads(lock.read_text())["job"] == "job-a"
    assert "earlier attempt of job job-a" in note.getvalue()
    assert not lock.exists()
