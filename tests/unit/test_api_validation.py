"""The Python API validates like the CLI: a ``ValueError`` (``ConfigError``) naming the argument,
raised before anything changes, for a learning rate or temperature no step can use and for token
ids outside the vocabulary (the model's forward, the RL Engine's calls, a prepared corpus whose
tokens disagree with its metadata: one line and exit 2 from ``bumblebee train``)."""

import json
import math

import numpy as np
import pytest
import torch
from cli_helpers import one_line_error, sets

import bumblebee
from bumblebee import load_config
from bumblebee.config import ConfigError
from bumblebee.rl.batch import pack_sequences
from bumblebee.rl.engine import Engine
from bumblebee.rl.losses import PolicyLoss
from bumblebee.rl.sampler import Sampler

BASE = [
    "model.arch.num_hidden_layers=1",
    "model.arch.hidden_size=32",
    "model.arch.head_dim=8",
    "model.arch.num_experts=4",
    "model.arch.moe_intermediate_size=32",
    "primitives.attention=sdpa",
    "train.global_batch=1",
    "train.micro_batch=1",
]
VOCAB = 272  # the default arch's


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return Engine(load_config(None, BASE + [f"train.out_dir={tmp_path_factory.mktemp('engine')}"]))


def batch(ids):
    b = pack_sequences([ids], [[i > 0 for i in range(len(ids))]], 16, advantages=[1.0])
    return b.replace(old_logprobs=torch.zeros(b.input_ids.shape))


def weights(e):
    return {k: v.clone() for k, v in e.named_weights()}


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 0.0, -1.0, 1e-20, 1e-3])
def test_engine_temperature_out_of_range(engine, value):
    with pytest.raises(ConfigError, match=r"^temperature must be a finite number >= 0.01"):
        Engine(engine.cfg, temperature=value)


@pytest.mark.parametrize("lr", [float("nan"), float("inf"), -1e-3])
def test_engine_learning_rate_out_of_range_changes_nothing(engine, lr):
    before, step = weights(engine), engine.step
    b = batch([5, 6, 7, 8, 9])
    engine.forward_backward(b, PolicyLoss())
    with pytest.raises(ValueError, match=r"^lr must be a finite number >= 0"):
        engine.optimizer_step(lr=lr)
    engine.zero_grad()
    with pytest.raises(ValueError, match=r"^lr must be a finite number >= 0"):
        engine.train_step(b, PolicyLoss(), lr=lr)
    after = weights(engine)
    assert engine.step == step and all(torch.equal(after[k], v) for k, v in before.items())
    assert all(torch.isfinite(v).all() for v in after.values())
    assert math.isfinite(
        engine.train_step(b, PolicyLoss(), lr=0.0)["loss"]
    )  # 0 is a valid (no-op) rate


@pytest.mark.parametrize("bad", [VOCAB, VOCAB + 1000, -1])
def test_engine_refuses_token_ids_outside_the_vocabulary(engine, bad):
    b = batch([5, 6, bad, 8])
    for call in (
        lambda: engine.compute_logprobs(b),
        lambda: engine.train_step(b, PolicyLoss()),
        lambda: engine.forward_backward(b, forward_only=True),
    ):
        with pytest.raises(
            ValueError,
            match=rf"^batch.input_ids: token id {bad} is outside the vocabulary "
            rf"\[0, {VOCAB}\)",
        ):
            call()
    assert engine.compute_logprobs(batch([5, 6, VOCAB - 1, 8])).logprobs.shape == b.input_ids.shape


def test_model_forward_refuses_ids_it_cannot_embed(engine):
    model = bumblebee.build_model(engine.arch, engine.cfg.primitives)
    for ids, what in (
        (torch.tensor([[1, VOCAB]]), f": token id {VOCAB} is outside"),
        (torch.tensor([[-3, 1]]), ": token id -3 is outside"),
        (torch.tensor([[1.0, 2.0]]), " must be an integer tensor"),
    ):
        with pytest.raises(ValueError, match=f"^input_ids{what}"):
            model(ids)
        with pytest.raises(ValueError, match="^input_ids"):
            model(ids, labels=torch.zeros_like(ids, dtype=torch.long))
    assert model(torch.tensor([[0, VOCAB - 1]])).shape == (1, 2, VOCAB)


def test_sampler_refuses_a_nan_temperature(engine):
    sampler = Sampler(bumblebee.build_model(engine.arch, engine.cfg.primitives))
    with pytest.raises(ValueError, match="finite temperature >= 0.*temperature=nan"):
        sampler.generate([[1, 2]], max_new_tokens=2, temperature=float("nan"), eos_id=0)


def test_prepared_corpus_with_ids_beyond_its_metadata(capsys, tmp_path):
    """meta.json says the ids fit (max_token_id) but the token file was changed afterwards: the
    batches are checked, so train stops with one line instead of an IndexError in the embedding."""
    from bumblebee.cli import main

    src = tmp_path / "ids.jsonl"
    src.write_text(
        "".join(
            json.dumps({"input_ids": [(7 * d + i) % VOCAB for i in range(40)]}) + "\n"
            for d in range(8)
        )
    )
    out = tmp_path / "corpus"
    assert (
        main(
            [
                "data",
                "prepare",
                "--source",
                "tokens",
                str(src),
                str(out),
                "--workers",
                "1",
                "--no-progress",
            ]
        )
        == 0
    )
    tokens = np.memmap(out / "tokens.u32", dtype=np.uint32, mode="r+")
    tokens[::40] = 5000  # the first token of every document
    tokens.flush()
    del tokens
    assert json.loads((out / "meta.json").read_text())["max_token_id"] < VOCAB
    capsys.readouterr()
    one_line_error(
        capsys,
        ["train"]
        + sets(
            [
                "data.source=tokens",
                f"data.path={out}",
                "train.seq_len=64",
                "train.steps=1",
                "train.global_batch=2",
                "train.eval_every=0",
                f"train.out_dir={tmp_path / 'run'}",
            ]
        ),
        "token id 5000 outside the model's vocabulary [0, 272)",
        notices_before=True,
    )


def test_every_family_refuses_norm_and_rope_values_no_model_trains_with():
    """Refused up front (the CLI cases are in test_bad_input.py), for the families whose rope
    base is a field and for DeepSeek-V3's, which sits in rope_parameters."""
    from bumblebee.models.arch import ArchError
    from bumblebee.models.deepseek_v3.arch import DeepseekV3Arch

    with pytest.raises(ArchError, match=r"^rope_theta must be > 1 .*got 1.0"):
        DeepseekV3Arch(rope_parameters={"rope_type": "default", "rope_theta": 1.0}).validate()
    with pytest.raises(ArchError, match="rope_parameters.rope_theta must be a finite number"):
        DeepseekV3Arch(rope_parameters={"rope_type": "default", "rope_theta": "big"}).validate()
    for name in ("qwen3_moe", "qwen3_5_moe", "deepseek_v3"):
        for item, what in (
            ("rms_norm_eps=1", "rms_norm_eps must be in"),
            ("rms_norm_eps=0", "rms_norm_eps must be in"),
        ):
            with pytest.raises(ConfigError, match=what):
                load_config(None, [f"model.name={name}", f"model.arch.{item}"])
        load_config(
            None, [f"model.name={name}", "model.arch.rms_norm_eps=1e-5"]
        )  # the usual values pass
