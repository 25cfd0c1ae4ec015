"""Model families composed from primitives, and their Hugging Face mapping."""

from __future__ import annotations

import json
import os

from bumblebee.models.arch import ArchError, Qwen3MoeArch
from bumblebee.models.arch_qwen3_5 import Qwen3_5MoeArch
from bumblebee.models.presets import PRESETS, preset

FAMILIES = {"qwen3_moe": Qwen3MoeArch, "qwen3_5_moe": Qwen3_5MoeArch}
# HF model_type -> family (qwen3_5_moe is the multimodal wrapper: its text_config is loaded)
HF_MODEL_TYPES = {"qwen3_moe": "qwen3_moe", "qwen3_5_moe_text": "qwen3_5_moe", "qwen3_5_moe": "qwen3_5_moe"}


def arch_from_hf_dict(d: dict):
    from bumblebee.errors import ConfigError

    model_type = d.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise ConfigError(f"unsupported model_type {model_type!r}; valid: {', '.join(HF_MODEL_TYPES)}")
    try:
        return FAMILIES[HF_MODEL_TYPES[model_type]].from_hf_dict(d)
    except (ArchError, TypeError) as e:
        raise ConfigError(f"invalid {model_type} config: {e}") from None


def resolve_arch(model_cfg):
    """The architecture a ``[model]`` section describes (preset or HF dir, plus overrides)."""
    from bumblebee.errors import ConfigError

    if model_cfg.name not in PRESETS:
        raise ConfigError(f"unknown model.name {model_cfg.name!r}; valid: {', '.join(PRESETS)}")
    if model_cfg.name not in FAMILIES:
        raise ConfigError(f"model family {model_cfg.name!r} is not implemented yet; valid: {', '.join(FAMILIES)}")
    if model_cfg.hf_path:
        path = os.path.join(model_cfg.hf_path, "config.json")
        if not os.path.isfile(path):
            raise ConfigError(f"model.hf_path: no config.json in {model_cfg.hf_path}")
        with open(path) as f:
            arch = arch_from_hf_dict(json.load(f))
    else:
        presets = PRESETS[model_cfg.name]
        if model_cfg.preset not in presets:
            raise ConfigError(f"unknown {model_cfg.name} preset {model_cfg.preset!r}; valid: {', '.join(presets)}")
        arch = arch_from_hf_dict(preset(model_cfg.name, model_cfg.preset))
    try:
        return arch.with_overrides(model_cfg.arch) if model_cfg.arch else arch
    except (ArchError, TypeError) as e:
        raise ConfigError(f"model.arch: {e}") from None


def build_model(arch, prims=None, groups=None):
    """An initialized model of ``arch``'s family with the chosen primitives; ``groups``
    (``primitives.parallel.ParallelGroups``) when it is split over ranks."""
    from bumblebee.models.qwen3_5_moe import Qwen3_5MoeForCausalLM
    from bumblebee.models.qwen3_moe import Qwen3MoeForCausalLM

    classes = {"qwen3_moe": Qwen3MoeForCausalLM, "qwen3_5_moe": Qwen3_5MoeForCausalLM}
    return classes[HF_MODEL_TYPES[arch.model_type]](arch, prims, groups)
