"""Parity of bumblebee's Qwen3.5-MoE hybrid with Hugging Face ``transformers``.

Tiny random ``Qwen3_5MoeForCausalLM`` (text) models are saved with
``save_pretrained`` and loaded with ``bumblebee.from_hf``; configurations vary
the layer pattern, query / KV heads, linear key / value heads, head dims, the
rotary fraction, the conv kernel, experts / top-k and tied embeddings. All 1-D
parameters (norms, dt_bias, A_log) are perturbed so a wrong norm convention
cannot hide behind an init of zeros or ones.

- logits (fp32): bumblebee vs HF's default path, 1e-4 max-abs;
- gradients (fp32): every parameter within 1e-4 relative (max-abs difference /
  max-abs reference) after one backward of the same loss. The HF reference runs
  its token-by-token GDN fallback (``torch_recurrent_gated_delta_rule``, patched
  in for the chunked one): HF's chunked fallback sums the log decays in fp32 and,
  at HF's own A init (A up to 16), is itself ~1e-3 off on A_log / dt_bias
  gradients against an fp64 run, while bumblebee's chunked form sums them in fp64;
- ``to_hf`` writes a directory ``transformers`` loads with equal logits;
- a multimodal ``Qwen3_5MoeForConditionalGeneration`` checkpoint loads its
  language model (vision tower skipped with a notice);
- a packed row equals HF run on each document alone.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers  # noqa: E402  (the [test] extra; conftest.py stops the run without it)
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf_mod  # noqa: E402

import bumblebee  # noqa: E402

VOCAB, T = 97, 80  # T > 64: the chunked GDN crosses a chunk boundary and pads the last chunk
LIN, FULL = "linear_attention", "full_attention"
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=48,
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
    "lll-f_gqa2_gva2": dict(num_hidden_layers=4, layer_types=[LIN, LIN, LIN, FULL]),
    "f-l_mha_gva1_tied": dict(
        num_hidden_layers=2,
        layer_types=[FULL, LIN],
        num_key_value_heads=4,
        head_dim=32,
        linear_num_value_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=16,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
    ),
    "l-f-l_gqa3_gva3_k3": dict(
        num_hidden_layers=3,
        layer_types=[LIN, FULL, LIN],
        num_attention_heads=6,
        head_dim=8,
        linear_num_key_heads=1,
        linear_num_value_heads=3,
        linear_conv_kernel_dim=3,
        num_experts=6,
        num_experts_per_tok=3,
    ),
}


def hf_config(**overrides):
    return transformers.Qwen3_5MoeTextConfig(**{**BASE, **overrides})


def perturbed(model):
    """Move every 1-D parameter off its init (norm weights 0 / 1, dt_bias 1) so conventions matter."""
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn_like(p))
    return model.float().eval()


def to_bumblebee_name(hf_name: str) -> str:
    return hf_name.replace("experts.gate_up_proj", "experts.w_gate_up").replace(
        "experts.down_proj", "experts.w_down"
    )


def hf_recurrent_gdn(
    query,
    key,
    value,
    g,
    beta,
    chunk_size=64,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    **_,
):
    return hf_mod.torch_recurrent_gated_delta_rule(
        query,
        key,
        value,
        g,
        beta,
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
    )


def loss_of(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_and_grads_match_hf(name, tmp_path, monkeypatch):
    torch.manual_seed(0)
    hf = perturbed(transformers.Qwen3_5MoeForCausalLM(hf_config(**CONFIGS[name])))
    hf.save_pretrained(tmp_path)
    bb = bumblebee.from_hf(str(tmp_path))
    assert bb.family == "qwen3_5_moe"
    assert bb.arch.num_params()["total"] == sum(p.numel() for p in hf.parameters())

    ids = torch.randint(0, VOCAB, (2, T))
    labels = torch.randint(0, VOCAB, (2, T))
    with torch.no_grad():
        ref = hf(ids).logits
    logits = bb(ids)
    assert (logits - ref).abs().max().item() < 1e-4

    loss_of(logits, labels).backward()
    monkeypatch.setattr(hf_mod, "torch_chunk_gated_delta_rule", hf_recurrent_gdn)
    loss_of(hf(ids).logits, labels).backward()
    bb_params = dict(bb.named_parameters())
    hf_params = dict(hf.named_parameters())
    assert {to_bumblebee_name(n) for n in hf_params} == set(bb_params)
    for hf_name, p in hf_params.items():
        g_ref, g = p.grad, bb_params[to_bumblebee_name(hf_name)].grad
        scale = g_ref.abs().max().clamp_min(1e-12)
        assert ((g - g_ref).abs().max() / scale).item() < 1e-4, hf_name


def test_to_hf_round_trip(tmp_path):
    torch.manual_seed(1)
    hf = perturbed(transformers.Qwen3_5MoeForCausalLM(hf_config(**CONFIGS["lll-f_gqa2_gva2"])))
    hf.save_pretrained(tmp_path / "src")
    bb = bumblebee.from_hf(str(tmp_path / "src"))
    bumblebee.to_hf(bb, str(tmp_path / "out"))
    back = transformers.Qwen3_5MoeForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    ids = torch.randint(0, VOCAB, (2, T))
    with torch.no_grad():
        assert (back(ids).logits - bb(ids)).abs().max().item() < 1e-4
    reloaded = bumblebee.from_hf(
        str(tmp_path / "out")
    )  # and bumblebee reads its own output bit for bit
    for (n, a), (_, b) in zip(bb.named_parameters(), reloaded.named_parameters()):
        assert torch.equal(a, b), n


def test_multimodal_checkpoint_loads_language_model(tmp_path, capfd):
    torch.manual_seed(2)
    text = hf_config(**{**CONFIGS["f-l_mha_gva1_tied"], "tie_word_embeddings": False})
    vision = dict(
        depth=1,
        hidden_size=16,
        intermediate_size=32,
        num_heads=2,
        out_hidden_size=48,
        num_position_embeddings=16,
        patch_size=4,
    )
    cfg = transformers.Qwen3_5MoeConfig(text_config=text.to_dict(), vision_config=vision)
    hf = perturbed(transformers.Qwen3_5MoeForConditionalGeneration(cfg))
    hf.save_pretrained(tmp_path)
    capfd.readouterr()
    bb = bumblebee.from_hf(str(tmp_path))
    notice = capfd.readouterr().err
    assert "ignored" in notice and "model.visual." in notice
    ids = torch.randint(0, VOCAB, (1, T))
    with torch.no_grad():
        assert (hf(input_ids=ids).logits - bb(ids)).abs().max().item() < 1e-4


def test_packed_row_equals_hf_documents(tmp_path):
    torch.manual_seed(3)
    hf = perturbed(transformers.Qwen3_5MoeForCausalLM(hf_config(**CONFIGS["l-f-l_gqa3_gva3_k3"])))
    hf.save_pretrained(tmp_path)
    bb = bumblebee.from_hf(str(tmp_path))
    lengths = [23, 70, 2, 15]  # a 2-token document is shorter than the conv window
    ids = torch.randint(0, VOCAB, (1, sum(lengths)))
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        packed = bb(ids, position_ids=pos)
        ref = torch.cat([hf(doc).logits for doc in ids.split(lengths, dim=1)], dim=1)
    assert (packed - ref).abs().max().item() < 1e-4


def test_labels_path_and_recompute_policies():
    """The ``labels`` loss equals CE over the logits; full and selective recompute (every module
    the hybrid exposes) give bit-identical gradients to no recompute on packed input."""
    from bumblebee.config import PrimitivesConfig
    from bumblebee.models import arch_from_hf_dict, build_model

    arch = arch_from_hf_dict(hf_config(**CONFIGS["f-l_mha_gva1_tied"]).to_dict())
    pos = torch.cat([torch.arange(30), torch.arange(50)])[None].expand(2, T)
    ids, labels = torch.randint(0, VOCAB, (2, T)), torch.randint(0, VOCAB, (2, T))
    labels[0, :5] = -100
    grads = {}
    for policy, modules in [
        ("none", []),
        ("full", []),
        ("selective", ["norm", "attn_core", "linear_attn_core", "moe", "shared_expert"]),
    ]:
        torch.manual_seed(4)
        model = build_model(
            arch, PrimitivesConfig(recompute=policy, recompute_modules=modules, moe_comm="local")
        )
        loss = model(ids, position_ids=pos, labels=labels)
        if policy == "none":
            with torch.no_grad():
                ref = F.cross_entropy(
                    model(ids, position_ids=pos).reshape(-1, VOCAB), labels.reshape(-1)
                )
            assert abs(loss.item() - ref.item()) < 1e-5
        loss.backward()
        grads[policy] = {n: p.grad for n, p in model.named_parameters()}
    for policy in ("full", "selective"):
        for n, g in grads["none"].items():
            assert torch.equal(g, grads[policy][n]), (policy, n)


def test_bf16_error_budget(tmp_path):
    """bf16 logits: bumblebee's error against the fp32 result stays within HF's own bf16 error
    (x1.5); the conv accumulates in fp32 and every cast sits where HF puts it."""
    torch.manual_seed(5)
    hf = perturbed(transformers.Qwen3_5MoeForCausalLM(hf_config(**CONFIGS["lll-f_gqa2_gva2"])))
    hf.save_pretrained(tmp_path)
    bb = bumblebee.from_hf(str(tmp_path))
    ids = torch.randint(0, VOCAB, (2, T))
    with torch.no_grad():
        ref = hf(ids).logits
        hf_err = (hf.to(torch.bfloat16)(ids).logits.float() - ref).abs().max().item()
        bb_err = (bb.to(torch.bfloat16)(ids).float() - ref).abs().max().item()
    assert bb_err <= 1.5 * hf_err + 1e-3, (bb_err, hf_err)
