"""The RL Engine on one process: token alignment of log-probs against materialized logits,
HF export / reload and save / load round trips, micro-batching invariance, offload,
the KV-cache sampler against the full forward, packing, and input errors."""

from __future__ import annotations

import pytest
import torch
from engine_checks import check_offload_moves_everything

import bumblebee
from bumblebee import load_config
from bumblebee.config import ConfigError
from bumblebee.rl.batch import RLBatch, has_prefix, pack_sequences
from bumblebee.rl.engine import Engine
from bumblebee.rl.losses import PolicyLoss, TokenNLL
from bumblebee.rl.sampler import Sampler

SMALL = [
    "model.arch.num_hidden_layers=2",
    "model.arch.hidden_size=32",
    "model.arch.head_dim=8",
    "model.arch.num_experts=4",
    "model.arch.moe_intermediate_size=32",
    "primitives.attention=sdpa",
    "train.global_batch=4",
    "train.micro_batch=2",
]


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny shapes: extra threads only contend on a busy machine
    yield
    torch.set_num_threads(n)


def engine(tmp_path, *overrides, **kw):
    return Engine(load_config(None, SMALL + [f"train.out_dir={tmp_path}", *overrides]), **kw)


def rollouts(seed=0, n=9, seq_len=24):
    g = torch.Generator().manual_seed(seed)
    tokens = [
        torch.randint(0, 256, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]
    masks = [
        [i >= 2 for i in range(len(t))] for t in tokens
    ]  # 2 prompt tokens, the rest "response"
    adv = torch.randn(n, generator=g).tolist()
    return pack_sequences(tokens, masks, seq_len, advantages=adv)


def test_logprobs_are_token_aligned(tmp_path):
    e = engine(tmp_path)
    b = rollouts()
    lp = e.compute_logprobs(b, entropy=True)
    lsm = torch.log_softmax(
        e.model(b.input_ids, b.position_ids).float(), dim=-1
    )  # [B, T, V] reference
    prefix = has_prefix(b.position_ids)
    want = torch.zeros_like(lp.logprobs)
    want[:, 1:] = lsm[:, :-1].gather(2, b.input_ids[:, 1:, None]).squeeze(2)
    want_ent = torch.zeros_like(want)
    want_ent[:, 1:] = -(lsm[:, :-1].exp() * lsm[:, :-1]).sum(-1)
    assert torch.allclose(lp.logprobs, want * prefix, atol=1e-5)
    assert torch.allclose(lp.entropy, want_ent * prefix, atol=1e-5)
    assert (lp.logprobs[~prefix] == 0).all() and (lp.logprobs[prefix] < 0).all()
    seqs = b.unpack(lp.logprobs)
    assert len(seqs) == 9 and all(s[0] == 0 for s in seqs)  # a sequence's first token has no prefix


def test_export_hf_reload_and_save_load_round_trip(tmp_path):
    e = engine(tmp_path / "run")
    b = rollouts()
    b = b.replace(old_logprobs=e.compute_logprobs(b).logprobs)
    e.train_step(b, PolicyLoss(), lr=1e-3)  # move away from the initialization
    before = e.compute_logprobs(b).logprobs
    e.export_hf(str(tmp_path / "hf"))
    names = {k: v.clone() for k, v in e.named_weights()}
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in names  # HF names, experts split
    reloaded = bumblebee.Engine(e.cfg, hf_path=str(tmp_path / "hf"))
    assert torch.equal(reloaded.compute_logprobs(b).logprobs, before)
    assert torch.equal(
        bumblebee.from_hf(str(tmp_path / "hf")).lm_head.weight, names["lm_head.weight"]
    )
    # save / load (the runtime's checkpoints): the resumed engine takes the same next step,
    # also with another sharding implementation (parameters + optimizer state)
    path = e.save(str(tmp_path / "ckpt"))
    assert path.endswith("step_00000001")
    resumed = engine(tmp_path / "run2", "primitives.sharding=zero1")
    resumed.load(str(tmp_path / "ckpt"))
    assert resumed.step == e.step == 1
    m1, m2 = e.train_step(b, PolicyLoss(), lr=1e-3), resumed.train_step(b, PolicyLoss(), lr=1e-3)
    assert m1["loss"] == m2["loss"] and m1["grad_norm"] == pytest.approx(m2["grad_norm"], rel=1e-6)
    assert torch.allclose(
        e.compute_logprobs(b).logprobs, resumed.compute_logprobs(b).logprobs, atol=1e-6
    )
    with pytest.raises(ConfigError, match="no such checkpoint"):
        resumed.load(str(tmp_path / "nothing"))


def test_micro_batching_and_row_padding_do_not_change_the_step(tmp_path):
    b = rollouts(n=13)
    assert b.rows == 5  # not a multiple of the micro-batch: the last micro-batch is short
    results = []
    for mb in ("1", "2", "8"):  # (the balance loss is per micro-batch by definition: off here)
        e = engine(
            tmp_path / mb,
            f"train.micro_batch={mb}",
            "train.global_batch=8",
            "model.arch.router_aux_loss_coef=0.0",
        )
        bb = b.replace(
            old_logprobs=e.compute_logprobs(b).logprobs, ref_logprobs=torch.zeros_like(b.advantages)
        )
        m = e.train_step(
            bb, PolicyLoss(kl_coef=0.1, entropy_coef=0.01, agg="seq-mean-token-mean"), lr=1e-3
        )
        results.append((m, e.compute_logprobs(b).logprobs))
    for m, lp in results[1:]:
        for k in ("loss", "grad_norm", "kl", "entropy", "clip_frac"):
            assert m[k] == pytest.approx(results[0][0][k], rel=1e-5, abs=1e-7), k
        assert torch.allclose(lp, results[0][1], atol=1e-5)


@pytest.mark.parametrize("sharding", ["none", "zero1"])
def test_offload_moves_every_state_tensor(tmp_path, sharding):
    e = engine(tmp_path, f"primitives.sharding={sharding}")
    e.train_step(rollouts(), TokenNLL(), lr=1e-3)  # creates optimizer state
    check_offload_moves_everything(e)


def test_offload_onload_keeps_training_identical(tmp_path):
    a, b_ = engine(tmp_path / "a"), engine(tmp_path / "b")
    batch = rollouts()
    for e in (a, b_):
        e.train_step(batch, TokenNLL(), lr=1e-3)  # creates optimizer state
    b_.offload()
    with pytest.raises(RuntimeError, match="onload"):
        b_.compute_logprobs(batch)
    assert all(p.device.type == "cpu" for p in b_.model.parameters())
    b_.onload()
    assert (
        a.train_step(batch, TokenNLL(), lr=1e-3)["loss"]
        == b_.train_step(batch, TokenNLL(), lr=1e-3)["loss"]
    )


def test_sampler_kv_cache_matches_full_forward(tmp_path):
    e = engine(tmp_path)
    model = bumblebee.build_model(e.arch)
    sampler = Sampler(model)
    sampler.load_weights(e.named_weights(hf_names=False))
    prompts = [[1, 2, 3], [5, 6, 7, 8, 9, 10], [11]]  # different lengths: left padding in the cache
    r = sampler.generate(
        prompts,
        group_size=2,
        max_new_tokens=5,
        temperature=1.0,
        eos_id=999,
        generator=torch.Generator().manual_seed(0),
    )
    assert r.prompts == [p for p in prompts for _ in range(2)] and all(
        len(c) == 5 for c in r.completions
    )
    for p, c, lp in zip(r.prompts, r.completions, r.logprobs):
        lsm = torch.log_softmax(model(torch.tensor([p + c])).float()[0], -1)
        want = [lsm[len(p) - 1 + i, tok].item() for i, tok in enumerate(c)]
        assert lp == pytest.approx(want, abs=1e-5)
    # greedy decoding through the cache = the argmax of a full forward, token by token
    greedy = sampler.generate(prompts, max_new_tokens=4, temperature=0, eos_id=999)
    for p, c in zip(greedy.prompts, greedy.completions):
        assert len(c) == 4
        logits = model(torch.tensor([p + c])).float()[0]
        assert c == logits[len(p) - 1 : -1].argmax(-1).tolist(), (p, c)


def test_packing_and_errors(tmp_path):
    b = pack_sequences(
        [[1, 2, 3], [4, 5], [6, 7, 8, 9]],
        [[0, 1, 1], [0, 1], [0, 0, 1, 1]],
        6,
        advantages=[1.0, -1.0, 0.5],
        old_logprobs=[[0, -1, -2], [0, -3], [0, -1, -1, -1]],
    )
    assert b.input_ids.tolist() == [[1, 2, 3, 4, 5, 0], [6, 7, 8, 9, 0, 0]]
    assert b.position_ids.tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]]
    assert [t.tolist() for t in b.unpack(b.advantages)] == [[1.0] * 3, [-1.0] * 2, [0.5] * 4]
    with pytest.raises(ValueError, match="aligned to input_ids"):
        RLBatch(b.input_ids, b.position_ids, b.loss_mask[:, :3])
    with pytest.raises(ValueError, match="1..seq_len"):
        pack_sequences([[1] * 7], [[1] * 7], 6)
    e = engine(tmp_path)
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        e.train_step(b.replace(old_logprobs=torch.zeros(2, 6)), PolicyLoss(kl_coef=0.1))
    with pytest.raises(ValueError, match="needs advantages and old_logprobs"):
        e.train_step(b.replace(old_logprobs=None), PolicyLoss())
    # a token budget changes micro-batch shapes, which pipeline stages fix: refused with pipeline
    # parallelism, before any layout check
    with pytest.raises(ConfigError, match="^max_tokens_per_micro_batch needs parallel.pp = 1"):
        engine(tmp_path, "parallel.pp=2", max_tokens_per_micro_batch=64)
