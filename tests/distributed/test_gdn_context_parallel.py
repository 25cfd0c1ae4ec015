"""Context parallelism for Gated DeltaNet and the Qwen3.5 hybrid model (gloo).

- the primitive alone (``linear_attention/cp.py``): one GatedDeltaNet layer on cp=2 and
  cp=4 zigzag shards (state scan on the zigzag chunks, and with ``relayout`` to contiguous
  shards) equals the layer run on the whole sequence in one process: outputs, input
  gradients and every weight gradient, on packed documents with 1- and 2-token documents,
  a document spanning all ranks, boundaries exactly at shard edges and one token before
  one (a partial conv halo); the zigzag <-> contiguous conversion is a round trip;
- the model through the Trainer: cp=2 and cp=4 give the loss and gradients of cp=1
  (1e-5 relative, fp32) on packed documents of uneven lengths; cp=2 x ep=2 (fsdp2) matches
  the single-process losses over 5 steps.

One spawn per world size runs all cases of that size (spawning dominates the runtime); the
4-rank spawn also runs Kimi Delta Attention's cp = 4 check (``tests/kda_cp.py``: the KDA layer
on cp=4 shards, and the Kimi Linear model's loss trace against cp = 1 to 1e-6).
"""

import io
import json

import family_layouts
import kda_cp
import pytest
import torch
from dist_utils import run_distributed

from bumblebee import load_config
from bumblebee.primitives.cp.relayout import (
    contiguous_to_zigzag,
    moved_fraction,
    zigzag_to_contiguous,
)
from bumblebee.primitives.cp.zigzag import build_cp_shards, shard_sequence, unshard_sequence
from bumblebee.primitives.linear_attention.cp import gated_delta_net_cp
from bumblebee.primitives.linear_attention.gated_delta_rule import gated_delta_rule_chunked
from bumblebee.primitives.linear_attention.gdn import GatedDeltaNet
from bumblebee.primitives.packed import doc_layout
from bumblebee.primitives.recompute import NoRecompute
from bumblebee.runtime.trainer import Trainer

# ---- the primitive ------------------------------------------------------------------------

T_LAYER = 64  # cp=2: chunks of 16; cp=4: chunks of 8
# row 0: boundaries at 5, 32 (a shard edge for cp=2 and 4) and 48 (an edge); row 1: a 1- and a
# 2-token document, a boundary at 15 (one token before an edge: partial halo), one long document
LAYER_DOCS = [[5, 27, 16, 16], [1, 2, 12, 49]]


def layer_and_inputs():
    torch.manual_seed(0)
    # K = 16 != V = 8 and 2 key heads for 4 value heads: catches transposed or mixed-up dims
    layer = GatedDeltaNet(32, 2, 4, 16, 8, 4, 1e-6, gated_delta_rule_chunked, NoRecompute())
    with torch.no_grad():
        layer.A_log.copy_(
            torch.tensor([0.0, -1.0, 0.5, -3.0])
        )  # mild decays: the state carries far
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(len(LAYER_DOCS), T_LAYER, 32, generator=gen)
    w = torch.randn(len(LAYER_DOCS), T_LAYER, 32, generator=gen)
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in LAYER_DOCS])
    return layer, x, w, pos


def layer_reference():
    layer, x, w, pos = layer_and_inputs()
    x = x.clone().requires_grad_()
    y, _ = layer(x, doc_layout(pos))
    (y * w).sum().backward()
    return y.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}


def layer_cp(rank, world, relayout):
    layer, x, w, pos = layer_and_inputs()
    layout = build_cp_shards(shard_sequence(pos, world, rank), torch.distributed.group.WORLD)
    x_local = shard_sequence(x, world, rank).clone().requires_grad_()
    y = gated_delta_net_cp(layer, x_local, layout, relayout=relayout)
    (y * shard_sequence(w, world, rank)).sum().backward()
    return y.detach(), x_local.grad, {n: p.grad for n, p in layer.named_parameters()}


def relayout_and_errors(rank, world):
    pos = torch.arange(8 * world).view(1, -1)  # chunks of 4 tokens
    layout = build_cp_shards(shard_sequence(pos, world, rank), torch.distributed.group.WORLD)
    x = shard_sequence(pos, world, rank)
    contiguous = zigzag_to_contiguous(x, layout)
    assert contiguous.flatten().tolist() == list(range(rank * 8, (rank + 1) * 8))
    assert torch.equal(contiguous_to_zigzag(contiguous, layout), x)
    # segments shorter than the conv window (2 tokens < kernel - 1 = 3) are refused, on every rank
    layer = layer_and_inputs()[0]
    pos = torch.arange(4 * world).view(1, -1)
    layout = build_cp_shards(shard_sequence(pos, world, rank), torch.distributed.group.WORLD)
    with pytest.raises(ValueError, match="shorter than the conv window"):
        gated_delta_net_cp(layer, torch.zeros(1, 4, 32), layout)


def check_layer(results, world, what):
    y_ref, gx_ref, grads_ref = layer_reference()
    y = unshard_sequence([r[0] for r in results])
    gx = unshard_sequence([r[1] for r in results])
    for got, ref, name in [(y, y_ref, "output"), (gx, gx_ref, "input grad")] + [
        (sum(r[2][n] for r in results), g, n) for n, g in grads_ref.items()
    ]:
        err = ((got - ref).norm() / ref.norm()).item()
        assert err < 1e-5, f"{what} cp={world}: {name} relative error {err:.1e}"


# ---- the model through the Trainer -------------------------------------------------------------

