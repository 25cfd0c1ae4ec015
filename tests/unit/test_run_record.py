"""A run never destroys another run's record (runtime/checkpoint/record.py): every file a run writes
(``config.toml``, ``metrics.jsonl``, ``checkpoints/step_*``, ``hf/``) against every way a
second run meets it in the same ``out_dir``:

- a fresh run (same or different config, ``--resume auto`` finding no checkpoint, resumed
  from a checkpoint elsewhere): the first run's whole record moves to ``previous/<stamp>/``,
  byte for byte;
- a continuation (``--resume auto`` / one of ``out_dir``'s own checkpoints, with the same or a
  longer ``train.steps``): the record continues; what it replaces (later checkpoints, metrics
  lines past the step resumed from, a changed ``config.toml``, ``hf/``) is set aside first;
- an interrupted run: a SIGTERM save with ``save_every = 0`` in an ``out_dir`` holding an
  earlier run's checkpoints leaves them intact (set aside), and ``--resume auto`` then takes
  the interrupted run's own checkpoint.
"""

import json
import os
import shutil
import signal

import pytest

from bumblebee import load_config
from bumblebee.cli import main
from bumblebee.runtime.checkpoint.directory import find_checkpoint
from bumblebee.runtime.launch.signals import Preempted
from bumblebee.runtime.trainer import Trainer

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
    "train.keep_last=0",
]


def train(out, *extra, resume=None) -> int:
    argv = ["train"] + [
        a for s in TINY + list(extra) + [f"train.out_dir={out}"] for a in ("--set", s)
    ]
    return main(argv + (["--resume", str(resume)] if resume else []))


def snapshot(d) -> dict[str, bytes]:
    """Every file under ``d`` (relative path -> bytes), ``previous/`` and the lock excluded."""
    out = {}
    for root, dirs, files in os.walk(d):
        dirs[:] = [x for x in dirs if x != "previous"]
        for f in files:
            path = os.path.join(root, f)
            with open(path, "rb") as fh:
                out[os.path.relpath(path, d)] = fh.read()
    return out


def steps_of(path) -> list[int]:
    return [json.loads(line)["step"] for line in open(path)]


def the_previous(out):
    (stamp,) = os.listdir(out / "previous")
    return out / "previous" / stamp


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    """A finished run: 4 steps, checkpoints at 2 and 4, an export, metrics and config."""
    out = tmp_path_factory.mktemp("first")
    assert train(out, "train.steps=4", "train.save_every=2", "train.export_hf=true") == 0
    record = snapshot(out)
    assert {
        "config.toml",
        "metrics.jsonl",
        "hf/config.json",
        "checkpoints/step_00000002/complete.json",
        "checkpoints/step_00000004/complete.json",
    } <= set(record)
    return out, record


@pytest.fixture
def used(first, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(first[0], out)
    return out, first[1]


@pytest.mark.parametrize(
    "second",
    [
        ["train.steps=2"],  # same config otherwise, no checkpoints
        ["train.steps=3", "train.lr=5e-3", "train.save_every=1"],  # a different config that saves
        [
            "train.steps=1",
            "train.resume=auto",
            "train.save_every=0",
        ],  # --resume auto is only a fresh start here...
    ],
)
def test_a_fresh_run_moves_the_whole_earlier_record_aside(used, second, capsys):
    out, record = used
    if (
        "train.resume=auto" in second
    ):  # ...when out_dir has no checkpoint: an earlier run that never saved
        shutil.rmtree(out / "checkpoints")
        record = {k: v for k, v in record.items() if not k.startswith("checkpoints/")}
    assert train(out, *second) == 0
    assert snapshot(the_previous(out)) == record  # every file of the first run, byte for byte
    assert steps_of(out / "metrics.jsonl")[0] == 1 and not (out / "hf").exists()
    assert "set aside the earlier record" in capsys.readouterr().out


def test_a_run_resumed_from_elsewhere_is_a_new_run(used, first, tmp_path):
    out, record = used
    other = first[0] / "checkpoints" / "step_00000002"
    assert train(out, "train.steps=3", resume=other) == 0
    assert snapshot(the_previous(out)) == record
    assert steps_of(out / "metrics.jsonl") == [
        3
    ]  # its own steps only: none of the first run's lines


def test_extending_a_finished_run_continues_its_record(used):
    out, record = used
    assert train(out, "train.steps=6", "train.save_every=2", resume="auto") == 0
    assert steps_of(out / "metrics.jsonl") == [1, 2, 3, 4, 5, 6]
    assert (
        (out / "metrics.jsonl").read_bytes().startswith(record["metrics.jsonl"])
    )  # the lines kept as written
    now = snapshot(out)
    assert all(now[k] == v for k, v in record.items() if k.startswith("checkpoints/"))
    aside = snapshot(
        the_previous(out)
    )  # replaced: the config (steps changed) and the step-4 export
    assert aside == {k: v for k, v in record.items() if k == "config.toml" or k.startswith("hf/")}
    assert "steps = 6" in (out / "config.toml").read_text()


def test_resuming_mid_run_sets_the_abandoned_future_aside(used):
    out, record = used
    assert (
        train(
            out,
            "train.steps=4",
            "train.save_every=2",
            "train.lr=5e-3",
            resume=out / "checkpoints" / "step_00000002",
        )
        == 0
    )
    assert steps_of(out / "metrics.jsonl") == [1, 2, 3, 4]
    assert "lr = 0.005" in (out / "config.toml").read_text()
    aside = snapshot(the_previous(out))
    assert aside == {
        k: v
        for k, v in record.items()
        if k in ("config.toml", "metrics.jsonl")
        or k.startswith(("hf/", "checkpoints/step_00000004/"))
    }
    assert find_checkpoint("auto", str(out)) == str(out / "checkpoints" / "step_00000004")
    assert (out / "checkpoints" / "step_00000004" / "config.toml").read_text() != record[
        "checkpoints/step_00000004/config.toml"
    ].decode()  # the new run's save, not the old one


def test_a_preemption_save_keeps_an_earlier_runs_checkpoints(used):
    """save_every = 0: the only save is the SIGTERM one, at step 1 of the second run."""
    out, record = used
    t = Trainer(
        load_config(None, TINY + ["train.steps=4", "train.save_every=0", f"train.out_dir={out}"])
    )
    inner = t.train_step

    def train_step():
        if t.step == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        return inner()

    t.train_step = train_step
    with pytest.raises(Preempted):
        t.run()
    assert snapshot(the_previous(out)) == record  # the earlier run's step_2 / step_4 intact
    assert sorted(os.listdir(out / "checkpoints")) == ["step_00000001"]
    assert find_checkpoint("auto", str(out)) == str(out / "checkpoints" / "step_00000001")
    assert (
        train(out, "train.steps=2", resume="auto") == 0
    )  # continues the interrupted run, no mixing
    assert steps_of(out / "metrics.jsonl") == [1, 2]
