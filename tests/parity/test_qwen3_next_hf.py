"""Parity of bumblebee's Qwen3-Next with Hugging Face ``transformers``' ``Qwen3NextForCausalLM``.

Tiny random models are saved with ``save_pretrained`` and loaded with ``bumblebee.from_hf``;
configurations vary the layer pattern, value heads per key head (the fused ``in_proj_qkvz`` /
``in_proj_ba`` groups), head dims, the rotary fraction, dense layers (``mlp_only_layers``) and
tied embeddings. Every 1-D parameter is perturbed so a wrong norm convention cannot hide.

- logits (fp32): 1e-4 max-abs against HF;
- gradients (fp32): every parameter within 1e-4 relative after one backward (HF runs its
  token-by-token GDN fallback, as in test_qwen3_5_moe_hf.py);
- ``to_hf`` writes a directory ``transformers`` loads with equal logits, and bumblebee reads its
  own output bit for bit;
- a packed row equals HF run on each document alone.
"""

from __future__ import annotations

import parity_utils as pu
import pytest
import transformers
from transformers.models.qwen3_next import modeling_qwen3_next as hf_mod

VOCAB, T = pu.VOCAB, 80  # T > 64: the chunked GDN crosses a chunk boundary
LIN, FULL = "linear_attention", "full_attention"
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    intermediate_size=56,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_conv_kernel_dim=4,
    moe_intermediate_size=24,
    shared_expert_intermediate_size=40,
    num_experts=4,
    num_experts_per_tok=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
)
CONFIGS = {
    "lll-f_gva2": dict(num_hidden_layers=4, layer_types=[LIN, LIN, LIN, FULL]),
    "l-f-l_gva3_dense1_tied": dict(
        num_hidden_layers=3,
        layer_types=[LIN, FULL, LIN],
        num_attention_heads=6,
        head_dim=8,
        linear_num_key_heads=1,
        linear_num_value_heads=3,
        linear_conv_kernel_dim=3,
        mlp_only_layers=[1],
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
    ),
}


def hf_model(seed, **overrides):
    config = transformers.Qwen3NextConfig(**{**BASE, **overrides})
    return pu.hf_model(transformers.Qwen3NextForCausalLM, config, seed)


def to_bumblebee_name(hf_name: str) -> str:
    return hf_name.replace("experts.gate_up_proj", "experts.w_gate_up").replace(
        "experts.down_proj", "experts.w_down"
    )


def grads(bb, hf):
    return pu.renamed_grads(bb, hf, to_bumblebee_name)


def hf_recurrent_gdn(query, key, value, g, beta, initial_state=None, output_final_state=False,
                     use_qk_l2norm_in_kernel=False, **_):  # fmt: skip
    return hf_mod.torch_recurrent_gated_delta_rule(
        query, key, value, g, beta, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
    )  # fmt: skip


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_and_grads_match_hf(name, tmp_path, monkeypatch):
    hf = hf_model(0, **CONFIGS[name])
    bb = pu.load(hf, tmp_path, "qwen3_next")

    def recurrent():  # HF's backward through its recurrent rule, not the chunked one
        monkeypatch.setattr(hf_mod, "torch_chunk_gated_delta_rule", hf_recurrent_gdn)

    pu.assert_logits_and_grads(bb, hf, T, grads, before_hf_backward=recurrent)


def test_to_hf_round_trip_and_packed_rows(tmp_path):
    hf = hf_model(1, **CONFIGS["l-f-l_gva3_dense1_tied"])
    bb = pu.load(hf, tmp_path / "src", "qwen3_next")
    model_cls = transformers.Qwen3NextForCausalLM
    pu.assert_to_hf_loads(bb, model_cls, tmp_path / "out", T, "parameters")
    pu.assert_packed_rows(bb, hf, [23, 40, 2, 15])  # a 2-token document is shorter than the conv