T = 256
# per row: one shorter than a cp=4 chunk (32), one spanning all ranks, boundaries at shard edges
DOCS = [[5, 200, 17, 34], [250, 6], [64, 64, 64, 64], [1, 127, 128]]
BASE = [
    "model.name=qwen3_5_moe",
    "model.preset=tiny",
    "model.arch.hidden_size=64",
    "model.arch.moe_intermediate_size=32",
    "model.arch.shared_expert_intermediate_size=32",
    "model.arch.num_experts=4",
    "model.arch.vocab_size=256",
    "model.arch.linear_key_head_dim=16",
    "model.arch.linear_value_head_dim=16",
    "model.arch.head_dim=16",
    f"train.seq_len={T}",
    "train.global_batch=4",
    "train.micro_batch=2",
    "train.clip_grad=0",
    "train.lr=1e-3",
    "train.warmup_steps=1",
    "primitives.loss=ce",
    "primitives.recompute=none",
    "data.source='jsonl'",
]


def write_data(path) -> str:
    g = torch.Generator().manual_seed(0)
    with open(path, "w") as f:
        for row in DOCS:
            for n in row:
                f.write(
                    json.dumps({"input_ids": torch.randint(0, 256, (n,), generator=g).tolist()})
                    + "\n"
                )
    return str(path)


def train(overrides, data, out_dir, steps):
    cfg = load_config(
        None,
        BASE
        + [f"data.path={data}", f"train.out_dir={out_dir}", f"train.steps={steps}", *overrides],
    )
    trainer = Trainer(cfg, stream=io.StringIO())
    grads, step = {}, trainer.sharding.step

    def capture(
        optimizer,
    ):  # replicated dense gradients of the first step, after reduction, before the update
        if not grads:
            grads.update(
                {
                    n: p.grad.detach().clone()
                    for n, p in trainer.model.named_parameters()
                    if p.grad is not None and "experts" not in n and type(p.grad) is torch.Tensor
                }
            )
        step(optimizer)

    trainer.sharding.step = capture
    trace = [trainer.train_step() for _ in range(steps)]
    return [(r["loss"], r["grad_norm"]) for r in trace], grads


def _ranks(rank, world, cases, data, out_dir, kimi_data=None):
    prim = [layer_cp(rank, world, relayout) for relayout in (False, True)]
    relayout_and_errors(rank, world)
    models = [train(ov, data, f"{out_dir}/{rank}", steps) for ov, steps in cases]
    return prim, models, kimi_data and kda_cp.cp4_rank(rank, world, kimi_data, out_dir)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The single-process references run on 1 thread, as the spawned ranks do (2 threads on a
    loaded 2-core machine thrash: 20x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_data(tmp_path_factory.mktemp("gdn_cp") / "docs.jsonl")


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
    return train(["primitives.sharding=none"], data, tmp_path_factory.mktemp("ref"), 5)


def check_model(result, ref, steps, what):
    (trace, grads), (ref_trace, ref_grads) = result, ref
    for (loss, gnorm), (ref_loss, ref_gnorm) in zip(trace[:steps], ref_trace[:steps]):
        assert loss == pytest.approx(ref_loss, rel=1e-5), what
        assert gnorm == pytest.approx(ref_gnorm, rel=1e-5), what
    assert grads or steps > 1, f"{what}: no gradients captured"
    for name, g in grads.items():
        err = ((g - ref_grads[name]).norm() / ref_grads[name].norm()).item()
        assert err < 1e-5, f"{what}: {name} gradient relative error {err:.1e}"
    assert any("linear_attn" in n for n in grads) or steps > 1


TWO = [
    (["parallel.cp=2", "primitives.sharding=zero1", "primitives.cp_attention=ring"], 1),
    # the probe-free relay (cp_relay.py) under full recompute: the recompute re-runs the relay chain
    (
        [
            "parallel.cp=2",
            "primitives.sharding=zero1",
            "primitives.cp_attention=ring",
            "primitives.linear_attention_cp=relay",
            "primitives.recompute=full",
        ],
        2,
    ),
]
FOUR = [
    (["parallel.cp=4", "primitives.sharding=zero1", "primitives.cp_attention=allgather"], 1),
    # the default recipe's linear CE and full recompute (the recompute re-runs the halo and scan)
    (
        [
            "parallel.cp=2",
            "parallel.ep=2",
            "primitives.sharding=fsdp2",
            "primitives.cp_attention=ring",
            "primitives.moe_comm=alltoall",
            "primitives.loss=linear_ce",
            "primitives.recompute=full",
        ],
        5,
    ),
]


@pytest.mark.parametrize("world,cases", [(2, TWO), (4, FOUR)], ids=["cp2", "cp4_and_cp2xep2"])
def test_gdn_cp_matches_single_process(world, cases, reference, data, tmp_path):
    kimi = world == 4 and family_layouts.write_data(tmp_path / "kimi_docs.jsonl")
    results = run_distributed(_ranks, world, cases, data, str(tmp_path), kimi or None)
    if kimi:
        kda_cp.check_cp4([r[2] for r in results], kda_cp.reference(kimi, tmp_path / "kimi_ref"))
    for i, relayout in enumerate((False, True)):
        check_layer([r[0][i] for r in results], world, "relayout" if relayout else "zigzag")
    for (ov, steps), result in zip(cases, results[0][1]):
        check_model(result, reference, steps, " ".join(ov))
    for rank_result in results[1:]:  # every rank logs the same global figures
        for _, mine, first in zip(cases, rank_result[1], results[0][1]):
            assert mine[0] == first[0]


def test_moved_fraction_and_check_run(data):
    from bumblebee.runtime.resolve import check_run

    assert moved_fraction(2) == 0.5 and moved_fraction(4) == 0.75
    check_run(
        load_config(None, BASE + [f"data.path={data}", "parallel.cp=2"]), 2
    )  # qwen3_5_moe accepts cp
