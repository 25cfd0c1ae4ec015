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
import re
import sys

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from bumblebee.errors import CheckpointError
from bumblebee.models.base import persistent_buffers

_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def _weight_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f).get("weight_map")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
            raise CheckpointError(f"{index}: not a JSON object ({e})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index}: needs a 'weight_map' object of tensor name -> file name")
        files = sorted(set(weight_map.values()))
        if any(os.path.basename(n) != n for n in files):
            raise CheckpointError(f"{index}: weight_map names a file outside {path}")
        missing = [n for n in files if not os.path.isfile(os.path.join(path, n))]
        if missing:
            raise CheckpointError(f"{path}: index names missing shard(s) {missing}")
        return [os.path.join(path, n) for n in files]
    if os.path.isfile(single):
        return [single]
    raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json")


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise CheckpointError(f"shape mismatch for {name}: checkpoint {tuple(src.shape)}, model {tuple(dst.shape)}")
    if not src.is_floating_point():  # a cast would silently turn it into other weights
        raise CheckpointError(f"{name} is stored as {src.dtype}; model weights must be floating point")
    dst.copy_(src)


def _tensors(file: str):
    """(name, tensor) of one safetensors file; a truncated or foreign file is a one-line error."""
    try:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
    except (OSError, RuntimeError, SafetensorError) as e:
        raise CheckpointError(f"{file}: unreadable safetensors file ({str(e).splitlines()[0][:200]})") from None


@torch.no_grad()
def load_hf_weights(model, path: str) -> None:
    """Copy every tensor of the HF checkpoint at ``path`` into ``model``; every model
    parameter must be covered exactly once."""
    from bumblebee.models import family_of

    family = family_of(model.arch)
    skip_prefixes, renames = family.skip_prefixes, family.hf_prefixes
    params = dict(model.named_parameters())
    params.update(persistent_buffers(model))  # e.g. mlp.gate.e_score_correction_bias (router sigmoid_bias)
    F = model.arch.moe_intermediate_size
    covered: set[str] = set()
    skipped = 0
    for file in _weight_files(path):
        for name, t in _tensors(file):
            if name.startswith(skip_prefixes):
                skipped += 1
                continue
            for prefix, ours in renames.items():
                if name.startswith(prefix):
                    name = ours + name[len(prefix):]
                    break
            if m := _EXPERT.match(name):
                base, e, proj = m.group(1), int(m.group(2)), m.group(3)
                stacked = params.get(f"{base}.w_down" if proj == "down_proj" else f"{base}.w_gate_up")
                if stacked is None or e >= stacked.shape[0]:
                    raise CheckpointError(f"unexpected tensor {name} for this model")
                rows = {"gate_proj": slice(0, F), "up_proj": slice(F, 2 * F), "down_proj": slice(None)}[proj]
                _copy(stacked[e, rows], t, name)
                covered.add(name)
            elif m := _FUSED.match(name):
                target = f"{m.group(1)}.{'w_gate_up' if m.group(2) == 'gate_up_proj' else 'w_down'}"
                if target not in params:
                    raise CheckpointError(f"unexpected tensor {name} for this model")
                _copy(params[target], t, name)
                covered.update(_expert_names(target, params[target].shape[0]))
            elif name in params:
                _copy(params[name], t, name)
                covered.add(name)
            elif name == "lm_head.weight" and model.lm_head is None:
                continue  # tied checkpoints sometimes store the head too
            else:
                raise CheckpointError(f"unexpected tensor {name} in {file}")
    expected = set()
    for name, p in params.items():
        if name.endswith(("experts.w_gate_up", "experts.w_down")):
            expected.update(_expert_names(name, p.shape[0]))
        else:
            expected.add(name)
    if skipped:
        print(f"bumblebee: ignored {skipped} checkpoint tensor(s) under {', '.join(skip_prefixes)} "
              f"(not part of the language model)", file=sys.stderr)
    missing = sorted(expected - covered)
    if missing:
        more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
        raise CheckpointError(f"{path}: checkpoint lacks {', '.join(missing[:3])}{more}")


def _expert_names(stacked_name: str, num_experts: int) -> list[str]:
    base = stacked_name.rsplit(".", 1)[0]
    projs = ("gate_proj", "up_proj") if stacked_name.endswith("w_gate_up") else ("down_proj",)
    return [f"{base}.{e}.{p}.weight" for e in range(num_experts) for p in projs]


def from_hf(path: str, dtype: torch.dtype = torch.float32, prims=None):
    """Build a bumblebee model from a HF directory (config.json + safetensors)."""
    from bumblebee.models import arch_from_hf_dict, build_model, read_hf_config

    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise CheckpointError(f"{path}: config.json not found")
    try:
        arch = arch_from_hf_dict(read_hf_config(cfg_path))
    except ValueError as e:  # unsupported model_type, invalid architecture, malformed JSON
        raise CheckpointError(f"{cfg_path}: {e}" if not str(e).startswith(cfg_path) else str(e)) from None
    model = build_model(arch, prims)
    load_hf_weights(model, path)
    return model.to(dtype)


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
