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

import parity_utils as pu
import pytest
import torch
import transformers

from bumblebee.config import PrimitivesConfig
from bumblebee.models import build_model

VOCAB, T = pu.VOCAB, 40
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
    return pu.hf_model(model_cls, config_cls(**{**BASE, **extra}), seed)


def to_bumblebee_name(hf_name: str) -> str:
    return hf_name.replace("mlp.experts.gate_up_proj", "mlp.experts.w_gate_up").replace(
        "mlp.experts.down_proj", "mlp.experts.w_down"
    )


def with_prims(bb, **prims):
    """The same weights under other primitives."""
    model = build_model(bb.arch, dataclasses.replace(PrimitivesConfig(), **prims))
    model.load_state_dict(bb.state_dict())
    return model


@pytest.mark.parametrize("family", list(MODELS))
def test_logits_and_grads_match_hf(family, tmp_path):
    hf = hf_model(family, 0)
    src = pu.load(hf, tmp_path, family)
    ids, labels = pu.batch(T)
    with torch.no_grad():
        ref = hf(ids).logits
    pu.loss_of(hf(ids).logits, labels).backward()
    for impl, block in (("blockwise", 7), ("reference", 1)):
        bb = with_prims(src, dsa_impl=impl, dsa_block=block, dsa_indexer_loss=0.0)
        logits = bb(ids)
        pu.assert_logits_close(logits, ref, impl)
        pu.loss_of(logits, labels).backward()
        pairs = pu.renamed_grads(bb, hf, to_bumblebee_name)
        for hf_name, g, g_ref in pairs:  # HF's indexer is not trained by the LM loss
            if ".indexer." in hf_name:
                assert g_ref is None and (g is None or not g.any()), hf_name
        pu.assert_grads_close([p for p in pairs if ".indexer." not in p[0]], impl)


@pytest.mark.parametrize("family", list(MODELS))
def test_to_hf_round_trip_and_packed_documents(family, tmp_path):
    hf = hf_model(family, 1)
    bb = pu.load(hf, tmp_path / "src", family)
    pu.assert_to_hf_loads(bb, MODELS[family][1], tmp_path / "out", T)
    pu.assert_packed_rows(bb, hf, [11, 30, 1, 18])
