"""The shared blocks (models/blocks.py) keep what each family's own copy did: the MoE adds its
shared expert whether or not it runs under a recompute policy, and the all-heads q/k norm
refuses a projection that holds only part of a token's heads instead of normalizing it."""

import pytest
import torch

from bumblebee.config import PrimitivesConfig
from bumblebee.errors import ConfigError
from bumblebee.models import FAMILIES, arch_from_hf_dict, build_model
from bumblebee.models.blocks import Attention, MoE
from bumblebee.primitives.parallel import ParallelGroups
from bumblebee.primitives.recompute import NoRecompute


def _arch(family):
    return arch_from_hf_dict(dict(FAMILIES[family].presets["tiny"]))


def test_moe_adds_its_gated_shared_expert_with_or_without_a_recompute_policy():
    model = build_model(_arch("qwen3_5_moe").with_overrides({"num_hidden_layers": 1}), seed=0)
    moe = model.model.layers[0].mlp
    bare = MoE(model.arch, PrimitivesConfig(), moe.dispatch, ParallelGroups(), shared="gated")
    bare.load_state_dict(moe.state_dict())
    x = torch.randn(2, 16, model.arch.hidden_size)
    routed, _ = moe.routed(x)
    want = routed + torch.sigmoid(moe.shared_expert_gate(x)) * moe.shared_expert(x)
    with torch.no_grad():
        torch.testing.assert_close(moe(x)[0], want, rtol=0, atol=0)
        torch.testing.assert_close(bare(x)[0], want, rtol=0, atol=0)


def test_all_heads_qk_norm_refuses_part_of_the_heads():
    arch = _arch("minimax_m2")
    attention = Attention(arch, None, NoRecompute(), qk_norm="all")
    half = arch.num_attention_heads // 2 * arch.head_dim  # a rank's share under split heads
    attention.q_proj = torch.nn.Linear(arch.hidden_size, half, bias=False)
    x = torch.randn(1, 4, arch.hidden_size)
    cos = sin = torch.ones(1, 4, arch.rotary_dim)
    with pytest.raises(ConfigError, match="spans all heads of a token"):
        attention(x, cos, sin, None)
