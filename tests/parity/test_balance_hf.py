"""``train.balance = "hf"`` equals ``transformers``' ``aux_loss`` (Qwen3-MoE's
``load_balancing_loss_func``: counts and probabilities pooled over the MoE layers, then the
product) to 1e-6, with the gate-weight gradients of that loss; the ``micro_batch`` definition
(per-layer product, mean over layers) is a different number on the same model, so the
test tells the two apart."""

from __future__ import annotations

import pytest
import torch
import transformers

import bumblebee


@pytest.mark.parametrize("layers,dense", [(3, []), (4, [2])])
def test_hf_aux_loss_parity(tmp_path, layers, dense):
    torch.manual_seed(layers)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=40,
        moe_intermediate_size=16,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=6,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=dense,
        max_position_embeddings=64,
        initializer_range=0.3,
        router_aux_loss_coef=0.01,
    )
    hf = transformers.Qwen3MoeForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path)
    ours = bumblebee.from_hf(str(tmp_path))
    ids = torch.randint(0, 97, (2, 24))
    labels = torch.randint(0, 97, (2, 24))
    out = hf(input_ids=ids, output_router_logits=True)
    terms = ours.loss_terms(ids, labels, balance="hf")
    assert abs(terms.aux_loss.item() - out.aux_loss.item()) < 1e-6
    # gradients of the balance loss reach the routers alike
    out.aux_loss.backward()
    terms.aux_loss.backward()
    hf_grads = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        if name.endswith("mlp.gate.weight"):
            torch.testing.assert_close(p.grad, hf_grads[name].grad, rtol=1e-4, atol=1e-7)
    # the per-layer definition is another number (what the hf mode must not compute)
    micro = ours.loss_terms(ids, labels, balance="micro_batch").aux_loss.item()
    assert abs(micro - out.aux_loss.item()) > 1e-3
