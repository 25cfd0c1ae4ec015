"""Hugging Face checkpoints in and out: ``from_hf`` and ``to_hf``.

bumblebee's parameter names equal HF's except for the routed experts, which
bumblebee stacks per layer (``mlp.experts.w_gate_up`` [E, 2F, H] and
``mlp.experts.w_down`` [E, H, F]) while HF checkpoints store one tensor per
expert and projection (``mlp.experts.{e}.{gate,up,down}_proj.weight``). Both
directions are exact copies, so a load followed by a save is bit-identical.
Checkpoints that already hold HF's fused expert tensors (``experts.gate_up_proj``,
``experts.down_proj``) load too. The rest of the name map is the family's (the family
table, models/family.py): prefixes read under another name (the multimodal
``Qwen3_5MoeForConditionalGeneration`` nests the language model under
``model.language_model.``, read as ``model.``) and prefixes that are not the language
model (its vision tower ``model.visual.`` and MTP head ``mtp.``), skipped with a
one-line notice.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from bumblebee.errors import CheckpointError
from bumblebee.models.base import persistent_buffers
from bumblebee.models.hf_read import load_hf_weights, weight_files  # noqa: F401  (load_hf_weights re-exported)


def from_hf(path: str, dtype: torch.dtype = torch.float32, prims=None):
    """Build a bumblebee model from a HF directory (config.json + safetensors): built on the meta
    device, given memory in ``dtype`` and filled tensor by tensor from the checkpoint."""
    from bumblebee.models import arch_from_hf_dict, build_model, materialize, read_hf_config

    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise CheckpointError(f"{path}: config.json not found")
    try:
        arch = arch_from_hf_dict(read_hf_config(cfg_path))
    except ValueError as e:  # unsupported model_type, invalid architecture, malformed JSON
        raise CheckpointError(f"{cfg_path}: {e}" if not str(e).startswith(cfg_path) else str(e)) from None
    weight_files(path)  # a missing weights file is reported before anything is built
    model = build_model(arch, prims, device="meta")
    return materialize(model, torch.device("cpu"), hf_path=path, dtype=dtype)


def hf_state_dict(model):
    """Yield (HF name, tensor) pairs of ``model``, experts split per expert."""
    F = model.arch.moe_intermediate_size
    for name, p in model.named_parameters():
        t = p.detach()
        if name.endswith("experts.w_gate_up"):
            base = name.rsplit(".", 1)[0]
            for e in range(t.shape[0]):
                yield f"{base}.{e}.gate_proj.weight", t[e, :F]
                yield f"{base}.{e}.up_proj.weight", t[e, F:]
        elif name.endswith("experts.w_down"):
            base = name.rsplit(".", 1)[0]
            for e in range(t.shape[0]):
                yield f"{base}.{e}.down_proj.weight", t[e]
        else:
            yield name, t
    for name, b in persistent_buffers(model):  # e.g. the sigmoid_bias router's e_score_correction_bias
        yield name, b.detach()


_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def to_hf(model, out_dir: str, max_shard_bytes: int = 5 * 2**30) -> None:
    """Write ``model`` as a HF directory: config.json and safetensors, sharded with an
    index when larger than ``max_shard_bytes``."""
    os.makedirs(out_dir, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    dtype = None
    for name, t in hf_state_dict(model):
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous().cpu().clone()
        size += nbytes
        dtype = dtype or t.dtype
    cfg = model.arch.to_hf_dict()
    cfg["dtype"] = _DTYPE_NAMES.get(dtype, "float32")
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    if len(shards) == 1:
        save_file(shards[0], os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(out_dir, fname), metadata={"format": "pt"})
        for name, t in shard.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
