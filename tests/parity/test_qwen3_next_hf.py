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

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers.models.qwen3_next import modeling_qwen3_next as hf_mod

import bumblebee

VOCAB, T = 97, 80  # T > 64: the chunked GDN crosses a chunk boundary
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
    torch.manual_seed(seed)
    hf = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**{**BASE, **overrides}))
    with torch.no_grad():
        for _, p in hf.named_parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn_like(p))
    return hf.float().eval()


def to_bumblebee_name(hf_name: str) -> str:
    return hf_name.replace("experts.gate_up_proj", "experts.w_gate_up").replace(
        "experts.down_proj", "experts.w_down"
    )


def hf_recurrent_gdn(query, key, value, g, beta, initial_state=None, output_final_state=False,
                     use_qk_l2norm_in_kernel=False, **_):  # fmt: skip
    return hf_mod.torch_recurrent_gated_delta_rule(
        query, key, value, g, beta, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
    )  # fmt: skip


def loss_of(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_and_grads_match_hf(name, tmp_path, monkeypatch):
    hf = hf_model(0, **CONFIGS[name])
    hf.save_pretrained(tmp_path)
    bb = bumblebee.from_hf(str(tmp_path))
    assert bb.family == "qwen3_next"
    assert bb.arch.num_params()["total"] == sum(p.numel() for p in hf.parameters())
    ids, labels = torch.randint(0, VOCAB, (2, T)), torch.randint(0, VOCAB, (2, T))
    with torch.no_grad():
        ref = hf(ids).logits
    logits = bb(ids)
    assert (logits - ref).abs().max().item() < 1e-4

    loss_of(logits, labels).backward()
    monkeypatch.setattr(hf_mod, "torch_chunk_gated_delta_rule", hf_recurrent_gdn)
    loss_of(hf(ids).logits, labels).backward()
    bb_params, hf_params = dict(bb.named_parameters()), dict(hf.named_parameters())
    assert {to_bumblebee_name(n) for n in hf_params} == set(bb_params)
    for hf_name, p in hf_params.items():
        g_ref, g = p.grad, bb_params[to_bumblebee_name(hf_name)].grad
        scale = g_ref.abs().max().clamp_min(1e-12)
        assert ((g - g_ref).abs().max() / scale).item() < 1e-4, hf_name


def test_to_hf_round_trip_and_packed_rows(tmp_path):
    hf = hf_model(1, **CONFIGS["l-f-l_gva3_dense1_tied"])
    hf.save_pretrained(tmp_path / "src")
    bb = bumblebee.from_hf(str(tmp_path / "src"))
    bumblebee.to_hf(bb, str(tmp_path / "out"))
    back = transformers.Qwen3NextForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    ids = torch.randint(0, VOCAB, (2, T))
    with torch.no_grad():
        assert (back(ids).logits - bb(ids)).abs().max().item() < 1e-4
    reloaded = bumblebee.from_hf(str(tmp_path / "out"))
    for (n, a), (_, b) in zip(bb.named_parameters(), reloaded.named_parameters()):
        assert torch.equal(a, b), n
    lengths = [23, 40, 2, 15]  # a 2-token document is shorter than the conv window
    ids = torch.randint(0, VOCAB, (1, sum(lengths)))
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        packed = bb(ids, position_ids=pos)
        ref = torch.cat([hf(doc).logits for doc in ids.split(lengths, dim=1)], dim=1)
    assert (packed - ref).abs().max().item() < 1e-4
