"""RL losses on the fused linear path equal a materialized-logits reference (fp32, 1e-5).

The reference builds ``[T, V]`` logits, takes ``log_softmax`` and writes PPO's clipped
surrogate (Schulman et al. 2017), the dual clip, the KL estimators (Schulman 2020)
and the three aggregation modes out directly (per-sequence loops), independently of
``bumblebee.rl.losses``. Compared: per-token log-probs, entropy, the loss, and the
gradients of the hidden states and of the LM-head weight; small tiles make the fused
path cross several token and vocabulary tiles. On 2 gloo ranks, the same comparison
runs vocabulary-sharded (each rank holds a row slice of the LM head, ``vocab_group``)
and token-sharded as context parallelism shards them (zigzag; aggregation weights
from the whole batch, losses and weight gradients all-reduced). The Engine's CP path
end to end is in tests/distributed/test_rl_engine_dist.py.

Legend: T tokens, H hidden, V vocabulary.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed

from bumblebee.primitives.cp.zigzag import zigzag_index
from bumblebee.rl.losses import (
    AGGREGATIONS,
    PolicyLoss,
    aggregation_weights,
    fused_policy_loss,
    grpo_advantages,
    kl_penalty,
)

T, H, V = 53, 16, 67
TILES = {"token_tile": 16, "vocab_tile": 24}
CASES = [  # (agg, dual_clip, kl_estimator, kl_coef, entropy_coef, temperature)
    ("token-mean", None, "k3", 0.1, 0.0, 1.0),
    ("seq-mean-token-mean", 3.0, "k1", 0.05, 0.01, 0.7),
    ("seq-mean-token-sum", 2.0, "k2", 0.0, 0.02, 1.0),
    ("token-mean", 3.0, "k3", 0.2, 0.05, 1.3),
]


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.5
    targets = torch.randint(0, V, (T,), generator=g)
    targets[torch.rand(T, generator=g) < 0.25] = -100  # prompt / padding positions
    seq_ids = torch.sort(torch.randint(0, 7, (T,), generator=g)).values  # 7 packed sequences
    adv = torch.randn(7, generator=g)[seq_ids]  # one advantage per sequence
    logp = (
        torch.log_softmax(hidden @ weight.T, -1).gather(1, targets.clamp(min=0)[:, None]).squeeze(1)
    )
    old = logp + torch.randn(
        T, generator=g
    )  # ratios spread around 1: both clips and the dual clip fire
    ref = logp + torch.randn(T, generator=g) * 0.5
    return hidden, weight, targets, seq_ids, adv, old, ref


def _reference(hidden, weight, targets, seq_ids, adv, old, ref, case):
    agg, dual, est, kl_coef, ent_coef, temp = case
    logits = (hidden @ weight.T).float() / temp
    lsm = torch.log_softmax(logits, dim=-1)
    valid = targets != -100
    logp = torch.where(valid, lsm.gather(1, targets.clamp(min=0)[:, None]).squeeze(1), 0.0)
    entropy = -(lsm.exp() * lsm).sum(-1)
    ratio = torch.exp(logp - old)
    pg = -torch.min(ratio * adv, torch.clamp(ratio, 0.8, 1.28) * adv)
    if dual is not None:
        pg = torch.where(adv < 0, torch.min(pg, -dual * adv), pg)
    d = logp - ref
    kl = {"k1": d, "k2": d**2 / 2, "k3": torch.exp(-d) - 1 + d}[est]
    per = pg + kl_coef * kl - ent_coef * entropy
    sums, counts = [], []
    for s in seq_ids.unique():
        m = valid & (seq_ids == s)
        if m.any():
            sums.append(per[m].sum())
            counts.append(m.sum())
    if agg == "token-mean":
        loss = torch.stack(sums).sum() / torch.stack(counts).sum()
    elif agg == "seq-mean-token-mean":
        loss = torch.stack([s / c for s, c in zip(sums, counts)]).mean()
    else:
        loss = torch.stack(sums).mean()
    return loss, logp, entropy


def _fused(hidden, weight, targets, seq_ids, adv, old, ref, case, vocab_group=None):
    agg, dual, est, kl_coef, ent_coef, temp = case
    loss_fn = PolicyLoss(
        clip_low=0.2,
        clip_high=0.28,
        dual_clip=dual,
        kl_coef=kl_coef,
        kl_estimator=est,
        entropy_coef=ent_coef,
        agg=agg,
    )
    weights = aggregation_weights(targets != -100, seq_ids, agg)
    loss, stats, logp, entropy = fused_policy_loss(
        hidden,
        weight,
        targets,
        loss_fn,
        weights_T=weights,
        advantages_T=adv,
        old_logprobs_T=old,
        ref_logprobs_T=ref,
        temperature=temp,
        vocab_group=vocab_group,
        **TILES,
    )
    return loss, logp, entropy, stats


def _errors(case, rows=slice(None), vocab_group=None):
    """Relative errors of the fused path (weight rows ``rows`` on this rank) vs the reference."""
    hidden, weight, targets, *rest = _inputs()
    out = {}
    for name, fn, w in (("ref", _reference, weight), ("fused", _fused, weight[rows])):
        h, w = hidden.clone().requires_grad_(), w.clone().requires_grad_()
        res = fn(
            h, w, targets, *rest, case, **({"vocab_group": vocab_group} if name == "fused" else {})
        )
        res[0].backward()
        out[name] = (res[0], res[1], res[2], h.grad, w.grad)
    ref_gw = out["ref"][4][rows]
    errs = {}
    for key, a, b in zip(
        ("loss", "logp", "entropy", "grad_hidden", "grad_weight"),
        out["fused"],
        out["ref"][:4] + (ref_gw,),
    ):
        a, b = a.detach().double(), b.detach().double()
        errs[key] = ((a - b).norm() / b.norm().clamp(min=1e-30)).item()
    return errs


@pytest.mark.parametrize("case", CASES, ids=[c[0] + f"-{c[2]}" for c in CASES])
def test_fused_policy_loss_matches_materialized(case):
    for key, err in _errors(case).items():
        assert err <= 1e-5, (case, key, err)


def test_clipping_is_exercised():
    hidden, weight, targets, seq_ids, adv, old, ref = _inputs()
    _, _, _, stats = _fused(hidden, weight, targets, seq_ids, adv, old, ref, CASES[1])
    n = (targets != -100).sum()
    assert 0 < stats["clip_frac"] < n and 0 < stats["dual_clip_frac"] < n


def _token_sharded_errors(case, rank, world):
    """Context-parallel view: this rank holds a zigzag share of the tokens; aggregation
    weights come from the whole batch, so the shares' losses and weight gradients sum
    (all-reduce) to the reference and each token's hidden-state gradient is its own."""
    hidden, weight, targets, seq_ids, adv, old, ref = _inputs()
    idx = zigzag_index(-(-T // (2 * world)) * 2 * world, world, rank)
    idx = idx[idx < T]
    h_ref, w_ref = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss_ref, logp_ref, ent_ref = _reference(h_ref, w_ref, targets, seq_ids, adv, old, ref, case)
    loss_ref.backward()
    agg, dual, est, kl_coef, ent_coef, temp = case
    loss_fn = PolicyLoss(
        clip_low=0.2,
        clip_high=0.28,
        dual_clip=dual,
        kl_coef=kl_coef,
        kl_estimator=est,
        entropy_coef=ent_coef,
        agg=agg,
    )
    weights = aggregation_weights(targets != -100, seq_ids, agg)[
        idx
    ]  # global weights, local tokens
    h, w = hidden[idx].clone().requires_grad_(), weight.clone().requires_grad_()
    loss, _, logp, ent = fused_policy_loss(
        h,
        w,
        targets[idx],
        loss_fn,
        weights_T=weights,
        advantages_T=adv[idx],
        old_logprobs_T=old[idx],
        ref_logprobs_T=ref[idx],
        temperature=temp,
        **TILES,
    )
    loss.backward()
    total, grad_w = loss.detach().clone(), w.grad.clone()
    dist.all_reduce(total)
    dist.all_reduce(grad_w)
    errs = {}
    for key, a, b in (
        ("loss", total, loss_ref),
        ("logp", logp, logp_ref[idx]),
        ("entropy", ent, ent_ref[idx]),
        ("grad_hidden", h.grad, h_ref.grad[idx]),
        ("grad_weight", grad_w, w_ref.grad),
    ):
        a, b = a.detach().double(), b.detach().double()
        errs[key] = ((a - b).norm() / b.norm().clamp(min=1e-30)).item()
    return errs


def _sharded(rank, world):
    bounds = [0, 40, V]  # uneven vocabulary slices
    rows = slice(bounds[rank], bounds[rank + 1])
    return {
        "vocab": [_errors(case, rows, dist.group.WORLD) for case in CASES],
        "tokens": [_token_sharded_errors(case, rank, world) for case in CASES],
    }


def test_vocab_and_token_sharded_match_materialized():
    for rank, result in enumerate(run_distributed(_sharded, 2, timeout=120)):
        for kind, per_case in result.items():
            for case, errs in zip(CASES, per_case):
                for key, err in errs.items():
                    assert err <= 1e-5, (rank, kind, case, key, err)


def test_aggregation_weights_split_exactly():
    """Shares of any token partition (micro-batches, ranks) sum to the full-batch loss."""
    g = torch.Generator().manual_seed(1)
    mask = torch.rand(4, 9, generator=g) < 0.6
    seq = torch.arange(4)[:, None] * 10 + (torch.arange(9) >= 4)  # two sequences per row
    loss = torch.randn(4, 9, generator=g)
    for mode in AGGREGATIONS:
        w = aggregation_weights(mask, seq, mode)
        full = (w * loss).sum()
        parts = sum((w[i : i + 1] * loss[i : i + 1]).sum() for i in range(4))
        assert torch.allclose(full, parts) and (w[~mask] == 0).all()
    w = aggregation_weights(mask, seq, "seq-mean-token-mean")
    n_seq = len({int(s) for s, m in zip(seq.flatten(), mask.flatten()) if m})
    assert torch.allclose(w.sum(), torch.tensor(1.0)) and n_seq > 1
    with pytest.raises(ValueError, match="unknown aggregation"):
        aggregation_weights(mask, seq, "mean")


def test_grpo_advantages_and_kl_estimators():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5])
    adv = grpo_advantages(r, 4)
    first = (r[:4] - r[:4].mean()) / (r[:4].std() + 1e-6)
    assert torch.allclose(adv[:4], first) and torch.equal(
        adv[4:], torch.zeros(4)
    )  # equal rewards: no signal
    assert torch.allclose(grpo_advantages(r, 4, scale_by_std=False)[:4], r[:4] - 0.5)
    with pytest.raises(ValueError, match="groups of 3"):
        grpo_advantages(r, 3)
    # k3 is non-negative and ~ k2 for small log-ratios; every estimator is 0 at equal policies
    d = torch.linspace(-2, 2, 41)
    assert (kl_penalty(d, torch.zeros(41), "k3") >= 0).all()
    small = torch.tensor([1e-3])
    assert torch.allclose(
        kl_penalty(small, 0 * small, "k3"), kl_penalty(small, 0 * small, "k2"), rtol=1e-2
    )
    for est in ("k1", "k2", "k3"):
        assert torch.equal(kl_penalty(d, d, est), torch.zeros(41))
