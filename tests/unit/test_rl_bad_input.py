"""The RL API validates its arguments at the boundary: mismatched per-sequence inputs, float
token ids, empty batches, non-finite loss settings / rewards / log-probs, negative positions,
routing replays of the wrong shape or dtype, a bad save step and a loss callback that returns
the wrong thing are each a ValueError / TypeError naming the argument, never an internal
broadcast, index or division error or a silently wrong update."""

from __future__ import annotations

import math

import pytest
import torch

from bumblebee import load_config
from bumblebee.config import ConfigError
from bumblebee.rl.batch import RLBatch, pack_sequences
from bumblebee.rl.engine import Engine
from bumblebee.rl.losses import PolicyLoss, grpo_advantages
from bumblebee.runtime.nonfinite import NonFiniteError

SMALL = [
    "model.arch.num_hidden_layers=2",
    "model.arch.hidden_size=32",
    "model.arch.head_dim=8",
    "model.arch.num_experts=4",
    "model.arch.moe_intermediate_size=32",
    "primitives.attention=sdpa",
    "train.global_batch=2",
    "train.micro_batch=1",
]
TOKENS = [[1, 2, 3, 4], [5, 6, 7]]
MASKS = [[False, True, True, True], [False, True, True]]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("rl_bad_input")
    return Engine(load_config(None, SMALL + [f"train.out_dir={out}"]))


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"rollout_logprobs": [[0.0] * 4]}, ValueError, "rollout_logprobs: 1 entries for 2"),
        ({"old_logprobs": [[0.0] * 4, [0.0] * 2]}, ValueError, r"old_logprobs\[1\] has 2 values"),
        ({"advantages": [1.0]}, ValueError, "advantages: 1 entries for 2 sequences"),
        ({"advantages": [[1.0] * 3, 1.0]}, ValueError, r"advantages\[0\] has 3 values"),
        ({"ref_logprobs": [0.0, 0.0]}, ValueError, r"ref_logprobs\[0\]: one value per token"),
    ],
)
def test_pack_sequences_checks_per_sequence_inputs(kwargs, error, message):
    with pytest.raises(error, match=message):
        pack_sequences(TOKENS, MASKS, 8, **kwargs)


def test_pack_sequences_rejects_float_ids_and_an_empty_batch():
    with pytest.raises(TypeError, match="sequence 1: token ids must be integers"):
        pack_sequences([[1, 2], [3.7, 4.2]], [[1, 1], [1, 1]], 8)
    with pytest.raises(ValueError, match="at least one sequence"):
        pack_sequences([], [], 8)


def test_rl_batch_rejects_float_ids_negative_positions_and_non_finite_inputs():
    ids = torch.tensor([[1, 2, 3, 4]])
    pos = torch.arange(4)[None]
    mask = torch.tensor([[False, True, True, True]])
    with pytest.raises(TypeError, match="RLBatch.input_ids must be an integer tensor"):
        RLBatch(ids.float(), pos, mask)
    with pytest.raises(ValueError, match="position_ids must be >= 0"):
        RLBatch(ids, torch.tensor([[0, 1, -2, 3]]), mask)
    with pytest.raises(TypeError, match="RLBatch.position_ids must be an integer tensor"):
        RLBatch(ids, pos.float() + 0.5, mask)  # float positions would be truncated
    ref = torch.zeros(1, 4)
    ref[0, 2] = -math.inf
    with pytest.raises(ValueError, match=r"ref_logprobs is not finite at trained token \(0, 2\)"):
        RLBatch(ids, pos, mask, ref_logprobs=ref)
    ref = torch.zeros(1, 4)
    ref[0, 0] = -math.inf  # an untrained position is never read
    RLBatch(ids, pos, mask, ref_logprobs=ref)


@pytest.mark.parametrize("name", ["clip_low", "clip_high", "kl_coef", "entropy_coef"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_policy_loss_rejects_non_finite_settings(name, value):
    with pytest.raises(ValueError, match=f"PolicyLoss.{name} must be a finite number"):
        PolicyLoss(**{name: value})


def test_grpo_advantages_reject_a_non_finite_reward():
    with pytest.raises(ValueError, match=r"rewards must be finite; not finite at \[2\]"):
        grpo_advantages([1.0, 0.0, math.nan, 1.0], group_size=2)


def _batch():
    return pack_sequences(TOKENS, MASKS, 8, advantages=[1.0, -1.0])


def test_engine_save_rejects_a_negative_step(engine, tmp_path):
    with pytest.raises(ConfigError, match="step must be an integer >= 0, got -3"):
        engine.save(str(tmp_path), step=-3)
    assert not (tmp_path / "checkpoints").exists() or not list((tmp_path / "checkpoints").iterdir())


def test_loss_fn_returning_a_float_is_a_type_error(engine):
    def bad(x):
        return 0.5, {}

    with pytest.raises(TypeError, match="loss_fn's loss must be a 0-d tensor"):
        engine.forward_backward(_batch(), bad)
    engine.zero_grad()


def test_metric_names_must_not_change_between_micro_batches(engine):
    calls = []

    def renaming(x):
        calls.append(1)
        loss = (x.logprobs * x.weights).sum()
        return loss, {f"m{len(calls)}": loss.detach()}

    with pytest.raises(ValueError, match=r"returned metrics \['m2'\] for micro-batch 1"):
        two_rows = pack_sequences(TOKENS, MASKS, 4, advantages=[1.0, -1.0])
        engine.forward_backward(two_rows, renaming, max_tokens_per_micro_batch=4)
    engine.zero_grad()


def test_an_empty_batch_is_a_value_error(engine):
    empty = RLBatch(
        torch.zeros(0, 8, dtype=torch.long),
        torch.zeros(0, 8, dtype=torch.long),
        torch.zeros(0, 8, dtype=torch.bool),
    )
    with pytest.raises(ValueError, match="batch has no tokens"):
        engine.forward_backward(empty, PolicyLoss())


def test_routing_replay_of_the_wrong_shape_or_dtype_is_refused(engine):
    b = _batch()
    B, T = b.input_ids.shape
    layers, k = engine.model.main_moe_layers, engine.arch.num_experts_per_tok
    good = torch.zeros(B, T, layers, k, dtype=torch.long)
    for routing, error, message in [
        (good[..., :1].contiguous() if k > 1 else good.repeat(1, 1, 1, 2), ValueError, "top-"),
        (good[:, :, :1] if layers > 1 else good.repeat(1, 1, 2, 1), ValueError, "MoE layers"),
        (good.float(), TypeError, "routing must be an integer tensor"),
        (good + engine.arch.num_experts, ValueError, "valid: 0.."),
    ]:
        with pytest.raises(error, match=message):
            engine.forward_backward(b.replace(routing=routing), PolicyLoss())
    engine.zero_grad()


def test_a_step_with_an_infinite_loss_is_not_applied(engine):
    before = [p.detach().clone() for p in engine.model.parameters()]

    def infinite(x):
        loss = (x.logprobs * x.weights).sum()
        return loss - math.inf, {}

    engine.zero_grad()
    engine.forward_backward(_batch(), infinite)
    with pytest.raises(NonFiniteError, match="non-finite loss"):
        engine.optimizer_step()
    for a, p in zip(before, engine.model.parameters()):
        assert torch.equal(a, p.detach())
    engine.zero_grad()
