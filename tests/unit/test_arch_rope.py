"""Every family reads HF's RoPE dict through the shared check (models/arch.py): the kinds it
implements load, any other is refused by name, in ``rope_parameters`` or the older
``rope_scaling`` (``type`` spelling included), and YaRN needs the length it was stretched from.
Kimi Linear has no RoPE (its MLA layers run without it) and is left out."""

from __future__ import annotations

import pytest

from bumblebee.errors import ConfigError
from bumblebee.models import arch_from_hf_dict
from bumblebee.models.presets import PRESETS

YARN = {"factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0}
IMPLEMENTED = {  # the kinds each family's model code computes
    "qwen3_moe": {"default"},
    "qwen3_5_moe": {"default"},
    "qwen3_next": {"default"},
    "glm4_moe": {"default"},
    "minimax_m2": {"default"},
    "deepseek_v3": {"default", "yarn"},
    "deepseek_v32": {"default", "yarn"},
    "glm_moe_dsa": {"default", "yarn"},
    "gpt_oss": {"default", "yarn"},
}


def with_rope(family: str, key: str, rope: dict) -> dict:
    """The family's tiny preset with ``rope`` as its only RoPE dict, under ``key``."""
    d = PRESETS[family]["tiny"]
    return {
        **{k: v for k, v in d.items() if k not in ("rope_parameters", "rope_scaling")},
        key: rope,
    }


@pytest.mark.parametrize("family", list(IMPLEMENTED))
def test_rope_kinds_load_or_are_refused(family):
    for kind in ("default", "yarn", "linear", "llama3"):
        for key, spelling in (("rope_parameters", "rope_type"), ("rope_scaling", "type")):
            rope = {spelling: kind, "rope_theta": 1e4, **(YARN if kind != "default" else {})}
            d = with_rope(family, key, rope)
            if kind in IMPLEMENTED[family]:
                arch_from_hf_dict(d)
            else:
                with pytest.raises(ConfigError, match=f"rope_type '{kind}' is not supported"):
                    arch_from_hf_dict(d)
    if "yarn" in IMPLEMENTED[family]:
        rope = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}
        with pytest.raises(ConfigError, match="original_max_position_embeddings"):
            arch_from_hf_dict(with_rope(family, "rope_parameters", rope))


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next", "glm4_moe", "minimax_m2"])
def test_the_rope_dict_wins_over_a_stale_top_level_key(family):
    """transformers 5.17 saves the config class's default ``partial_rotary_factor`` at the top level
    beside ``rope_parameters``; its models read the dict, so bumblebee does too. A top-level key
    still counts where the dict has none (older configs)."""
    rope = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25}
    d = {**with_rope(family, "rope_parameters", rope), "partial_rotary_factor": 0.5}
    d["rope_theta"] = 5e5
    arch = arch_from_hf_dict(d)
    assert (arch.partial_rotary_factor, arch.rope_theta) == (0.25, 1e4)
    del rope["partial_rotary_factor"]
    arch = arch_from_hf_dict(
        {**with_rope(family, "rope_parameters", rope), "partial_rotary_factor": 0.5}
    )
    assert arch.partial_rotary_factor == 0.5
