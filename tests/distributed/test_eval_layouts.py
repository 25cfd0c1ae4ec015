"""Held-out evaluation is layout-free: after one training step, eval_loss, eval_tokens and
eval_accuracy of the synthetic task (the answer head, runtime/eval.py), and eval_loss of the
plain held-out path (the training loss call per micro-batch), equal the single-process figures
with pp = 2 (gpipe and 1f1b: the forward-only pass runs through the stages and the last stage's
sums reach every rank), cp = 2 and ep = 2 (FSDP2), on every rank."""

import io

import pytest
import torch
from dist_utils import run_distributed

from bumblebee import load_config
from bumblebee.runtime.eval import evaluate
from bumblebee.runtime.trainer import Trainer

BASE = [
    "model.arch.num_hidden_layers=3",
    "model.arch.hidden_size=64",
    "model.arch.moe_intermediate_size=32",
    "model.arch.num_experts=4",
    "model.arch.num_experts_per_tok=2",
    "train.seq_len=128",
    "train.global_batch=4",
    "train.micro_batch=1",
    "train.steps=1",
    "data.min_records=2",
    "data.max_records=6",
    "data.value_len=1",
    "data.eval_min_distance=32",
    "data.eval_docs=8",
    "train.lr=1e-2",
    "train.warmup_steps=1",
    "train.balance=micro_batch",
    "primitives.loss=linear_ce",
    "primitives.recompute=full",
]
REFERENCE = ["primitives.sharding=none", "primitives.moe_comm=local"]
LAYOUTS = {
    "pp=2 gpipe": ["parallel.pp=2", "primitives.pipeline=gpipe"],
    "pp=2 1f1b": ["parallel.pp=2", "primitives.pipeline=1f1b", "primitives.sharding=fsdp2"],
    "cp=2": ["parallel.cp=2", "primitives.sharding=fsdp2"],
    "ep=2": ["parallel.ep=2", "primitives.sharding=fsdp2", "primitives.moe_comm=alltoall"],
}


class _PlainHeldOut:
    """The source without its answers: ``evaluate`` takes the plain path (summed token loss)."""

    def __init__(self, source):
        self.eval_batch_list = source.eval_batch_list


def run(overrides, out_dir) -> dict:
    trainer = Trainer(
        load_config(None, BASE + overrides + [f"train.out_dir={out_dir}"]), stream=io.StringIO()
    )
    trainer.train_step()
    answers = evaluate(trainer)
    source, trainer.source = trainer.source, _PlainHeldOut(trainer.source)
    plain = evaluate(trainer)
    trainer.source = source
    return {**answers, "plain_loss": plain["eval_loss"], "plain_tokens": plain["eval_tokens"]}


def _ranks(rank, world, cases, out_dir):
    return [run(overrides, f"{out_dir}/{rank}/{i}") for i, overrides in enumerate(cases)]


def test_eval_on_pp_cp_ep_equals_one_process(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = run(REFERENCE, str(tmp_path / "ref"))
    finally:
        torch.set_num_threads(threads)
    assert 0 < ref["eval_accuracy"] < 1 and ref["eval_tokens"] > 0
    per_rank = run_distributed(_ranks, 2, list(LAYOUTS.values()), str(tmp_path))
    for rank, results in enumerate(per_rank):
        for name, got in zip(LAYOUTS, results):
            what = f"{name}, rank {rank}"
            assert (
                got["eval_tokens"] == ref["eval_tokens"]
                and got["plain_tokens"] == ref["plain_tokens"]
            ), what
            assert got["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-5), what
            assert got["eval_accuracy"] == ref["eval_accuracy"], what
            assert got["plain_loss"] == pytest.approx(ref["plain_loss"], rel=1e-5), what
