"""Resume from a run's own checkpoints, on every sharding, with ep / cp / pp.

Per layout (2 ranks; ``none`` is single-process only): a 4-step run saving at steps 2 and 4
and evaluating before each save (``train.eval_every = 2``: a held-out forward runs right
before the checkpoint, as at the end of every run with the default ``eval_every``). Then

- a run resumed from the mid-run checkpoint (step 2) gives bit-identical losses;
- the finished run is extended with ``--resume auto`` and a larger ``train.steps`` (the most
  common resume: continue a run that ended), from its final checkpoint (step 4); its losses
  equal those of the same checkpoint resumed in one process (a different layout, so up to
  float rounding): the saved optimizer state is complete.

This once failed for fsdp2 (``checkpoint lacks optim/model.norm.weight/step``): a forward
without backward (the evaluation) leaves FSDP2's root unit gathered, its parameters then are
not the optimizer's sharded ones, and the save dropped their optimizer state. The earlier
tests resumed only from mid-run checkpoints of runs that evaluated at their last step only.
"""

import io
import os

import pytest
from dist_utils import run_distributed

from bumblebee import load_config
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
    "train.seq_len=32",
    "train.global_batch=4",
    "train.micro_batch=1",
    "data.min_records=1",
    "data.max_records=2",
    "train.lr=1e-2",
    "train.warmup_steps=1",
    "train.deterministic=true",
    "train.save_every=2",
    "train.keep_last=0",
    "train.eval_every=2",
    "train.balance=micro_batch",
]  # pp=2 resumes need per-micro-batch balance statistics
LAYOUTS = {
    "fsdp2 dp2": ["primitives.sharding=fsdp2"],
    "fsdp2 ep2": ["primitives.sharding=fsdp2", "parallel.ep=2"],
    "fsdp2 cp2": ["primitives.sharding=fsdp2", "parallel.cp=2"],
    "fsdp2 pp2": [
        "primitives.sharding=fsdp2",
        "parallel.pp=2",
        "train.eval_every=0",
    ],  # no eval with pp yet,
    "zero1 ep2": ["primitives.sharding=zero1", "parallel.ep=2"],
}


def config(out_dir, *extra):
    return load_config(None, BASE + [*extra, f"train.out_dir={out_dir}"])


def losses(cfg):
    """(step the run started at, its per-step losses, logged on rank 0, the steps that evaluated)."""
    trainer = Trainer(cfg, stream=io.StringIO())
    start = trainer.step
    trainer.run()
    history = trainer.metrics.history
    return start, [r["loss"] for r in history], [r["step"] for r in history if "eval_loss" in r]


def ckpt(out_dir, step):
    return os.path.join(out_dir, "checkpoints", f"step_{step:08d}")


def three_runs(root, layouts):
    """Per layout: the full run, the mid-run resume, the extension of the finished run."""
    out = {}
    for name, layout in layouts.items():
        run = f"{root}/{name}"
        full = losses(config(run, *layout, "train.steps=4"))
        mid = losses(config(f"{run}-mid", *layout, "train.steps=4", f"train.resume={ckpt(run, 2)}"))
        extended = losses(config(run, *layout, "train.steps=6", "train.resume=auto"))
        out[name] = full, mid, extended
    return out


def _ranks(rank, world, root):
    return three_runs(root, LAYOUTS)


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("resume"))
    out = run_distributed(_ranks, 2, root)[0]
    out.update(three_runs(root, {"none": ["primitives.sharding=none"]}))
    return root, out


@pytest.mark.parametrize("name", [*LAYOUTS, "none"])
def test_resume_from_mid_run_and_final_checkpoints(matrix, name, tmp_path):
    root, out = matrix
    (start, full, evaluated), (mid_start, mid, _), (ext_start, extended, _) = out[name]
    assert start == 0 and len(full) == 4
    assert evaluated == ([] if "pp" in name else [2, 4])  # each save came right after an evaluation
    assert mid_start == 2 and mid == full[2:]  # bit-identical
    assert ext_start == 4 and len(extended) == 2  # continued from the final checkpoint
    assert sorted(
        n for n in os.listdir(os.path.join(root, name, "checkpoints")) if n.startswith("step_")
    ) == [f"step_{s:08d}" for s in (2, 4, 6)]
    # the same final checkpoint in one process: the same continuation (complete optimizer state)
    ref_start, ref, _ = losses(
        config(tmp_path, "train.steps=6", f"train.resume={ckpt(os.path.join(root, name), 4)}")
    )
    assert ref_start == 4 and extended == pytest.approx(ref, rel=1e-5)
