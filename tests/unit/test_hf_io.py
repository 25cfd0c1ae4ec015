"""Hugging Face checkpoint interop: ``bumblebee.from_hf`` / ``bumblebee.to_hf``.

What a user relies on when moving weights between bumblebee and ``transformers``:
a directory written by ``to_hf`` loads in ``transformers`` with no missing or
unexpected keys and gives the same logits; a load followed by a save reproduces
every tensor bit for bit; sharded saves write an index that both libraries
read; and a broken checkpoint fails with a ``CheckpointError`` (a ``ValueError``)
that says what is wrong (the file, the ``model_type``, the tensor).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers  # noqa: E402  (the [test] extra; conftest.py stops the run without it)
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import bumblebee  # noqa: E402
from bumblebee.models import build_model  # noqa: E402
from bumblebee.models.hf import CheckpointError  # noqa: E402
from bumblebee.models.qwen3_moe import Qwen3MoeArch  # noqa: E402

VOCAB = 97
ARCH = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_experts=4,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    mlp_only_layers=[1],
    max_position_embeddings=64,
)


def bumblebee_model(seed=0, **overrides):
    torch.manual_seed(seed)
    model = build_model(Qwen3MoeArch(**{**ARCH, **overrides}))
    model.reset_parameters(std=0.1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.2 * torch.randn_like(p))
    return model.eval()


def hf_checkpoint(path, seed=0, dtype=torch.float32, **overrides):
    """A random ``Qwen3MoeForCausalLM`` saved with ``save_pretrained``; returns the model."""
    torch.manual_seed(seed)
    cfg = transformers.Qwen3MoeConfig(**{**ARCH, "initializer_range": 0.1, **overrides})
    model = transformers.Qwen3MoeForCausalLM(cfg).to(dtype).eval()
    model.save_pretrained(path)
    return model


def hf_from_pretrained(path):
    """Load with transformers and insist that every weight came from the checkpoint."""
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert not info.get(kind), f"transformers reports {kind}: {info[kind]}"
    assert isinstance(model, transformers.Qwen3MoeForCausalLM)
    return model.eval()


def read_tensors(directory) -> dict[str, torch.Tensor]:
    tensors = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(directory, name), framework="pt") as f:
                for key in f.keys():
                    assert key not in tensors, f"{key} stored twice"
                    tensors[key] = f.get_tensor(key)
    return tensors


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(
            a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)
        )
    )


def input_ids(B=2, T=13, seed=1):
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- to_hf -> transformers
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_to_hf_loads_in_transformers_with_equal_logits(tmp_path, tied):
    model = bumblebee_model(tie_word_embeddings=tied)
    bumblebee.to_hf(model, tmp_path)
    hf = hf_from_pretrained(tmp_path)
    assert hf.config.num_experts == ARCH["num_experts"] and hf.config.norm_topk_prob is True
    assert hf.config.mlp_only_layers == [1] and hf.config.tie_word_embeddings is tied
    ids = input_ids()
    with torch.no_grad():
        err = (hf(input_ids=ids, use_cache=False).logits - model(ids)).abs().max().item()
    assert err <= 1e-5, f"logits differ by {err:.3e}"


# ----------------------------------------------------------------------------- round trip
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_load_save_round_trip_is_bit_identical(tmp_path, dtype, tied):
    src, dst = tmp_path / "src", tmp_path / "dst"
    hf_checkpoint(src, dtype=dtype, tie_word_embeddings=tied)
    model = bumblebee.from_hf(str(src), dtype=dtype)
    bumblebee.to_hf(model, dst)

    before, after = read_tensors(src), read_tensors(dst)
    assert sorted(before) == sorted(after)
    for name, t in before.items():
        assert same_bits(t, after[name]), f"{name} changed in the round trip"
    # The configs may spell keys differently (HF writes num_local_experts); read both through HF.
    cfg_src, cfg_dst = (transformers.AutoConfig.from_pretrained(p) for p in (src, dst))
    for key in (
        "model_type",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "moe_intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "num_experts",
        "num_experts_per_tok",
        "norm_topk_prob",
        "decoder_sparse_step",
        "mlp_only_layers",
        "tie_word_embeddings",
        "rms_norm_eps",
        "rope_parameters",
        "dtype",
    ):
        assert getattr(cfg_dst, key) == getattr(cfg_src, key), key


def test_fused_expert_checkpoint_loads(tmp_path):
    """Checkpoints holding HF's in-memory fused expert tensors load like per-expert ones."""
    hf = hf_checkpoint(tmp_path / "per_expert")
    fused = tmp_path / "fused"
    fused.mkdir()
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, fused / "model.safetensors")
    (fused / "config.json").write_text((tmp_path / "per_expert" / "config.json").read_text())
    assert any(k.endswith("experts.gate_up_proj") for k in load_file(fused / "model.safetensors"))

    a, b = bumblebee.from_hf(str(tmp_path / "per_expert")), bumblebee.from_hf(str(fused))
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name


