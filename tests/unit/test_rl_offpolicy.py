"""Off-policy rollout correction (losses.rollout_correction, PolicyLoss tis / mis): the loss
of packed, padded batches against the formula written out per token, token and sequence
level, truncated and masked IS; no change when the rollout log-probs equal the training
ones; metrics (mean / max / fraction) through the Engine's micro-batches; the RL config
and ``bumblebee rl --tis``."""

from __future__ import annotations

import math

import pytest
import torch

from bumblebee import load_config
from bumblebee.cli import build_parser
from bumblebee.config import ConfigError
from bumblebee.rl.batch import LOSS_INPUTS, pack_sequences, prediction_view, shift_left
from bumblebee.rl.cli import configs_from_args
from bumblebee.rl.engine import Engine
from bumblebee.rl.losses import PolicyInputs, PolicyLoss
from bumblebee.rl.rl_config import RLConfig
from bumblebee.rl.toy import rollout_batch

CLIP_LOW, CLIP_HIGH = 0.2, 0.28
PROMPT = 2  # prompt tokens per sequence (not trained)


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def sequences(seed=0, n=7, spread=0.7):
    """Per sequence: tokens, mask, advantage, and token-aligned current / old / rollout log-probs
    (rollout = old + noise, so token ratios fall on both sides of the caps)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        L = int(torch.randint(PROMPT + 1, 9, (1,), generator=g))
        old = -torch.rand(L, generator=g) * 2
        out.append(
            dict(
                tokens=torch.randint(0, 256, (L,), generator=g).tolist(),
                mask=[i >= PROMPT for i in range(L)],
                adv=float(torch.randn(1, generator=g)),
                cur=(old + 0.3 * torch.randn(L, generator=g)).tolist(),
                old=old.tolist(),
                rollout=(old + spread * torch.randn(L, generator=g)).tolist(),
            )
        )
    return out


def packed(seqs, rollout_key="rollout", seq_len=16):
    return pack_sequences(
        [s["tokens"] for s in seqs],
        [s["mask"] for s in seqs],
        seq_len,
        advantages=[s["adv"] for s in seqs],
        old_logprobs=[s["old"] for s in seqs],
        rollout_logprobs=[s[rollout_key] for s in seqs],
        ref_logprobs=[s["cur"] for s in seqs],  # unused (kl_coef 0), it rides along
    )


def loss_of(seqs, loss_fn, rollout_key="rollout"):
    """PolicyLoss on the prediction view, as the Engine calls it; current log-probs are the
    token-aligned ``cur`` moved to prediction positions (differentiable leaf)."""
    b = packed(seqs, rollout_key)
    P = prediction_view(b, loss_fn.agg)
    cur = pack_sequences(
        [s["tokens"] for s in seqs],
        [s["mask"] for s in seqs],
        16,
        old_logprobs=[s["cur"] for s in seqs],
    )
    logp = shift_left(cur.old_logprobs).requires_grad_()
    x = PolicyInputs(logp, None, P["mask"], P["weights"], *(P.get(k) for k in LOSS_INPUTS))
    loss, stats = loss_fn(x)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss, stats, grad


def by_hand(seqs, mode, level, cap, agg="token-mean"):
    """The corrected PPO loss written out token by token: (loss, ratio sum, ratio max, over-cap count)."""
    total, ratio_sum, ratio_max, over, n_tok = 0.0, 0.0, 0.0, 0, 0
    n_seq = sum(any(s["mask"][1:]) for s in seqs)
    for s in seqs:
        trained = [j for j in range(1, len(s["tokens"])) if s["mask"][j]]
        seq_log = sum(s["old"][j] - s["rollout"][j] for j in trained)
        for j in trained:
            rho = math.exp(seq_log if level == "sequence" else s["old"][j] - s["rollout"][j])
            w = min(rho, cap) if mode == "tis" else (rho if rho <= cap else 0.0)
            r = math.exp(s["cur"][j] - s["old"][j])
            a = s["adv"]
            pg = max(-a * r, -a * min(max(r, 1 - CLIP_LOW), 1 + CLIP_HIGH))
            share = 1.0 if agg == "token-mean" else 1.0 / (len(trained) * n_seq)
            total += w * pg * share
            ratio_sum, ratio_max, over, n_tok = (
                ratio_sum + rho,
                max(ratio_max, rho),
                over + (rho > cap),
                n_tok + 1,
            )
    return (total / n_tok if agg == "token-mean" else total), ratio_sum, ratio_max, over


def policy_loss(**kw):
    return PolicyLoss(clip_low=CLIP_LOW, clip_high=CLIP_HIGH, needs_entropy=False, **kw)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("level,cap", [("token", 1.5), ("sequence", 2.0)])
@pytest.mark.parametrize("mode", ["tis", "mis"])
def test_correction_matches_the_formula(mode, level, cap, agg):
    seqs = sequences()
    want, ratio_sum, ratio_max, over = by_hand(seqs, mode, level, cap, agg)
    loss, stats, _ = loss_of(seqs, policy_loss(agg=agg, is_level=level, **{mode: cap}))
    assert 0 < over < sum(len(s["tokens"]) - PROMPT for s in seqs)  # the cap binds, not everywhere
    assert loss.item() == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert stats["is_ratio_mean"].item() == pytest.approx(ratio_sum, rel=1e-5)
    assert stats["is_ratio_max"].item() == pytest.approx(ratio_max, rel=1e-5)
    assert stats[f"is_{'clip' if mode == 'tis' else 'mask'}_frac"].item() == over


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["tis", "mis"])
def test_rollout_equal_to_training_logprobs_changes_nothing(mode, level):
    seqs = sequences(seed=1)
    plain, _, g_plain = loss_of(seqs, policy_loss(), rollout_key="old")
    loss, stats, g = loss_of(seqs, policy_loss(is_level=level, **{mode: 2.0}), rollout_key="old")
    assert torch.equal(loss, plain) and torch.equal(g, g_plain)
    assert (
        stats["is_ratio_max"].item() == 1.0
        and stats[f"is_{'clip' if mode == 'tis' else 'mask'}_frac"] == 0
    )


def test_weight_is_detached_and_only_on_the_policy_term():
    """The IS weight scales the surrogate's gradient; it has no gradient of its own."""
    seqs = sequences(seed=2)
    _, _, g_plain = loss_of(seqs, policy_loss())
    _, _, g = loss_of(seqs, policy_loss(tis=1e9))  # a cap that never binds: w = rho per token
    b = packed(seqs)
    P = prediction_view(b, "token-mean")
    rho = torch.where(P["mask"], torch.exp(P["old_logprobs"] - P["rollout_logprobs"]), 0.0)
    assert torch.allclose(g, rho * g_plain, rtol=1e-5, atol=1e-8)


