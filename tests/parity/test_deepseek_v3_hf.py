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

import pytest
import torch
import torch.nn.functional as F
import transformers

import bumblebee

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
    torch.manual_seed(seed)
    hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**{**BASE, **overrides}))
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


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_and_grads_match_hf(name, tmp_path):
    hf = hf_model(0, **CONFIGS[name])
    hf.save_pretrained(tmp_path)
    bb = bumblebee.from_hf(str(tmp_path))
    assert bb.family == "deepseek_v3"
    assert bb.arch.num_params()["total"] == sum(p.numel() for p in hf.parameters())
    ids, labels = torch.randint(0, VOCAB, (2, T)), torch.randint(0, VOCAB, (2, T))
    with torch.no_grad():
        ref = hf(ids).logits
    logits = bb(ids)
    assert (logits - ref).abs().max().item() < 1e-4

    loss_of(logits, labels).backward()
    loss_of(hf(ids).logits, labels).backward()
    bb_params, hf_params = dict(bb.named_parameters()), dict(hf.named_parameters())
    assert {to_bumblebee_name(n) for n in hf_params} == set(bb_params)
    for hf_name, p in hf_params.items():
        g_ref, g = p.grad, bb_params[to_bumblebee_name(hf_name)].grad
        scale = g_ref.abs().max().clamp_min(1e-12)
        assert ((g - g_ref).abs().max() / scale).item() < 1e-4, hf_name


def test_to_hf_round_trip(tmp_path):
    hf = hf_model(1, **CONFIGS["groups8of3_yarn_mscale"])
    hf.save_pretrained(tmp_path / "src")
    bb = bumblebee.from_hf(str(tmp_path / "src"))
    bumblebee.to_hf(bb, str(tmp_path / "out"))
    back = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    ids = torch.randint(0, VOCAB, (2, T))
    with torch.no_grad():
        assert (back(ids).logits - bb(ids)).abs().max().item() < 1e-4
    reloaded = bumblebee.from_hf(str(tmp_path / "out"))
    for (n, a), (_, b) in zip(bb.state_dict().items(), reloaded.state_dict().items()):
        assert torch.equal(a, b), n
    assert reloaded.state_dict()["model.layers.1.mlp.gate.e_score_correction_bias"].abs().sum() > 0


def test_packed_row_equals_hf_documents(tmp_path):
    hf = hf_model(2, **CONFIGS["no_qlora_yarn_plain_rope"])
    hf.save_pretrained(tmp_path)
    bb = bumblebee.from_hf(str(tmp_path))
    lengths = [11, 30, 1, 18]
    ids = torch.randint(0, VOCAB, (1, sum(lengths)))
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        packed = bb(ids, position_ids=pos)
        ref = torch.cat([hf(doc).logits for doc in ids.split(lengths, dim=1)], dim=1)
    assert (packed - ref).abs().max().item() < 1e-4
