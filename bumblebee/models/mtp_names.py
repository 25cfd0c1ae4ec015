"""Checkpoint names that depend on the family and arch, and whether a checkpoint holds MTP tensors.

Kept apart from ``models/hf.py`` so that ``resolve_arch`` (models/__init__.py) can ask, before
a model is built, whether a Hugging Face directory holds the multi-token-prediction tensors
its config counts (HF's ``DeepseekV3Config`` defaults to one MTP module; a checkpoint saved
by ``DeepseekV3ForCausalLM`` has none): then the model is built without MTP.
"""

from __future__ import annotations

import glob
import json
import os
import sys

from safetensors import SafetensorError, safe_open

from bumblebee.models.family import family_of_model_type


def hf_name_in(family, arch, name: str) -> str:
    """Checkpoint name -> bumblebee name: the family's prefixes, then its arch-aware map
    ("" = a copy of a shared tensor, skipped)."""
    for prefix, ours in family.hf_prefixes.items():
        if name.startswith(prefix):
            name = ours + name[len(prefix) :]
            break
    return family.hf_name_in(arch, name) if family.hf_name_in else name


def checkpoint_names(path: str) -> list[str]:
    """Tensor names of the checkpoint at ``path`` (the index's weight map, else the files'
    headers); [] when unreadable (the loader reports that)."""
    index = os.path.join(path, "model.safetensors.index.json")
    try:
        if os.path.isfile(index):
            with open(index, encoding="utf-8") as f:
                return list(json.load(f).get("weight_map") or {})
        names = []
        for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
            with safe_open(file, framework="pt") as f:
                names.extend(f.keys())
        return names
    except (
        OSError,
        RuntimeError,
        SafetensorError,
        UnicodeDecodeError,
        json.JSONDecodeError,
        AttributeError,
    ):
        return []


def without_absent_mtp(arch, path: str):
    """``arch`` with no MTP modules when the checkpoint at ``path`` holds none of their tensors,
    with a one-line notice; ``arch`` itself otherwise."""
    family = family_of_model_type(arch.model_type)
    key = family.mtp_arch_key
    if not key or not getattr(arch, key) or not os.path.isdir(path):
        return arch
    names = checkpoint_names(path)
    if not names or any(hf_name_in(family, arch, n).startswith("mtp.") for n in names):
        return arch
    print(
        f"bumblebee: {path} holds no multi-token-prediction tensors; building without MTP ({key} = 0)",
        file=sys.stderr,
    )
    return arch.with_overrides({key: 0})


def skip_prefixes(family, arch) -> tuple[str, ...]:
    """Checkpoint prefixes outside the model: the family's skip list, plus ``mtp.`` when the arch
    holds no MTP modules (a Qwen3.5 config without ``mtp_num_hidden_layers``: its mtp.* tensors are
    skipped on load and carried over on export, as before MTP was a model part)."""
    key = family.mtp_arch_key
    return tuple(family.skip_prefixes) + (("mtp.",) if key and not getattr(arch, key, 0) else ())
