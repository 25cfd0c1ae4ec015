"""Shared driver of the per-family layout tests (tests/distributed/test_<family>_layouts.py): a
tiny model trained a few steps on packed documents, per layout, against the single process
(``check_layouts``), and a tiny ``transformers`` checkpoint trained from its HF directory and
exported back (``train_from_hf_and_export``)."""

from __future__ import annotations

import io
import json

import pytest
import torch
from dist_utils import run_distributed
from safetensors.torch import load_file

import bumblebee
from bumblebee import load_config
from bumblebee.models.base import persistent_buffers
from bumblebee.runtime.checkpoint.export import export_checkpoint
from bumblebee.runtime.trainer import Trainer

T = 128
DOCS = [[5, 100, 23], [128], [64, 30, 34], [1, 127]]  # one document spans every CP shard
COMMON = [
    f"train.seq_len={T}",
    "train.global_batch=4",
    "train.micro_batch=1",
    "train.clip_grad=0",
    "train.lr=3e-3",
    "train.warmup_steps=1",
    "data.source='jsonl'",
]
MB = ["train.balance=micro_batch"]  # pipeline schedules need the per-micro-batch balance loss


def write_data(path) -> str:
    g = torch.Generator().manual_seed(0)
    with open(path, "w") as f:
        for row in DOCS:
            for n in row:
                ids = torch.randint(0, 256, (n,), generator=g).tolist()
                f.write(json.dumps({"input_ids": ids}) + "\n")
    return str(path)


def run(base, overrides, data, out_dir, steps, save=False):
    """Per-step (loss, grad norm) of ``steps`` training steps; with ``save`` (one process) also
    the saved checkpoint's path and the trained parameters and buffers."""
    cfg = load_config(
        None,
        base
        + COMMON
        + [f"data.path={data}", f"train.out_dir={out_dir}", f"train.steps={steps}", *overrides],
    )
    trainer = Trainer(cfg, stream=io.StringIO())
    trace = [(r["loss"], r["grad_norm"]) for r in (trainer.train_step() for _ in range(steps))]
    if not save:
        return trace
    state = {n: t.detach().clone() for n, t in trainer.model.named_parameters()}
    state.update((n, b.detach().clone()) for n, b in persistent_buffers(trainer.model))
    return trace, trainer.checkpoint.save(trainer.step), state


def ranks(rank, world, base, cases, data, out_dir, steps):
    return [run(base, ov, data, f"{out_dir}/{i}/{rank}", steps) for i, ov in enumerate(cases)]


def check(trace, ref, what, step1=1e-5, later=1e-4):
    """Step 1 (same weights) at ``step1`` relative; later steps looser: sums in another order
    (EP's smaller GEMMs, the CP exchange) differ by ~1e-7 and Adam at lr 3e-3 amplifies that."""
    assert ref[0][0] > 0 and len(trace) == len(ref)
    for i, ((loss, gnorm), (ref_loss, ref_gnorm)) in enumerate(zip(trace, ref)):
        assert loss == pytest.approx(ref_loss, rel=step1 if i == 0 else later), (what, i)
        assert gnorm == pytest.approx(ref_gnorm, rel=5e-5 if i == 0 else 2e-3), (what, i)


def check_layouts(tmp_path, base, cases, steps, **tolerances):
    """Every layout of ``cases`` (one 2-rank spawn runs them all) against the single process
    (no sharding, local MoE): each rank's trace within ``check``'s ``tolerances``."""
    data = write_data(tmp_path / "docs.jsonl")
    ref = run(base, ["primitives.sharding=none", "primitives.moe_comm=local"], data,
              str(tmp_path / "ref"), steps)  # fmt: skip
    per_rank = run_distributed(ranks, 2, base, cases, data, str(tmp_path / "runs"), steps)
    for i, ov in enumerate(cases):
        for trace in [r[i] for r in per_rank]:  # (pipeline: the loss on every rank)
            check(trace, ref, " ".join(ov), **tolerances)


def train_from_hf_and_export(tmp_path, model_cls, config, family: str, eager: bool = False):
    """A bf16 ``model_cls(config)`` checkpoint: bumblebee reads and writes it back bit for bit;
    it trains 2 steps from its HF directory; the checkpoint exports (fp32) to the trained
    parameters and persistent buffers exactly, and ``transformers`` loads the export with equal
    logits (``eager``: HF's eager attention). Returns (trace, the source's tensors, the export)."""
    torch.manual_seed(0)
    model_cls(config).to(torch.bfloat16).save_pretrained(tmp_path / "src")
    # bf16 in, bf16 out: every tensor bit for bit
    bumblebee.to_hf(bumblebee.from_hf(str(tmp_path / "src"), torch.bfloat16), str(tmp_path / "rt"))
    src, rt = (load_file(tmp_path / d / "model.safetensors") for d in ("src", "rt"))
    assert set(src) == set(rt) and all(torch.equal(src[n], rt[n]) for n in src)
    data = write_data(tmp_path / "docs.jsonl")
    over = [f"model.hf_path={tmp_path / 'src'}", "primitives.sharding=none", "primitives.moe_comm=local"]  # fmt: skip
    trace, saved, state = run([f"model.name={family}"], over, data, str(tmp_path / "run"), 2, True)
    export_checkpoint(saved, str(tmp_path / "out"), dtype="float32")
    out = bumblebee.from_hf(str(tmp_path / "out"))
    for name, t in list(out.named_parameters()) + persistent_buffers(out):
        assert torch.equal(t, state[name]), name
    back = model_cls.from_pretrained(tmp_path / "out").float().eval()
    if eager:
        back.config._attn_implementation = "eager"
    ids = torch.randint(0, 256, (1, 32))
    with torch.no_grad():
        assert (back(ids).logits - out(ids)).abs().max().item() < 1e-4
    return trace, src, out
