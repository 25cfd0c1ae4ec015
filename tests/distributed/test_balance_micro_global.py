"""``train.balance = "micro_batch_global"`` (the default at pp = 1) against its written-out
definition on 1, 2 and 4 ranks: with M micro-batches per rank and the router stats
``LS[r, i]`` of rank r's micro-batch i,

    aux = (1/M) sum_i  step_loss( sum_r LS[r, i] )

(step_loss: ``(1/L) sum_l E sum_e (C_le / T_l) (P_le / T_l)`` over the counts, probability
sums and tokens pooled over the dp x cp group), and the gradient summed over ranks is that of
``sum_i [loss_sum_i / global_tokens] + coef * aux`` with the frequencies held constant. The
written-out form runs plain autograd on every micro-batch's stats; the runtime's path
(``accumulate_global_balance(window=1)``) keeps one micro-batch's graph at a time. Also: with
one micro-batch per rank it is ``step`` exactly."""

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed

from bumblebee.config import ModelConfig, PrimitivesConfig
from bumblebee.data.packing import Batch
from bumblebee.models import build_model, resolve_arch
from bumblebee.primitives.moe import balance
from bumblebee.runtime.step import accumulate_global_balance

COEF, T, M = 0.5, 24, 3


def _model():
    cfg = ModelConfig(name="qwen3_moe")
    cfg.arch = {"num_hidden_layers": 2, "hidden_size": 32, "head_dim": 8, "num_experts": 8}
    cfg.arch |= {"num_experts_per_tok": 2, "moe_intermediate_size": 16}
    prims = PrimitivesConfig(loss="ce", recompute="none", moe_comm="local", attention="sdpa")
    return build_model(resolve_arch(cfg), prims, seed=0)


def _parts(rank: int, micro: int) -> list[Batch]:
    g = torch.Generator().manual_seed(100 + rank)
    out = []
    for _ in range(micro):
        ids = torch.randint(0, 256, (1, T), generator=g)
        out.append(Batch(ids, ids.roll(-1, 1), torch.arange(T)[None]))
    return out


def _grads(model, group):
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    if group is not None:
        dist.all_reduce(flat, group=group)
    return flat


def _written_out(model, parts, tokens, group):
    """The definition, by hand: every micro-batch's stats, summed over ranks per index."""
    model.zero_grad()
    terms = [model.loss_terms(p.input_ids, p.labels, p.position_ids, balance="step") for p in parts]
    pooled = [t.router_stats.detach().clone() for t in terms]
    if group is not None:
        for s in pooled:
            dist.all_reduce(s, group=group)
    aux = sum(balance.step_loss(s) for s in pooled) / len(parts)
    total = sum(
        t.loss_sum / tokens + COEF * balance.step_loss_share(t.router_stats, s) / len(parts)
        for t, s in zip(terms, pooled)
    )
    total.backward()
    return aux, _grads(model, group)


def _check(rank, world, micro):
    group = dist.group.WORLD if world > 1 else None
    model, parts = _model(), _parts(rank, micro)
    tokens = world * micro * T
    aux_ref, grads_ref = _written_out(model, parts, tokens, group)
    model.zero_grad()
    ctx = torch.autocast("cpu", enabled=False)
    got = accumulate_global_balance(parts, None, model, tokens, COEF, ctx, group, window=1)
    grads = _grads(model, group)
    model.zero_grad()
    step = accumulate_global_balance(parts, None, model, tokens, COEF, ctx, group, window=None)
    return (
        float(got["aux"]),
        float(aux_ref),
        grads,
        grads_ref,
        float(step["aux"]),
        _grads(model, group),
    )


@pytest.mark.parametrize("world", [1, 2, 4])
def test_matches_its_definition(world):
    if world == 1:
        results = [_check(0, 1, M)]
    else:
        results = run_distributed(_check, world, M)
    for aux, aux_ref, grads, grads_ref, step_aux, _ in results:
        assert aux == pytest.approx(aux_ref, rel=1e-6)
        torch.testing.assert_close(grads, grads_ref, rtol=1e-5, atol=1e-7)
        # pooling the whole step is another number once a rank runs several micro-batches
        assert abs(step_aux - aux) > 1e-6
    # every rank reports the same balance loss
    assert len({round(r[0], 9) for r in results}) == 1


def test_one_micro_batch_per_rank_is_the_step_definition():
    for aux, _, grads, _, step_aux, step_grads in run_distributed(_check, 2, 1):
        assert aux == step_aux
        assert torch.equal(grads, step_grads)
