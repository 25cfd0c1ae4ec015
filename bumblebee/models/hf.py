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
model (its vision tower ``model.visual.``), skipped with a one-line notice, and names that
need the arch (DeepSeek's MTP modules stored as ``model.layers.{L + k}``, MiniMax's Mixtral
expert names ``block_sparse_moe.experts.{e}.w1``, applied after the experts are split), and
tensors a family stores under another name or layout (``hf_stored``, models/hf_stored.py:
gpt-oss's router and its transposed, interleaved fused experts), converted both ways exactly. A config that
counts MTP modules over a checkpoint without their tensors builds without MTP.
Block-FP8 checkpoints (``weight_scale_inv``) load dequantized (models/hf_read.py); ``to_hf``
writes plain weights in ``dtype`` and no ``quantization_config``.
"""

from __future__ import annotations

import os

import torch

from bumblebee.errors import CheckpointError
from bumblebee.models.base import persistent_buffers
from bumblebee.models.hf_read import (  # noqa: F401  (load_hf_weights re-exported)
    checkpoint_block_size,
    load_hf_weights,
    weight_files,
)
from bumblebee.models.hf_stored import stored_entry
from bumblebee.models.hf_write import hf_layout, write_hf
from bumblebee.models.mtp_names import without_absent_mtp

_weight_files = weight_files  # the name rl/weights.py imports


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
        raise CheckpointError(
            f"{cfg_path}: {e}" if not str(e).startswith(cfg_path) else str(e)
        ) from None
    weight_files(path)  # a missing weights file is reported before anything is built
    checkpoint_block_size(path)  # so is a quantization we cannot read
    model = build_model(without_absent_mtp(arch, path), prims, device="meta")
    return materialize(model, torch.device("cpu"), hf_path=path, dtype=dtype)


def hf_state_dict(model):
    """Yield (HF name, tensor) pairs of ``model``, experts split per expert, each tensor followed by
    the copies the family's checkpoints store of it (DeepSeek's per-MTP-module embedding and head)."""
    from bumblebee.models import family_of

    family = family_of(model.arch)
    F = model.arch.moe_intermediate_size
    copies = family.hf_copies(model.arch) if family.hf_copies else {}
    out = family.hf_name_out or (lambda arch, n: n)
    for name, p in model.named_parameters():
        t = p.detach()
        # the family's names apply to the split per-expert names (MiniMax's w1 / w3 / w2)
        for hf, _, _, part in hf_layout([(name, tuple(t.shape))], F, family.hf_stored):
            # part: a split expert's rows, or a declared layout's conversion (callable)
            piece = t if part is None else part(t) if callable(part) else t[part[0], part[1]]
            yield out(model.arch, hf), piece
        for copy in copies.get(name, ()):
            yield copy, t
    for name, b in persistent_buffers(
        model
    ):  # e.g. the sigmoid_bias router's e_score_correction_bias
        hf = family.hf_name_out(model.arch, name) if family.hf_name_out else name
        entry = stored_entry(family.hf_stored, hf)
        yield (
            (entry.checkpoint_name(hf), entry.to_checkpoint(b.detach()))
            if entry
            else (hf, b.detach())
        )


def to_hf(
    model,
    out_dir: str,
    max_shard_bytes: int = 5 * 2**30,
    *,
    dtype: torch.dtype | None = None,
    source: str = "",
) -> None:
    """Write ``model`` as a HF directory: config.json and safetensors (in ``dtype``, default the
    parameters'), sharded with an index when larger than ``max_shard_bytes``, one tensor at a time
    (models/hf_write.py, which also writes the family's copies, e.g. DeepSeek's per-MTP-module
    embedding and head). ``source``: the HF directory it came from, whose tensors outside the
    language model (vision tower, MTP head) are carried over unchanged. A model with LoRA
    adapters is written merged."""
    named = [(n, p.detach()) for n, p in list(model.named_parameters()) + persistent_buffers(model)]
    info = getattr(model, "lora_info", None)
    if info is not None:  # LoRA: the adapters merged into their base tensors (models/lora.py)
        from bumblebee.models.lora import merged_stream

        named = list(merged_stream(named, info.scale))
    dtype = dtype or (named[0][1].dtype if named else torch.float32)
    write_hf(
        out_dir,
        model.arch,
        [(n, tuple(t.shape)) for n, t in named],
        named,
        dtype=dtype,
        max_shard_bytes=max_shard_bytes,
        source=source,
    )
