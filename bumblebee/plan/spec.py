"""Which model the planner plans for: a preset name or a Hugging Face config, as a ``ModelSpec``.

The arithmetic (``ModelSpec``: parameters, shapes, FLOPs) belongs to the model families
(``bumblebee/models/spec.py``, built by each family's ``arch.to_spec()``); this module only
turns ``--model`` into one.
"""

from __future__ import annotations

import dataclasses
import json
import os

from bumblebee.config import ConfigError
from bumblebee.models import FAMILIES, arch_from_hf_dict
from bumblebee.models.spec import ATTN, DENSE, GDN, MOE, ModelSpec  # noqa: F401  (re-exported for the planner)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanSpec(ModelSpec):
    """A ``ModelSpec`` with what only the planner's memory terms read: ``mtp_layers``, the last
    layers that are multi-token-prediction modules (``timeline.py``); ``partial_rope``, RoPE on
    part of each head (its concatenated output is head-major, so the CP ring's flat copies of q
    and k are real copies: ``layer_moments.py``)."""

    mtp_layers: int = 0
    partial_rope: bool = False


def spec_from_hf_dict(d: dict, name: str = "custom") -> ModelSpec:
    """A ``ModelSpec`` from a Hugging Face config dict of any registered family. Multi-token
    prediction modules are planned as that many more (attention, MoE) layers after the last
    one (their parameters, activations, FLOPs and place on the last pipeline stage; not their
    [2H -> H] projection and extra LM-head pass, about 4% of DeepSeek-V3's FLOPs per depth)."""
    try:
        arch = arch_from_hf_dict(d)
    except ConfigError as e:
        raise ConfigError(f"model {name}: {e}") from None
    spec = arch.to_spec(name)
    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
    d_ = spec.mtp_depth
    if d_:
        fields.update(mixers=spec.mixers + (ATTN,) * d_, mlps=spec.mlps + (MOE,) * d_, mtp_depth=0)
    partial = getattr(arch, "partial_rotary_factor", 1.0) < 1.0
    return PlanSpec(**fields, mtp_layers=d_, partial_rope=partial)


def preset_names() -> dict[str, str]:
    """Real-size preset name -> family (the ``tiny`` test presets are reachable as ``family/tiny``)."""
    names = {}
    for family in FAMILIES.values():
        for name in family.presets:
            names[name if name != "tiny" else f"{family.name}/tiny"] = family.name
    return names


def load_spec(model: str) -> tuple[ModelSpec, dict]:
    """``--model`` (a preset name or a path to a config.json / HF directory) -> (spec, HF dict)."""
    names = preset_names()
    if model in names:
        d = FAMILIES[names[model]].presets[model.split("/")[-1]]
        return spec_from_hf_dict(d, name=model), dict(d)
    path = os.path.join(model, "config.json") if os.path.isdir(model) else model
    if os.path.isfile(path):
        try:
            with open(path) as f:
                d = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"--model {model}: cannot read JSON: {e}") from None
        if not isinstance(d, dict):
            raise ConfigError(f"--model {model}: expected a JSON object")
        return spec_from_hf_dict(
            d, name=os.path.basename(os.path.dirname(os.path.abspath(path))) or path
        ), d
    raise ConfigError(
        f"unknown model {model!r}; valid: {', '.join(names)}, or a path to a config.json"
    )
