"""Kimi Linear's Hugging Face name map beyond identity: checkpoints (the release and
``transformers``' ``save_pretrained`` alike) store every MLP under ``block_sparse_moe`` and the
routed experts' projections as ``w1`` (gate), ``w3`` (up), ``w2`` (down); bumblebee's modules are
HF's runtime names (``mlp``, ``gate_proj`` / ``up_proj`` / ``down_proj``)."""

from __future__ import annotations

import re

_EXPERT_IN = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_EXPERT_OUT = {v: k for k, v in _EXPERT_IN.items()}
_IN = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.(.+)$")
_OUT = re.compile(r"^(model\.layers\.\d+)\.mlp\.(.+)$")
_EXPERT = re.compile(r"^experts\.(\d+)\.(\w+)\.weight$")


def hf_name_in(arch, name: str) -> str:
    """Checkpoint name -> bumblebee name."""
    m = _IN.match(name)
    if m is None:
        return name
    rest = m.group(2)
    if (e := _EXPERT.match(rest)) and e.group(2) in _EXPERT_IN:
        rest = f"experts.{e.group(1)}.{_EXPERT_IN[e.group(2)]}.weight"
    return f"{m.group(1)}.mlp.{rest}"


def hf_name_out(arch, name: str) -> str:
    """bumblebee name (per-expert projections already split) -> checkpoint name."""
    m = _OUT.match(name)
    if m is None:
        return name
    rest = m.group(2)
    if (e := _EXPERT.match(rest)) and e.group(2) in _EXPERT_OUT:
        rest = f"experts.{e.group(1)}.{_EXPERT_OUT[e.group(2)]}.weight"
    return f"{m.group(1)}.block_sparse_moe.{rest}"
