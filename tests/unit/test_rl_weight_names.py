"""``weight_buckets(names="transformers")``: transformers 5's in-memory names (fused
``mlp.experts.gate_up_proj`` / ``down_proj``), so ``load_state_dict(strict=True)`` on a tiny
transformers model covers every parameter and gives the Engine's logits; the checkpoint names
(``names="hf"``, what vLLM / SGLang load) do not (every expert is missing). Qwen3-MoE, DeepSeek-V3
with an MTP module (left out: transformers holds none) and the multimodal Qwen3.5 wrapper."""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers

from bumblebee import load_config
from bumblebee.rl.engine import Engine

SMALL = [
    "model.arch.num_hidden_layers=2",
    "model.arch.hidden_size=32",
    "model.arch.num_experts=4",
    "model.arch.moe_intermediate_size=16",
    "primitives.attention=sdpa",
    "train.global_batch=2",
]


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def streamed(e, names, bucket_bytes=8 << 10):
    buckets = list(e.weight_buckets(bucket_bytes=bucket_bytes, dtype=torch.float32, names=names))
    out = {n: t for b in buckets for n, t in b}
    assert len(out) == sum(len(b) for b in buckets)  # no name twice
    return out, buckets


def transformers_model(config: dict, tmp_path, cls=transformers.AutoModelForCausalLM):
    os.makedirs(tmp_path / "cfg", exist_ok=True)
    with open(tmp_path / "cfg" / "config.json", "w") as f:
        json.dump(config, f)
    return cls.from_config(transformers.AutoConfig.from_pretrained(tmp_path / "cfg")).float().eval()


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_transformers_names_load_strictly(family, tmp_path):
    small = (
        SMALL if family == "qwen3_moe" else []
    )  # deepseek_v3: its tiny preset (4 layers, 1.3M parameters)
    e = Engine(load_config(None, small + [f"model.name={family}", f"train.out_dir={tmp_path}"]))
    torch.manual_seed(0)
    for p in e.model.parameters():  # not the init: a tensor loaded under the wrong name would show
        p.data.add_(torch.randn_like(p) * 0.02)
    hf = transformers_model(e.arch.to_hf_dict(), tmp_path)
    sd, buckets = streamed(e, "transformers")
    assert "model.layers.1.mlp.experts.gate_up_proj" in sd and not any(
        n.startswith("mtp.") for n in sd
    )
    assert len(buckets) > 2 and all(
        sum(t.numel() * 4 for _, t in b) <= 8 << 10 or len(b) == 1 for b in buckets
    )
    result = hf.load_state_dict(sd, strict=True)  # raises on a missing or unexpected name
    assert not result.missing_keys and not result.unexpected_keys
    ids = torch.randint(0, e.arch.vocab_size, (2, 12))
    with torch.no_grad():
        assert (hf(ids).logits - e.model(ids)).abs().max().item() < 1e-4
    if family == "deepseek_v3":
        assert e.arch.num_nextn_predict_layers == 1  # the MTP module exists and was left out above
    names, _ = streamed(e, "hf")  # checkpoint names: every expert missing from a transformers model
    missing = hf.load_state_dict(
        {n: t for n, t in names.items() if n in hf.state_dict()}, strict=False
    ).missing_keys
    per_expert = {k for k in sd if "experts" in k and k.endswith(("gate_up_proj", "down_proj"))}
    # gpt-oss checkpoints store the experts fused, as transformers holds them (models/hf_stored.py)
    assert set(missing) == (set() if family == "gpt_oss" else per_expert)


def test_transformers_names_keep_the_multimodal_prefix(tmp_path):
    torch.manual_seed(2)
    lin, full = "linear_attention", "full_attention"
    text = dict(
        vocab_size=64,
        hidden_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_conv_kernel_dim=4,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        num_hidden_layers=2,
        layer_types=[lin, full],
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
    )
    vision = dict(
        depth=1,
        hidden_size=16,
        intermediate_size=32,
        num_heads=2,
        out_hidden_size=32,
        num_position_embeddings=16,
        patch_size=4,
    )
    cfg = transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision)
    src = str(tmp_path / "src")
    transformers.Qwen3_5MoeForConditionalGeneration(cfg).save_pretrained(src)
    e = Engine(
        load_config(None, ["model.name=qwen3_5_moe", f"train.out_dir={tmp_path}"]), hf_path=src
    )
    for p in e.model.parameters():
        p.data.add_(torch.randn_like(p) * 0.02)
    hf = transformers.Qwen3_5MoeForConditionalGeneration(cfg).float().eval()
    sd, _ = streamed(e, "transformers")
    result = hf.load_state_dict(sd, strict=False)
    assert (
        not result.unexpected_keys and result.missing_keys
    )  # only the vision tower is not the policy's
    assert all(k.startswith("model.visual.") for k in result.missing_keys)
    ids = torch.randint(0, 64, (1, 12))
    with torch.no_grad():
        assert (hf(input_ids=ids).logits - e.model(ids)).abs().max().item() < 1e-4
    with pytest.raises(ValueError, match="names must be 'hf', 'transformers' or 'bumblebee'"):
        next(e.weight_buckets(names="vllm"))
