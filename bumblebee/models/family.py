"""The family table: what a model family brings, and the one place the rest of bumblebee looks it up.

A family is a decoder layer (inside its ``model`` class, a ``CausalLM`` subclass), an arch
dataclass (HF ``config.json`` keys in and out, validation, ``to_spec()`` for the planner),
presets (HF config dicts), the HF ``model_type`` names it reads, and its Hugging Face name
map: checkpoint prefixes to read as the language model and prefixes that are not part of it
(skipped on load, e.g. a vision tower). Runtime, RL and planner code never names a family:
registering one makes it trainable, convertible and plannable.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Family:
    name: str  # model.name in the config
    arch: type  # from_hf_dict / to_hf_dict / with_overrides / validate / to_spec
    model: type  # CausalLM subclass: model(arch, prims, groups)
    presets: dict  # preset name -> HF config dict
    hf_model_types: tuple[str, ...]  # config.json model_type values this family reads
    # HF name map beyond identity and stacked experts (models/hf.py):
    hf_prefixes: dict = field(default_factory=dict)  # checkpoint prefix -> bumblebee prefix
    skip_prefixes: tuple[str, ...] = ()  # checkpoint tensors outside the language model
    # names that need the arch (DeepSeek's MTP modules live at model.layers.{L + k}):
    hf_name_in: object = (
        None  # (arch, checkpoint name) -> bumblebee name, "" = a copy of a shared tensor
    )
    # (arch, name with the experts split per expert, models/hf_write.py) -> checkpoint name
    hf_name_out: object = None
    # arch -> {bumblebee name: [checkpoint names]}: copies of a tensor a checkpoint stores again
    # (DeepSeek's per-MTP-module embedding and LM head), written right after it
    hf_copies: object = None
    # tensors stored under another name / layout (models/hf_stored.py ``StoredAs``: gpt-oss's
    # transposed, interleaved fused experts), read and written through the same declarations
    hf_stored: tuple = ()
    # bumblebee name ending -> transformers 5's in-memory one, beyond the fused experts
    # (rl/weight_names.py; MiniMax keeps the router bias on the MoE block, not on its gate)
    transformers_renames: dict = field(default_factory=dict)
    mtp_arch_key: str = ""  # the arch field counting MTP modules (0 when a checkpoint has none)
    router: str = ""  # the router the architecture routes with (replaces the default softmax_topk)
    # its mixers run on zigzag CP shards (every shared block does); False: parallel.cp > 1 refused
    context_parallel: bool = True
    # (kernel launches, blocking host syncs, layout) per layer per micro-batch of a training step,
    # counted in the emulated-CUDA mode (benchmarks/launches.py --part layers; skills/runtime/
    # emulated_cuda.md); the planner prints it. None: not counted for this family.
    launches_per_layer: tuple | None = None


FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    """Add ``family`` to the table (a name or model_type already taken is an error)."""
    assert family.name not in FAMILIES, f"model family {family.name!r} registered twice"
    taken = {t for f in FAMILIES.values() for t in f.hf_model_types}
    assert not taken & set(family.hf_model_types), (
        f"model_type(s) {taken & set(family.hf_model_types)} taken"
    )
    FAMILIES[family.name] = family
    return family


def family_of_model_type(model_type: str) -> Family | None:
    return next((f for f in FAMILIES.values() if model_type in f.hf_model_types), None)
