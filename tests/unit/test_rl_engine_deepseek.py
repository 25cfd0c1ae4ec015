"""The RL Engine and the HF exports on a tiny deepseek_v3 (MLA, a dense first layer, group-limited
``sigmoid_bias`` routing, one MTP module).

- Engine: log-probs equal a direct forward's; one training step moves every router bias by
  that step's expert load (the routing the step's forward used), as the Trainer does; the MTP
  module is carried, not trained; weight buckets, ``export_hf`` and a reload agree.
- Both exports (``Engine.export_hf`` and ``bumblebee convert --to hf`` of a training checkpoint)
  write what a DeepSeek-V3 checkpoint holds: the MTP module at ``model.layers.{L}``, with its
  own copies of the embedding (``embed_tokens``) and LM head (``shared_head.head``), and the
  router biases; the directory loads in transformers (logits equal) and back bit-exactly.
"""

from __future__ import annotations

import io
import os

import pytest
import torch
from safetensors import safe_open

import bumblebee
from bumblebee import load_config
from bumblebee.models.base import persistent_buffers
from bumblebee.rl.batch import has_prefix, pack_sequences
from bumblebee.rl.engine import Engine
from bumblebee.rl.losses import PolicyLoss
from bumblebee.runtime.trainer import Trainer

L = 2  # decoder layers: one dense, one MoE; the MTP module is stored as layer L
DS = [
    "model.name=deepseek_v3",
    f"model.arch.num_hidden_layers={L}",
    "model.arch.hidden_size=64",
    "model.arch.intermediate_size=96",
    "model.arch.moe_intermediate_size=32",
    "train.global_batch=4",
    "train.micro_batch=2",
    "moe.bias_update_rate=0.01",
]
COPIES = [f"model.layers.{L}.embed_tokens.weight", f"model.layers.{L}.shared_head.head.weight"]


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def rollouts(seed=0, n=9, seq_len=24):
    g = torch.Generator().manual_seed(seed)
    tokens = [
        torch.randint(0, 256, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]
    masks = [[i >= 2 for i in range(len(t))] for t in tokens]
    return pack_sequences(tokens, masks, seq_len, advantages=torch.randn(n, generator=g).tolist())


def read_dir(path) -> dict[str, torch.Tensor]:
    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), framework="pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def check_hf_dir(path, model, ids):
    """``path`` holds ``model`` as DeepSeek-V3 stores it, loads in transformers with the same logits,
    and back into bumblebee bit-exactly (parameters and router biases)."""
    from transformers import AutoModelForCausalLM

    tensors = read_dir(path)
    embed, head = model.model.embed_tokens.weight, model.lm_head.weight
    assert torch.equal(tensors[COPIES[0]], embed) and torch.equal(tensors[COPIES[1]], head)
    assert torch.equal(tensors[f"model.layers.{L}.eh_proj.weight"], model.mtp[0].eh_proj.weight)
    assert torch.equal(
        tensors["model.layers.1.mlp.gate.e_score_correction_bias"],
        model.model.layers[1].mlp.gate.e_score_correction_bias,
    )
    hf, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    with torch.no_grad():
        assert torch.allclose(hf(ids).logits, model(ids), atol=1e-4, rtol=1e-4)
    back = bumblebee.from_hf(path)
    assert back.mtp_modules() == 1
    mine = dict(model.named_parameters()) | dict(persistent_buffers(model))
    for name, t in list(back.named_parameters()) + persistent_buffers(back):
        assert torch.equal(t, mine[name]), name
    return tensors


def test_engine_on_deepseek_v3(tmp_path):
    e = Engine(load_config(None, DS + [f"train.out_dir={tmp_path}/run"]))
    model = e.model
    assert (
        model.mtp_modules() == 1 and model.mtp_depth == 0
    )  # carried, not trained by the policy update
    b = rollouts()
    lp = e.compute_logprobs(b)
    with torch.no_grad():
        lsm = torch.log_softmax(model(b.input_ids, b.position_ids).float(), dim=-1)
    want = torch.zeros_like(lp.logprobs)
    want[:, 1:] = lsm[:, :-1].gather(2, b.input_ids[:, 1:, None]).squeeze(2)
    assert torch.allclose(lp.logprobs, want * has_prefix(b.position_ids), atol=1e-5)

    # the step's forward routes as the current weights do: its expert load moves each bias by
    # rate x sign(mean load - load), after the update, once
    routed = model.record_routing(b.input_ids, b.position_ids)  # [B, T, MoE layers, K]
    E = e.arch.num_experts
    load = [
        torch.bincount(routed[:, :, j].flatten(), minlength=E).float()
        for j in range(routed.shape[2])
    ]
    gates = model.routers()
    assert len(gates) == len(load) == 1
    want_bias = [
        g.e_score_correction_bias + 0.01 * torch.sign(x.mean() - x) for g, x in zip(gates, load)
    ]
    mtp_before = {n: p.detach().clone() for n, p in model.mtp.named_parameters()}
    mtp_bias = model.mtp[0].mlp.gate.e_score_correction_bias.clone()
    e.train_step(b.replace(old_logprobs=lp.logprobs), PolicyLoss(), lr=1e-3)
    for g, w in zip(gates, want_bias):
        assert w.abs().sum() > 0 and torch.equal(g.e_score_correction_bias, w)
    assert all(torch.equal(p, mtp_before[n]) for n, p in model.mtp.named_parameters())
    assert torch.equal(model.mtp[0].mlp.gate.e_score_correction_bias, mtp_bias)
    # a forward-only call counts nothing: the next step's update follows its own forward only
    e.compute_logprobs(b)
    assert e.expert_load.counts is None

    out = tmp_path / "hf"
    e.export_hf(str(out))
    ids = b.input_ids[:2]
    tensors = check_hf_dir(out, model, ids)
    streamed = dict(
        kv for bucket in e.weight_buckets(dtype=None) for kv in bucket
    )  # the rollout engine's names
    assert streamed.keys() == tensors.keys()
    assert all(torch.equal(streamed[k], tensors[k]) for k in COPIES)
    reloaded = Engine(e.cfg, hf_path=str(out))
    assert torch.equal(reloaded.compute_logprobs(b).logprobs, e.compute_logprobs(b).logprobs)


def test_convert_writes_the_mtp_copies(tmp_path):
    """``bumblebee convert --to hf`` (here: the run's own export) of a checkpoint trained with MTP."""
    cfg = load_config(
        None,
        DS
        + [
            f"train.out_dir={tmp_path}/run",
            "train.steps=1",
            "train.seq_len=64",
            "train.export_hf=true",
            "primitives.sharding=none",
        ],
    )
    trainer = Trainer(cfg, stream=io.StringIO())
    trainer.run()
    model = trainer.model
    assert (
        model.mtp_depth == 1 and model.mtp[0].mlp.gate.e_score_correction_bias.abs().sum() > 0
    )  # trained
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    check_hf_dir(tmp_path / "run" / "hf", model, ids)
