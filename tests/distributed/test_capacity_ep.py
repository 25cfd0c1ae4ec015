"""Expert capacity with token dropping (``moe.capacity_factor``, primitives/moe/capacity.py).

Rule: each expert keeps the first ``ceil(f * T * K / E)`` (token, choice) pairs in token order;
the others are dropped. Layer level: with skewed routing (some experts far over capacity),
``local``, ``alltoall`` and ``chunked`` (ep = 2, recompute none) with drops give the output and
the input, router-weight and expert-weight gradients of the reference, ``local`` without drops
and the dropped pairs' combine weights multiplied by 0. Model level (one process): a run with
capacity logs the dropped pairs and a factor large enough to drop nothing equals the run
without capacity."""

import io

import torch
import torch.distributed as dist
from dist_utils import run_distributed

from bumblebee import load_config, registry
from bumblebee.config import PrimitivesConfig
from bumblebee.models.blocks import MoE
from bumblebee.models.qwen3_moe import Qwen3MoeArch
from bumblebee.primitives.moe.capacity import capacity, drop_over_capacity
from bumblebee.primitives.parallel import ParallelGroups
from bumblebee.runtime.trainer import Trainer

E, H, FFN, K, T = 8, 32, 16, 2, 24


def test_drop_rule():
    idx = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0]])  # expert 0 gets 4 pairs, capacity 2
    assert capacity(1.0, 4, 2, 4) == 2
    kept, dropped = drop_over_capacity(idx, 4, 1.0)
    assert kept.tolist() == [[0, 1], [0, 2], [4, 1], [3, 4]] and int(dropped) == 2


def run_layer(rank, world, comm, f, reference=False):
    arch = Qwen3MoeArch(
        vocab_size=97,
        hidden_size=H,
        intermediate_size=48,
        moe_intermediate_size=FFN,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=E,
        num_experts_per_tok=K,
    )
    group = None if comm == "local" else dist.group.WORLD
    dispatch = registry.get("moe_comm", comm).factory(num_experts=E, ep_group=group, num_chunks=2)
    moe = MoE(arch, PrimitivesConfig(experts="loop"), dispatch, ParallelGroups(ep_group=group))
    g = torch.Generator().manual_seed(7)
    w1, w2 = (
        torch.randn(E, 2 * FFN, H, generator=g) * 0.1,
        torch.randn(E, H, FFN, generator=g) * 0.1,
    )
    lo, n = (0, E) if comm == "local" else (rank * (E // world), E // world)
    with torch.no_grad():
        moe.experts.w_gate_up.copy_(w1[lo : lo + n])
        moe.experts.w_down.copy_(w2[lo : lo + n])
    g = torch.Generator().manual_seed(300 + rank)
    x = torch.randn(T, H, generator=g).requires_grad_()
    weight = torch.rand(T, K, generator=g).requires_grad_()
    scores = torch.rand(T, E, generator=g)
    scores[:, :2] += 0.6  # experts 0 and 1 are asked by most tokens: far over capacity
    idx = scores.topk(K, dim=-1).indices
    kept, dropped = drop_over_capacity(idx, E, f)
    if reference:  # no drops: the dropped pairs' weights times 0
        y = moe.dispatch(x, idx, weight * (kept != E), moe._run_experts)
    else:
        y = moe.dispatch(x, kept, weight, moe._run_experts, drops=True)
    probe = torch.randn(T, H, generator=g)
    (y * probe).sum().backward()
    gw = [
        torch.zeros_like(p) if p.grad is None else p.grad
        for p in (moe.experts.w_gate_up, moe.experts.w_down)
    ]
    if comm == "local" and world > 1:  # every rank's tokens reach all experts: sum, then EP's slice
        for t in gw:
            dist.all_reduce(t)
        gw = [t[rank * (E // world) : (rank + 1) * (E // world)] for t in gw]
    return int(dropped), [y.detach(), x.grad, weight.grad] + gw


def _ranks(rank, world, f):
    ref = run_layer(rank, world, "local", f, reference=True)
    return ref, {c: run_layer(rank, world, c, f) for c in ("local", "alltoall", "chunked")}


def test_dispatchers_with_drops_match_the_reference(tmp_path):
    for rank, (ref, got) in enumerate(run_distributed(_ranks, 2, 1.0)):
        assert ref[0] > 0, "the routing should exceed capacity"
        for comm, (dropped, tensors) in got.items():
            assert dropped == ref[0]
            for name, a, b in zip(("y", "dx", "dweight", "dw_gate_up", "dw_down"), tensors, ref[1]):
                torch.testing.assert_close(
                    a, b, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {comm} {name}"
                )


SMALL = [
    "model.arch.num_hidden_layers=2",
    "model.arch.hidden_size=32",
    "model.arch.head_dim=8",
    "model.arch.moe_intermediate_size=16",
    "model.arch.num_experts=8",
    "model.arch.num_experts_per_tok=2",
    "primitives.loss=ce",
    "train.seq_len=64",
    "train.global_batch=2",
    "train.micro_batch=1",
    "train.eval_every=0",
    "train.steps=2",
    "primitives.sharding=none",
    "primitives.moe_comm=local",
]


def trace(tmp_path, *extra):
    t = Trainer(
        load_config(None, SMALL + [f"train.out_dir={tmp_path}", *extra]), stream=io.StringIO()
    )
    return [t.train_step() for _ in range(2)]


def test_model_runs_log_drops(tmp_path):
    plain = trace(tmp_path / "a")
    tight = trace(tmp_path / "b", "moe.capacity_factor=0.5")
    loose = trace(
        tmp_path / "c", f"moe.capacity_factor={float(E)}"
    )  # capacity = all pairs: nothing dropped
    assert all(r["dropped_tokens"] == 0 for r in plain + loose) and all(
        r["dropped_tokens"] > 0 for r in tight
    )
    assert [r["loss"] for r in loose] == [r["loss"] for r in plain]
    assert tight[1]["loss"] != plain[1]["loss"]
