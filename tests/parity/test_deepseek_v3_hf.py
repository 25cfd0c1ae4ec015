"""Parity of bumblebee's DeepSeek-V3 family with Hugging Face ``transformers``' ``DeepseekV3ForCausalLM``.

Tiny random models are saved with ``save_pretrained`` and loaded with ``bumblebee.from_hf``;
configurations vary q LoRA (on / off), the latent and head dims, dense first layers,
group-limited routing (groups, kept groups, top-k), shared experts, RoPE vs YaRN (with
mscale), interleaved rope dims and tied embeddings. Every 1-D parameter and the router's
selection bias are perturbed so a wrong convention cannot hide behind an init.

- logits (fp32): 1e-4 max-abs against HF;
- gradients (fp32): every parameter within 1e-4 relative after one backward;
- ``to_hf`` writes a directory ``transformers`` loads with equal logits, and bumblebee reads
  its own output bit for bit (router bias included);
- a packed row equals HF run on each document alone.
"""

from __future__ import annotations

import parity_utils as pu
import pytest
import transformers

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
    routed_scaling_factor=2.5,
    max_position_embeddings=256,
    num_mtp_layers=0,
    tie_word_embeddings=False,
)
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "original_max_position_embeddings": 32,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
CONFIGS = {
    "qlora_dense1_groups4of2": {},
    "no_qlora_yarn_plain_rope": dict(
        q_lora_rank=None,
        rope_parameters=YARN,
        rope_interleave=False,
        num_hidden_layers=2,
        first_k_dense_replace=0,
        v_head_dim=24,
    ),
    "dense2_groups1_top3_shared2_tied": dict(
        num_hidden_layers=4,
        first_k_dense_replace=2,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=3,
        n_shared_experts=2,
        norm_topk_prob=False,
        tie_word_embeddings=True,
        num_attention_heads=2,
        num_key_value_heads=2,
        routed_scaling_factor=1.0,
    ),
    "groups8of3_yarn_mscale": dict(
        n_routed_experts=16,
        n_group=8,
        topk_group=3,
        num_experts_per_tok=4,
        kv_lora_rank=24,
        qk_rope_head_dim=16,
        rope_parameters={**YARN, "mscale_all_dim": 0.7, "mscale": 0.9},
    ),
}


def hf_model(seed: int, **overrides):
    config = transformers.DeepseekV3Config(**{**BASE, **overrides})
    return pu.hf_model(transformers.DeepseekV3ForCausalLM, config, seed)


def to_bumblebee_name(hf_name: str) -> str:
    return hf_name.replace("mlp.experts.gate_up_proj", "mlp.experts.w_gate_up").replace(
        "mlp.experts.down_proj", "mlp.experts.w_down"
    )


def grads(bb, hf):
    return pu.renamed_grads(bb, hf, to_bumblebee_name)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_and_grads_match_hf(name, tmp_path):
    hf = hf_model(0, **CONFIGS[name])
    bb = pu.load(hf, tmp_path, "deepseek_v3")
    pu.assert_logits_and_grads(bb, hf, T, grads)


def test_to_hf_round_trip(tmp_path):
    hf = hf_model(1, **CONFIGS["groups8of3_yarn_mscale"])
    bb = pu.load(hf, tmp_path / "src", "deepseek_v3")
    out = tmp_path / "out"
    reloaded = pu.assert_to_hf_loads(bb, transformers.DeepseekV3ForCausalLM, out, T, "state_dict")
    assert reloaded.state_dict()["model.layers.1.mlp.gate.e_score_correction_bias"].abs().sum() > 0


def test_packed_row_equals_hf_documents(tmp_path):
    hf = hf_model(2, **CONFIGS["no_qlora_yarn_plain_rope"])
    bb = pu.load(hf, tmp_path, "deepseek_v3")
    pu.assert_packed_rows(bb, hf, [11, 30, 1, 18])
