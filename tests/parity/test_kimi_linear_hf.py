"""Parity of bumblebee's Kimi Linear with Hugging Face ``transformers``' ``KimiLinearForCausalLM``.

Tiny random models are saved with ``save_pretrained`` (checkpoint names: ``block_sparse_moe``,
experts' ``w1`` / ``w2`` / ``w3``, separate ``q/k/v_conv1d``) and loaded with ``bumblebee.from_hf``.
Configurations vary the KDA / MLA pattern, KDA heads and head dim, the conv width, q LoRA, dense
layers and expert groups; every 1-D parameter (norms, dt_bias) and the router
bias are perturbed so a wrong convention cannot hide.

- logits (fp32): 1e-4 max-abs against HF (HF runs its PyTorch ``chunk_kda`` fallback);
- gradients (fp32): every parameter within 1e-4 relative after one backward;
- ``to_hf`` writes a directory ``transformers`` loads with equal logits, and bumblebee reads its
  own output bit for bit;
- a packed row equals HF run on each document alone.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
import transformers

import bumblebee

VOCAB, T = 97, 40  # T > 16: the chunked KDA core (16-token chunks) crosses chunk boundaries
LIN, FULL = "linear_attention", "full_attention"
BASE = dict(
    vocab_size=VOCAB, hidden_size=48, intermediate_size=56, moe_intermediate_size=24,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None,
    qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, num_local_experts=4,
    num_experts_per_tok=2, linear_head_dim=8, linear_num_heads=3, linear_conv_kernel_dim=4,
    n_group=1, topk_group=1, pad_token_id=None, bos_token_id=1, eos_token_id=2,
    tie_word_embeddings=False,
)  # fmt: skip
CONFIGS = {
    "l-f-l-l_dense1": dict(num_hidden_layers=4, layer_types=[LIN, FULL, LIN, LIN]),
    "f-l-l_qlora_groups": dict(
        num_hidden_layers=3,
        layer_types=[FULL, LIN, LIN],
        mlp_layer_types=["sparse"] * 3,
        q_lora_rank=12,
        linear_head_dim=12,
        linear_num_heads=2,
        linear_conv_kernel_dim=3,
        num_local_experts=8,
        n_group=2,
        topk_group=1,
    ),  # fmt: skip
}


def hf_model(seed, **overrides):
    torch.manual_seed(seed)
    hf = transformers.KimiLinearForCausalLM(transformers.KimiLinearConfig(**{**BASE, **overrides}))
    with torch.no_grad():
        for _, p in hf.named_parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn_like(p))
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.add_(0.05 * torch.randn_like(b))
    return hf.float().eval()


def to_bumblebee_name(hf_name: str) -> str:
    hf_name = re.sub(r"\.experts\.gate_up_proj$", ".experts.w_gate_up", hf_name)
    hf_name = re.sub(r"\.experts\.down_proj$", ".experts.w_down", hf_name)
    return hf_name.replace("forget_gate.", "")


def loss_of(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_and_grads_match_hf(name, tmp_path):
    hf = hf_model(0, **CONFIGS[name])
    hf.save_pretrained(tmp_path)
    bb = bumblebee.from_hf(str(tmp_path))
    assert bb.family == "kimi_linear"
    assert bb.arch.num_params()["total"] == sum(p.numel() for p in hf.parameters())
    ids, labels = torch.randint(0, VOCAB, (2, T)), torch.randint(0, VOCAB, (2, T))
    ref_logits = hf(ids).logits
    logits = bb(ids)
    assert (logits - ref_logits).abs().max().item() < 1e-4

    loss_of(logits, labels).backward()
    loss_of(ref_logits, labels).backward()
    bb_params, hf_params = dict(bb.named_parameters()), dict(hf.named_parameters())
    conv_names = {n for n in bb_params if "_conv1d." in n}
    assert {to_bumblebee_name(n) for n in hf_params if "conv1d" not in n} == set(
        bb_params
    ) - conv_names
    for hf_name, p in hf_params.items():
        if "conv1d" in hf_name:  # HF runs one conv over [q | k | v]: compare its three parts
            base = to_bumblebee_name(hf_name).rsplit(".conv1d", 1)[0]
            g = torch.cat([bb_params[f"{base}.{x}_conv1d.weight"].grad for x in "qkv"])
        else:
            g = bb_params[to_bumblebee_name(hf_name)].grad
        g_ref = p.grad
        scale = g_ref.abs().max().clamp_min(1e-12)
        assert ((g - g_ref).abs().max() / scale).item() < 1e-4, hf_name


def test_to_hf_round_trip_and_packed_rows(tmp_path):
    hf = hf_model(1, **CONFIGS["l-f-l-l_dense1"])
    hf.save_pretrained(tmp_path / "src")
    bb = bumblebee.from_hf(str(tmp_path / "src"))
    bumblebee.to_hf(bb, str(tmp_path / "out"))
    back = transformers.KimiLinearForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    ids = torch.randint(0, VOCAB, (2, T))
    with torch.no_grad():
        assert (back(ids).logits - bb(ids)).abs().max().item() < 1e-4
    reloaded = bumblebee.from_hf(str(tmp_path / "out"))
    for (n, a), (_, b) in zip(bb.state_dict().items(), reloaded.state_dict().items()):
        assert torch.equal(a, b), n
    lengths = [13, 20, 2, 9]  # a 2-token document is shorter than the conv window
    ids = torch.randint(0, VOCAB, (1, sum(lengths)))
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        packed = bb(ids, position_ids=pos)
        ref = torch.cat([hf(doc).logits for doc in ids.split(lengths, dim=1)], dim=1)
    assert (packed - ref).abs().max().item() < 1e-4


def test_release_preset_counts_transformers_parameters():
    """The ModelSpec (planner) of the Kimi-Linear-48B-A3B preset: 49,122,675,072 parameters, what
    ``transformers`` 5.23 builds on the meta device from the same config (counted once; building
    it here would take seconds). Layer pattern: 1-based MLA layers 4, 8, ..., 24, 27."""
    from bumblebee.models import arch_from_hf_dict
    from bumblebee.models.presets import PRESETS

    arch = arch_from_hf_dict(dict(PRESETS["kimi_linear"]["kimi-linear-48b-a3b"]))
    mla = [i + 1 for i, t in enumerate(arch.layer_types) if t == FULL]
    assert mla == [4, 8, 12, 16, 20, 24, 27] and arch.mlp_layer_types[:2] == ["dense", "sparse"]
    assert arch.num_params()["total"] == 49_122_675_072
    assert arch.to_hf_dict()["num_experts_per_token"] == 8  # Kimi's spelling written back