# ----------------------------------------------------------------------------- sharding
def test_sharded_save_writes_index_and_loads_in_both(tmp_path):
    model = bumblebee_model(seed=3)
    bumblebee.to_hf(model, tmp_path, max_shard_bytes=20_000)

    with open(tmp_path / "model.safetensors.index.json") as f:
        index = json.load(f)
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and not (tmp_path / "model.safetensors").exists()
    assert sorted(shards) == sorted(n for n in os.listdir(tmp_path) if n.endswith(".safetensors"))
    stored = read_tensors(tmp_path)
    assert sorted(stored) == sorted(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in stored.values()
    )

    reloaded = bumblebee.from_hf(str(tmp_path))
    for (name, p), q in zip(model.named_parameters(), reloaded.parameters()):
        assert torch.equal(p, q), name
    hf = hf_from_pretrained(tmp_path)
    ids = input_ids(seed=4)
    with torch.no_grad():
        err = (hf(input_ids=ids, use_cache=False).logits - model(ids)).abs().max().item()
    assert err <= 1e-5, f"sharded checkpoint: logits differ by {err:.3e}"


# ----------------------------------------------------------------------------- errors
@pytest.fixture
def checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    hf_checkpoint(path)
    return path


def rewrite_weights(path, edit):
    """Apply ``edit`` to the {name: tensor} dict of a single-file checkpoint."""
    file = path / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def load_error(path) -> str:
    with pytest.raises(CheckpointError) as info:
        bumblebee.from_hf(str(path))
    assert isinstance(info.value, ValueError)
    return str(info.value)


def test_error_missing_config(checkpoint):
    os.remove(checkpoint / "config.json")
    assert "config.json" in load_error(checkpoint)


def test_error_missing_weights_file(checkpoint):
    os.remove(checkpoint / "model.safetensors")
    assert "model.safetensors" in load_error(checkpoint)


def test_error_missing_shard(tmp_path):
    bumblebee.to_hf(bumblebee_model(), tmp_path, max_shard_bytes=20_000)
    last = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    os.remove(last)
    message = load_error(tmp_path)
    assert "shard" in message and last.name in message


@pytest.mark.parametrize("model_type", ["llama", None])
def test_error_unsupported_model_type(checkpoint, model_type):
    cfg = json.loads((checkpoint / "config.json").read_text())
    cfg["model_type"] = model_type
    (checkpoint / "config.json").write_text(json.dumps(cfg))
    message = load_error(checkpoint)
    assert repr(model_type) in message and "qwen3_moe" in message


def test_error_shape_mismatch_names_tensor(checkpoint):
    name = "model.layers.2.self_attn.k_proj.weight"
    rewrite_weights(checkpoint, lambda t: t.update({name: t[name][:-1].contiguous()}))
    message = load_error(checkpoint)
    assert name in message and "shape" in message


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.0.self_attn.q_norm.weight",
        "model.layers.2.mlp.experts.3.up_proj.weight",
        "lm_head.weight",
    ],
)
def test_error_missing_tensor_names_it(checkpoint, name):
    rewrite_weights(checkpoint, lambda t: t.pop(name))
    assert name in load_error(checkpoint)


def test_error_unexpected_tensor_names_it(checkpoint):
    name = "model.layers.0.self_attn.q_proj.bias"
    rewrite_weights(checkpoint, lambda t: t.update({name: torch.zeros(32)}))
    assert name in load_error(checkpoint)


def test_error_malformed_config(checkpoint):
    (checkpoint / "config.json").write_text('{"model_type": "qwen3_moe",')
    assert "config.json" in load_error(checkpoint)