def test_errors():
    with pytest.raises(ValueError, match="at most one"):
        PolicyLoss(tis=2.0, mis=2.0)
    with pytest.raises(ValueError, match="> 1"):
        PolicyLoss(tis=1.0)
    with pytest.raises(ValueError, match="is_level"):
        PolicyLoss(is_level="geometric")
    seqs = sequences()
    b = pack_sequences(
        [s["tokens"] for s in seqs],
        [s["mask"] for s in seqs],
        16,
        advantages=[0.0] * 7,
        old_logprobs=[s["old"] for s in seqs],
    )
    P = prediction_view(b, "token-mean")
    x = PolicyInputs(
        P["old_logprobs"], None, P["mask"], P["weights"], *(P.get(k) for k in LOSS_INPUTS)
    )
    with pytest.raises(ValueError, match="tis needs rollout_logprobs"):
        PolicyLoss(tis=2.0)(x)
    assert "is_ratio_mean" not in PolicyLoss()(x)[1]  # no rollout log-probs: no IS metrics


def test_engine_metrics_over_micro_batches(tmp_path):
    """Through Engine.forward_backward with several micro-batches: the ratio mean is a token
    mean, the max a max (not a sum), the masked fraction a token fraction."""
    cfg = load_config(
        None,
        [
            "model.arch.num_hidden_layers=1",
            "model.arch.hidden_size=32",
            "model.arch.head_dim=8",
            "model.arch.num_experts=4",
            "model.arch.moe_intermediate_size=32",
            "primitives.attention=sdpa",
            "train.global_batch=4",
            "train.micro_batch=1",
            f"train.out_dir={tmp_path}",
        ],
    )
    e = Engine(cfg)
    seqs = sequences(seed=3, n=9)
    b = packed(seqs)
    b = b.replace(old_logprobs=e.compute_logprobs(b).logprobs)
    seqs = [dict(s, old=o.tolist()) for s, o in zip(seqs, b.unpack(b.old_logprobs))]
    b = packed(seqs)
    assert b.rows > 1  # several micro-batches of one row
    out = e.forward_backward(b, policy_loss(mis=1.5), forward_only=True)
    _, ratio_sum, ratio_max, over = by_hand(seqs, "mis", "token", 1.5)
    n = sum(len(s["tokens"]) - PROMPT for s in seqs)
    assert out.metrics["is_ratio_mean"] == pytest.approx(ratio_sum / n, rel=1e-5)
    assert out.metrics["is_ratio_max"] == pytest.approx(ratio_max, rel=1e-5)
    assert out.metrics["is_mask_frac"] == pytest.approx(over / n)


def test_rl_config_and_cli():
    args = build_parser().parse_args(["rl", "--tis", "2.5", "--set", "rl.is_level=sequence"])
    _, rl = configs_from_args(args)
    assert rl.tis == 2.5 and rl.loss().tis == 2.5 and rl.loss().is_level == "sequence"
    _, rl = configs_from_args(build_parser().parse_args(["rl", "--set", "rl.mis=3"]))
    assert rl.loss().mis == 3.0 and rl.loss().tis is None
    for bad in (
        ["--tis", "0.5"],
        ["--tis", "2", "--set", "rl.mis=2"],
        ["--set", "rl.is_level=seq"],
    ):
        with pytest.raises(ConfigError):
            configs_from_args(build_parser().parse_args(["rl", *bad]))
    assert RLConfig().loss().is_mode is None  # off by default


def test_toy_rollout_batch_carries_rollout_logprobs():
    b = rollout_batch(
        [[1, 2], [3]], [[4, 5], [6]], 8, rollout_logprobs=[[0, 0, -0.5, -1.5], [0, -2.0]]
    )
    assert [t.tolist() for t in b.unpack(b.rollout_logprobs)] == [[0, 0, -0.5, -1.5], [0, -2.0]]
