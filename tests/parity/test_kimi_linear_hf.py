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

import parity_utils as pu
import pytest
import torch
import transformers

VOCAB, T = pu.VOCAB, 40  # T > 16: the chunked KDA core (16-token chunks) crosses chunk boundaries
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
    config = transformers.KimiLinearConfig(**{**BASE, **overrides})
    return pu.hf_model(transformers.KimiLinearForCausalLM, config, seed, add_bias)


def add_bias(hf):
    pu.perturb(hf, bias="add")


def to_bumblebee_name(hf_name: str) -> str:
    hf_name = re.sub(r"\.experts\.gate_up_proj$", ".experts.w_gate_up", hf_name)
    hf_name = re.sub(r"\.experts\.down_proj$", ".experts.w_down", hf_name)
    return hf_name.replace("forget_gate.", "")


def grads(bb, hf):
    """Every HF parameter's gradient and bumblebee's: HF runs one conv over [q | k | v], so its
    gradient is compared with bumblebee's three convs' concatenated."""
    bb_params, hf_params = dict(bb.named_parameters()), dict(hf.named_parameters())
    conv_names = {n for n in bb_params if "_conv1d." in n}
    assert {to_bumblebee_name(n) for n in hf_params if "conv1d" not in n} == set(
        bb_params
    ) - conv_names
    out = []
    for hf_name, p in hf_params.items():
        if "conv1d" in hf_name:
            base = to_bumblebee_name(hf_name).rsplit(".conv1d", 1)[0]
            g = torch.cat([bb_params[f"{base}.{x}_conv1d.weight"].grad for x in "qkv"])
        else:
            g = bb_params[to_bumblebee_name(hf_name)].grad
        out.append((hf_name, g, p.grad))
    return out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_and_grads_match_hf(name, tmp_path):
    hf = hf_model(0, **CONFIGS[name])
    bb = pu.load(hf, tmp_path, "kimi_linear")
    pu.assert_logits_and_grads(bb, hf, T, grads)


def test_to_hf_round_trip_and_packed_rows(tmp_path):
    hf = hf_model(1, **CONFIGS["l-f-l-l_dense1"])
    bb = pu.load(hf, tmp_path / "src", "kimi_linear")
    pu.assert_to_hf_loads(bb, transformers.KimiLinearForCausalLM, tmp_path / "out", T, "state_dict")
    pu.assert_packed_rows(bb, hf, [13, 20, 2, 9])  # a 2-token document is shorter than the conv


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
