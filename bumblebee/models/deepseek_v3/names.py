"""DeepSeek-V3's Hugging Face name map beyond identity: its MTP modules live at
``model.layers.{L + k}`` in a checkpoint and store their own copy of the embedding and LM head."""

from __future__ import annotations

import re

from bumblebee.models.deepseek_v3.arch import DeepseekV3Arch

# ---------------------------------------------------------------------------------------------
# Hugging Face names of the MTP modules

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_MTP = re.compile(r"^mtp\.(\d+)\.(.+)$")
_SHARED_COPIES = ("embed_tokens.weight", "shared_head.head.weight")


def hf_name_in(arch: DeepseekV3Arch, name: str) -> str:
    """Checkpoint name -> bumblebee name ("" for an MTP module's copy of the shared embedding / head)."""
    m = _LAYER.match(name)
    if m is None or int(m.group(1)) < arch.num_hidden_layers:
        return name
    return (
        ""
        if m.group(2) in _SHARED_COPIES
        else f"mtp.{int(m.group(1)) - arch.num_hidden_layers}.{m.group(2)}"
    )


def hf_name_out(arch: DeepseekV3Arch, name: str) -> str:
    m = _MTP.match(name)
    return (
        name
        if m is None
        else f"model.layers.{arch.num_hidden_layers + int(m.group(1))}.{m.group(2)}"
    )


def hf_copies(arch: DeepseekV3Arch) -> dict[str, list[str]]:
    """The per-module copies of the embedding and LM head that DeepSeek's checkpoints carry:
    bumblebee name of the shared tensor -> checkpoint names written with the same values."""
    layers = [
        f"model.layers.{arch.num_hidden_layers + k}" for k in range(arch.num_nextn_predict_layers)
    ]
    embed = [f"{base}.embed_tokens.weight" for base in layers]
    head = [f"{base}.shared_head.head.weight" for base in layers]
    if arch.tie_word_embeddings:
        return {"model.embed_tokens.weight": embed + head} if layers else {}
    return {"model.embed_tokens.weight": embed, "lm_head.weight": head} if layers else {}
