"""Ctrl-C always stops a run with one line and exit 130, and leaves nothing half-written:
an interrupt during a checkpoint save (which DCP used to wrap into a multi-rank traceback)
and one that lands in the memory tracker's weakref callback (which Python swallows).
A global batch without a loss token is skipped and counted, never trained on."""

import json
import signal

import pytest
import torch
from cli_helpers import sets
from torch.distributed.checkpoint import FileSystemWriter

from bumblebee import load_config
from bumblebee.cli import main
from bumblebee.perf.memory import MemoryTracker
from bumblebee.runtime.launch.interrupts import interrupt_once
from bumblebee.runtime.trainer import Trainer

TINY = [
    "train.warmup_steps=1",
    "model.arch.num_hidden_layers=1",
    "model.arch.hidden_size=32",
    "model.arch.head_dim=8",
    "model.arch.moe_intermediate_size=16",
    "model.arch.num_experts=2",
    "model.arch.num_experts_per_tok=1",
    "primitives.loss=ce",
    "primitives.recompute=none",
    "train.seq_len=32",
    "train.global_batch=1",
    "data.min_records=1",
    "data.max_records=2",
]


def test_ctrl_c_during_a_save_exits_130_with_one_line_and_no_partial_checkpoint(
    tmp_path, capsys, monkeypatch
):
    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(FileSystemWriter, "write_data", interrupted)
    handler = signal.getsignal(signal.SIGINT)
    code = main(
        ["train"]
        + sets(TINY + ["train.steps=2", "train.save_every=1", f"train.out_dir={tmp_path}"])
    )
    err = capsys.readouterr().err
    assert code == 130 and err == "bumblebee: interrupted\n", err
    assert list((tmp_path / "checkpoints").iterdir()) == []  # neither step_N nor a .tmp- directory
    assert not (tmp_path / "bumblebee.lock").exists()
    assert signal.getsignal(signal.SIGINT) == handler  # restored for an in-process caller


def test_an_interrupt_inside_the_memory_trackers_weakref_callback_is_not_swallowed():
    class Interrupting:
        def __enter__(self):
            raise KeyboardInterrupt  # as if Ctrl-C arrived while the callback ran

        def __exit__(self, *exc):
            return False

    tracker = MemoryTracker("cpu").__enter__()
    lock = tracker._lock
    try:
        x = torch.ones(1000)
        tracker._lock = Interrupting()
        del x  # the weakref callback runs (and Python would print and drop its exception)
        tracker._lock = lock
        with pytest.raises(KeyboardInterrupt):
            torch.ones(10) + 1  # the next op re-raises it
        torch.ones(10) + 1  # once
    finally:
        tracker._lock = lock
        tracker.__exit__(None, None, None)


def test_sigint_raises_keyboard_interrupt_every_time_within_the_block():
    with pytest.raises(KeyboardInterrupt):
        with interrupt_once():
            try:
                signal.raise_signal(signal.SIGINT)
            except KeyboardInterrupt:
                pass  # swallowed by someone: the next Ctrl-C must still stop the run
            signal.raise_signal(signal.SIGINT)


def test_a_batch_without_loss_tokens_is_skipped_counted_and_not_trained_on(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    with open(data, "w") as f:  # two rows of 32 tokens: one with no loss token, one with
        f.write(json.dumps({"input_ids": list(range(1, 33)), "loss_mask": [0] * 32}) + "\n")
        f.write(json.dumps({"input_ids": list(range(1, 33))}) + "\n")
    cfg = load_config(
        None,
        TINY
        + [
            "data.source=jsonl",
            f"data.path={data}",
            "train.steps=2",
            f"train.out_dir={tmp_path / 'run'}",
            "train.warmup_steps=0",
        ],
    )
    t = Trainer(cfg)
    records = []
    for _ in range(2):
        before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
        records.append(t.train_step())
        t.metrics.log(records[-1])
        changed = [n for n, p in t.model.named_parameters() if not torch.equal(p, before[n])]
        if records[-1].get("skipped"):
            assert changed == [], changed  # router included: no update at all
        else:
            assert any("router" in n or "gate" in n for n in changed)
    assert sorted(bool(r.get("skipped")) for r in records) == [False, True]
    summary = t.metrics.close()
    assert summary["skipped_steps"] == 1 and summary["steps"] == 1
    assert "1 step(s) skipped" in capsys.readouterr().out
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x.get("skipped", False) for x in lines] == [r.get("skipped", False) for r in records]
    assert all(x["loss"] is None for x in lines if x.get("skipped"))
