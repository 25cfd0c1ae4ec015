"""MiniMax-M2's Hugging Face names beyond identity: Mixtral's expert and router names.

A released checkpoint (and ``save_pretrained``) stores a layer's MoE as ``block_sparse_moe``:
``experts.{e}.w1`` / ``w3`` / ``w2`` (gate / up / down), the router ``gate.weight`` and the
correction bias on the block itself (``block_sparse_moe.e_score_correction_bias``).
bumblebee reads them as the per-expert names its loader stacks (``mlp.experts.{e}.gate_proj``...)
and the ``sigmoid_bias`` router's ``mlp.gate.*``; exports write the released names back. The
names of ``transformers``' in-memory model (``mlp.experts.gate_up_proj``, ``mlp.e_score_correction_bias``)
load too.
"""

from __future__ import annotations

import re

_IN_EXPERT = re.compile(
    r"^(model\.layers\.\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$"
)
_OUT_EXPERT = re.compile(
    r"^(model\.layers\.\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$"
)
_BIAS_IN = re.compile(r"^(model\.layers\.\d+)\.(?:block_sparse_moe|mlp)\.e_score_correction_bias$")
_ROUTER_IN = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.gate\.weight$")
_OURS = re.compile(r"^(model\.layers\.\d+)\.mlp\.gate\.(weight|e_score_correction_bias)$")
_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_W = {v: k for k, v in _PROJ.items()}


def hf_name_in(arch, name: str) -> str:
    """Checkpoint name -> bumblebee name (the loader's per-expert names for the experts)."""
    if m := _IN_EXPERT.match(name):
        return f"{m.group(1)}.mlp.experts.{m.group(2)}.{_PROJ[m.group(3)]}.weight"
    if m := _BIAS_IN.match(name):
        return f"{m.group(1)}.mlp.gate.e_score_correction_bias"
    if m := _ROUTER_IN.match(name):
        return f"{m.group(1)}.mlp.gate.weight"
    return name


def hf_name_out(arch, name: str) -> str:
    """HF-layout name (experts already split per expert) -> the released checkpoint's name."""
    if m := _OUT_EXPERT.match(name):
        return f"{m.group(1)}.block_sparse_moe.experts.{m.group(2)}.{_W[m.group(3)]}.weight"
    if m := _OURS.match(name):
        bias = m.group(2) == "e_score_correction_bias"
        return f"{m.group(1)}.block_sparse_moe.{'' if bias else 'gate.'}{m.group(2)}"
    return name
