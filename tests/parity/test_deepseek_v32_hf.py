"""Parity of the DeepSeek Sparse Attention families with Hugging Face ``transformers``:
``deepseek_v32`` (``DeepseekV32ForCausalLM``) and ``glm_moe_dsa`` (``GlmMoeDsaForCausalLM``).

Tiny random models (index_topk well below the sequence length, so the indexer really drops
keys) are saved with ``save_pretrained`` and read with ``bumblebee.from_hf``; 1-D parameters
(norms, the indexer's LayerNorm) are perturbed so a wrong convention cannot hide behind an init.
Both cores run: ``blockwise`` (top-k per query block, gathered latents, small blocks so several
run) and ``reference`` (dense masked). HF's indexer runs under ``no_grad``: with the indexer loss
off bumblebee's indexer gets zero gradient, every other parameter HF's within 1e-4 relative.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
import transformers

import bumblebee
from bumblebee.config import PrimitivesConfig
from bumblebee.models import build_model

VOCAB, T = 97, 40
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    intermediate_size=64,
    moe_intermediate_size=24,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=4,
    topk_group=2,
    max_position_embeddings=256,
    index_topk=12,
    index_head_dim=16,
    index_n_heads=16,
)
MODELS = {
    "deepseek_v32": (transformers.DeepseekV32Config, transformers.DeepseekV32ForCausalLM, {}),
}
if hasattr(transformers, "GlmMoeDsaConfig"):
    MODELS["glm_moe_dsa"] = (
        transformers.GlmMoeDsaConfig,
        transformers.GlmMoeDsaForCausalLM,
        dict(rms_norm_eps=1e-5, n_group=1, topk_group=1, index_topk=9, qk_rope_head_dim=12),
    )


def hf_model(family: str, seed: int):
    config_cls, model_cls, extra = MODELS[family]
    torch.manual_seed(seed)
    hf = model_cls(config_cls(**{**BASE, **extra}))
    with torch.no_grad():
        for _, p in hf.named_parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn_like(p))
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    return hf.float().eval()


def to_bumblebee_name(hf_name: str) -> str:
    return hf_name.replace("mlp.experts.gate_up_proj", "mlp.experts.w_gate_up").replace(
        "mlp.experts.down_proj", "mlp.experts.w_down"
    )


def loss_of(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


def with_prims(bb, **prims):
    """The same weights under other primitives."""
    model = build_model(bb.arch, dataclasses.replace(PrimitivesConfig(), **prims))
    model.load_state_dict(bb.state_dict())
    return model


@pytest.mark.parametrize("family", list(MODELS))
def test_logits_and_grads_match_hf(family, tmp_path):
    hf = hf_model(family, 0)
    hf.save_pretrained(tmp_path)
    src = bumblebee.from_hf(str(tmp_path))
    assert src.family == family
    assert src.arch.num_params()["total"] == sum(p.numel() for p in hf.parameters())
    ids, labels = torch.randint(0, VOCAB, (2, T)), torch.randint(0, VOCAB, (2, T))
    with torch.no_grad():
        ref = hf(ids).logits
    loss_of(hf(ids).logits, labels).backward()
    hf_params = dict(hf.named_parameters())
    for impl, block in (("blockwise", 7), ("reference", 1)):
        bb = with_prims(src, dsa_impl=impl, dsa_block=block, dsa_indexer_loss=0.0)
        logits = bb(ids)
        assert (logits - ref).abs().max().item() < 1e-4, impl
        loss_of(logits, labels).backward()
        bb_params = dict(bb.named_parameters())
        assert {to_bumblebee_name(n) for n in hf_params} == set(bb_params)
        for hf_name, p in hf_params.items():
            g = bb_params[to_bumblebee_name(hf_name)].grad
            if ".indexer." in hf_name:
                assert p.grad is None and (g is None or not g.any()), hf_name
                continue
            scale = p.grad.abs().max().clamp_min(1e-12)
            assert ((g - p.grad).abs().max() / scale).item() < 1e-4, (impl, hf_name)


@pytest.mark.parametrize("family", list(MODELS))
def test_to_hf_round_trip_and_packed_documents(family, tmp_path):
    hf = hf_model(family, 1)
    hf.save_pretrained(tmp_path / "src")
    bb = bumblebee.from_hf(str(tmp_path / "src"))
    bumblebee.to_hf(bb, str(tmp_path / "out"))
    back = MODELS[family][1].from_pretrained(tmp_path / "out").float().eval()
    ids = torch.randint(0, VOCAB, (2, T))
    with torch.no_grad():
        assert (back(ids).logits - bb(ids)).abs().max().item() < 1e-4
    lengths = [11, 30, 1, 18]
    ids = torch.randint(0, VOCAB, (1, sum(lengths)))
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        packed = bb(ids, position_ids=pos)
        ref = torch.cat([hf(doc).logits for doc in ids.split(lengths, dim=1)], dim=1)
    assert (packed - ref).abs().max().item() < 1e-4
