"""Checkpoints in one process: resume continues the exact run (bit-identical losses and
parameters in deterministic mode), ``auto`` picks the newest complete checkpoint,
``keep_last`` prunes, and anything incomplete, truncated, foreign, for another model or
carrying a pickled payload fails with a one-line ``CheckpointError`` -- never a partial load."""

import io
import json
import os
import pickle
import random
import shutil

import pytest
import torch

from bumblebee import load_config
from bumblebee.cli import main
from bumblebee.config import ConfigError
from bumblebee.models.hf import CheckpointError
from bumblebee.runtime.checkpoint.directory import MARKER, find_checkpoint, read_marker
from bumblebee.runtime.checkpoint.integrity import file_checksum
from bumblebee.runtime.trainer import Trainer

STEPS = 4
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
    f"train.steps={STEPS}",
    "train.save_every=2",
]


def trainer(out_dir, *extra) -> Trainer:
    return Trainer(
        load_config(None, BASE + [*extra, f"train.out_dir={out_dir}"]), stream=io.StringIO()
    )


def run(t: Trainer) -> list[float]:
    t.run()
    return [r["loss"] for r in t.metrics.history]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """An uninterrupted run that saves at steps 2 and 4: (out_dir, losses, final parameters)."""
    out = tmp_path_factory.mktemp("full")
    t = trainer(out)
    losses = run(t)
    return out, losses, {n: p.detach().clone() for n, p in t.model.named_parameters()}


def test_resume_is_bit_identical(full_run, tmp_path):
    out, losses, params = full_run
    assert sorted(os.listdir(out / "checkpoints")) == ["step_00000002", "step_00000004"]
    t = trainer(tmp_path, f"train.resume={out / 'checkpoints' / 'step_00000002'}")
    assert t.step == 2
    assert run(t) == losses[2:]
    for name, p in t.model.named_parameters():
        assert torch.equal(p, params[name]), name


def noisy(t: Trainer) -> Trainer:
    """Make the step depend on the global generators: noise from torch's RNG, scaled by a
    draw from Python's, on the embedding output (training itself draws no random numbers)."""

    def hook(module, args, out):
        return out + torch.randn_like(out) * (0.05 + 0.05 * random.random())

    t.model.model.embed_tokens.register_forward_hook(hook)
    return t


def test_resume_restores_the_random_generators(tmp_path):
    full = run(noisy(trainer(tmp_path / "a")))
    assert full != run(
        trainer(tmp_path / "b", "train.save_every=0")
    )  # the noise does change the losses
    resumed = noisy(
        trainer(tmp_path / "c", f"train.resume={tmp_path / 'a' / 'checkpoints' / 'step_00000002'}")
    )
    assert resumed.step == 2 and run(resumed) == full[2:]


def test_auto_takes_the_newest_complete_checkpoint(full_run, tmp_path):
    out, losses, _ = full_run
    shutil.copytree(out / "checkpoints", tmp_path / "checkpoints")
    ckpts = tmp_path / "checkpoints"
    shutil.copytree(ckpts / "step_00000004", ckpts / "step_00000006")  # a newer one, truncated
    with open(next((ckpts / "step_00000006").glob("*.distcp")), "r+b") as f:
        f.truncate(100)
    (ckpts / ".tmp-step_00000008").mkdir()  # a save that never finished
    notes = []
    assert find_checkpoint("auto", str(tmp_path), notes.append) == str(ckpts / "step_00000004")
    assert len(notes) == 1 and "step_00000006: truncated checkpoint" in notes[0]
    assert find_checkpoint(str(tmp_path), "unused") == str(
        ckpts / "step_00000004"
    )  # a run directory
    os.remove(ckpts / "step_00000004" / MARKER)
    t = trainer(tmp_path, "train.resume=auto")  # continues from step 2 and finishes the run
    assert t.step == 2 and run(t) == losses[2:]


def test_auto_without_checkpoints_starts_fresh(tmp_path):
    assert find_checkpoint("auto", str(tmp_path)) is None


def test_keep_last_prunes_old_checkpoints(tmp_path):
    t = trainer(tmp_path, "train.keep_last=2")
    for step in (1, 2, 3):
        t.checkpoint.save(step)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_00000002", "step_00000003"]
    info = read_marker(str(tmp_path / "checkpoints" / "step_00000003"))
    assert info["step"] == 3 and "config.toml" in info["files"]


# ------------------------------------------------------------------------------ errors
@pytest.fixture
def ckpt(full_run, tmp_path):
    """A private copy of the step-2 checkpoint to damage."""
    path = tmp_path / "ckpt"
    shutil.copytree(full_run[0] / "checkpoints" / "step_00000002", path)
    return path


def resume_error(path, *extra) -> str:
    with pytest.raises(CheckpointError) as e:
        trainer(path.parent / "out", f"train.resume={path}", *extra)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_error_truncated_file(ckpt):
    data = next(ckpt.glob("*.distcp"))
    with open(data, "r+b") as f:
        f.truncate(os.path.getsize(data) // 2)
    assert "truncated checkpoint" in resume_error(ckpt) and data.name in resume_error(ckpt)


def test_error_missing_file(ckpt):
    os.remove(ckpt / ".metadata")
    assert "truncated checkpoint: .metadata is missing" in resume_error(ckpt)


def test_error_incomplete_save(ckpt):
    os.remove(ckpt / MARKER)
    assert "incomplete checkpoint" in resume_error(ckpt)


def test_error_foreign_directories(tmp_path):
    (tmp_path / "empty").mkdir()
    assert "not a bumblebee checkpoint" in resume_error(tmp_path / "empty")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    assert "Hugging Face model directory" in resume_error(tmp_path / "hf")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / MARKER).write_text(json.dumps({"format": "something-else"}))
    assert "does not describe a bumblebee checkpoint" in resume_error(tmp_path / "other")


def test_error_different_model(ckpt):
    assert "has shape" in resume_error(ckpt, "model.arch.hidden_size=48")
    assert "lacks model.layers.2" in resume_error(ckpt, "model.arch.num_hidden_layers=3")


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_metadata_is_not_unpickled_beyond_plain_data(ckpt, monkeypatch):
    monkeypatch.chdir(ckpt)
    (ckpt / ".metadata").write_bytes(pickle.dumps(_Payload()))
    info = json.loads((ckpt / MARKER).read_text())
    info["files"][".metadata"] = os.path.getsize(ckpt / ".metadata")
    info["checksums"][".metadata"] = file_checksum(
        ckpt / ".metadata"
    )  # a checksum is no defence against tampering
    (ckpt / MARKER).write_text(json.dumps(info))
    assert "refusing to load posix.system" in resume_error(ckpt)
    assert not (ckpt / "PWNED").exists()


def test_cli_errors_are_one_line(ckpt, tmp_path, capsys):
    os.remove(ckpt / MARKER)
    assert main(["train", "--resume", str(ckpt), "--set", f"train.out_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("bumblebee: error:")
        and "incomplete checkpoint" in err
        and err.count("\n") == 1
    )
    assert main(["convert", "--to", "hf", str(ckpt), str(tmp_path / "hf")]) == 2
    assert "incomplete checkpoint" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="train.resume: no such directory"):
        load_config(None, ["train.resume=/nonexistent/checkpoint"])
