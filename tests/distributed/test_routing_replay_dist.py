"""Routing replay across ranks: expert ids recorded by a single process at the initial weights
are sharded like ``input_ids`` (dp rows, then the zigzag CP share) and replayed after one
optimizer step under EP (alltoall and chunked) and CP, with full recompute: the replayed loss
and gradient norm equal the single-process replay, the replayed forward routes exactly as
given, and the unreplayed forward routes differently."""

import io
import math

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed

from bumblebee import load_config
from bumblebee.primitives.moe.replay import RoutingScope
from bumblebee.runtime.step import local_batch, shard_rows
from bumblebee.runtime.trainer import Trainer

# Adam with eps = 1 moves weights about lr * gradient (no sign-like first step that would turn
# float noise between layouts into +-lr updates), enough at lr 2 to change the routing.
BASE = [
    "model.arch.num_hidden_layers=2",
    "model.arch.hidden_size=32",
    "model.arch.head_dim=8",
    "model.arch.moe_intermediate_size=16",
    "model.arch.num_experts=8",
    "model.arch.num_experts_per_tok=2",
    "primitives.loss=ce",
    "primitives.recompute=full",
    "train.seq_len=64",
    "train.global_batch=2",
    "train.micro_batch=1",
    "train.eval_every=0",
    "train.lr=2.0",
    "train.eps=1.0",
    "train.warmup_steps=0",
    "data.min_records=2",
    "data.max_records=4",
]


def replay_run(overrides, out_dir, given_BTLK):
    """Record, one step, replay ``given_BTLK`` (global rows; None: what this run recorded)."""
    t = Trainer(
        load_config(None, BASE + overrides + [f"train.out_dir={out_dir}"]), stream=io.StringIO()
    )
    rows, cp, cp_rank = t.rows_per_rank, t.cp, t.cp_rank
    lo = t.dp_rank * rows
    local = local_batch(t.source.rows_at(0, lo, lo + rows), cp, cp_rank, t.device)
    tokens = max(t.source.num_valid_at(0), 1)
    recorded = t.model.record_routing(local.input_ids, local.position_ids)
    t.train_step()
    given = (
        recorded
        if given_BTLK is None
        else shard_rows({"r": given_BTLK}, rows, t.dp_rank, cp, cp_rank)["r"]
    )
    free = t.model.record_routing(local.input_ids, local.position_ids)
    scope = RoutingScope(replay_BTLK=given, record={})
    t.sharding.set_grad_sync(True)
    terms = t.model.loss_terms(local.input_ids, local.labels, local.position_ids, routing=scope)
    (terms.loss_sum / tokens).backward()
    t.sharding.reduce_grads()
    gnorm = float(t.sharding.clip_grad_norm(math.inf))
    figures = torch.tensor(
        [
            float(terms.loss_sum.detach()),
            float((free != given).sum()),
            float((scope.recorded() != given).sum()),
        ]
    )
    if dist.is_initialized():
        dist.all_reduce(figures, group=t.ctx.dp_cp_group)
    return recorded, figures.tolist(), gnorm


def _ranks(rank, world, cases, out_dir, given):
    return [replay_run(o, f"{out_dir}/{rank}", given)[1:] for o in cases]


CASES = {
    "ep=2 alltoall": ["parallel.ep=2", "primitives.moe_comm=alltoall"],
    "ep=2 chunked": ["parallel.ep=2", "primitives.moe_comm=chunked"],
    "cp=2": ["parallel.cp=2"],
}


def test_replay_is_exact_under_ep_and_cp(tmp_path):
    recorded, (loss, moved, off), gnorm = replay_run(
        ["primitives.sharding=none", "primitives.moe_comm=local"], tmp_path / "ref", None
    )
    assert moved > 0 and off == 0
    results = run_distributed(_ranks, 2, list(CASES.values()), str(tmp_path), recorded)[0]
    for name, ((got, m, o), g) in zip(CASES, results):
        assert o == 0, f"{name}: the replayed forward did not route as given"
        assert m > 0, f"{name}: the unreplayed forward should route differently after the step"
        assert got == pytest.approx(loss, rel=1e-5), name
        assert g == pytest.approx(gnorm, rel=1e-4), name
