"""Model families composed from primitives, looked up through one family table (``family.py``).

``resolve_arch`` turns a ``[model]`` section into an architecture, ``build_model`` builds
the family's ``CausalLM`` (models/base.py), ``arch_from_hf_dict`` reads a Hugging Face
``config.json`` of any registered family.
"""

from __future__ import annotations

import os

import torch

from bumblebee.errors import ConfigError

# one line per family: importing its folder registers it (models/family.py); the order is the
# order errors and listings name them in
# isort: off
from bumblebee.models import qwen3_moe  # noqa: F401
from bumblebee.models import qwen3_5_moe  # noqa: F401
from bumblebee.models import deepseek_v3  # noqa: F401
from bumblebee.models import qwen3_next  # noqa: F401
from bumblebee.models import glm4_moe  # noqa: F401
from bumblebee.models import minimax_m2  # noqa: F401
from bumblebee.models import kimi_linear  # noqa: F401
from bumblebee.models import gpt_oss  # noqa: F401
from bumblebee.models import deepseek_v32  # noqa: F401
from bumblebee.models import glm_moe_dsa  # noqa: F401

# isort: on
from bumblebee.models.arch import ArchError
from bumblebee.models.family import FAMILIES, Family, family_of_model_type
from bumblebee.models.hf_config import read_hf_config
from bumblebee.models.mtp_names import without_absent_mtp


def family_of(arch) -> Family:
    return family_of_model_type(arch.model_type)


# keys a Hugging Face config.json must state (a default would silently build another model)
REQUIRED_HF_KEYS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "moe_intermediate_size",
    "num_experts_per_tok",
)
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def arch_from_hf_dict(d: dict):
    """The architecture of a Hugging Face config dict (any registered family)."""
    if not isinstance(d, dict):
        raise ConfigError(f"a model config must be a JSON object, got {type(d).__name__}")
    model_type = d.get("model_type")
    family = family_of_model_type(model_type)
    if family is None:
        valid = [t for f in FAMILIES.values() for t in f.hf_model_types]
        raise ConfigError(f"unsupported model_type {model_type!r}; valid: {', '.join(valid)}")
    text = d.get("text_config") if isinstance(d.get("text_config"), dict) else d
    # a family whose config names a size otherwise states its own list (arch.REQUIRED_HF_KEYS)
    required = getattr(family.arch, "REQUIRED_HF_KEYS", REQUIRED_HF_KEYS)
    missing = [k for k in required if text.get(k) is None]
    if all(text.get(k) is None for k in EXPERT_COUNT_KEYS):
        missing.append("num_experts")
    if missing:
        raise ConfigError(f"invalid {model_type} config: missing {', '.join(missing)}")
    try:
        return family.arch.from_hf_dict(d)
    except (ArchError, TypeError) as e:
        raise ConfigError(f"invalid {model_type} config: {e}") from None


def resolve_arch(model_cfg):
    """The architecture a ``[model]`` section describes (preset or HF dir, plus overrides)."""
    family = FAMILIES.get(model_cfg.name)
    if family is None:
        raise ConfigError(f"unknown model.name {model_cfg.name!r}; valid: {', '.join(FAMILIES)}")
    if model_cfg.hf_path:
        path = os.path.join(model_cfg.hf_path, "config.json")
        if not os.path.isfile(path):
            raise ConfigError(f"model.hf_path: no config.json in {model_cfg.hf_path}")
        try:
            arch = arch_from_hf_dict(read_hf_config(path))
        except ConfigError as e:
            where = "" if str(e).startswith(path) else f"{path}: "
            raise ConfigError(f"model.hf_path: {where}{e}") from None
        from bumblebee.models.hf_read import checkpoint_block_size

        try:  # a quantization we cannot read is refused before any rank starts
            checkpoint_block_size(model_cfg.hf_path)
        except ConfigError as e:
            raise ConfigError(f"model.hf_path: {e}") from None
        arch = without_absent_mtp(arch, model_cfg.hf_path)
    else:
        if model_cfg.preset not in family.presets:
            raise ConfigError(
                f"unknown {model_cfg.name} preset {model_cfg.preset!r}; "
                f"valid: {', '.join(family.presets)}"
            )
        arch = arch_from_hf_dict(dict(family.presets[model_cfg.preset]))
    try:
        return arch.with_overrides(model_cfg.arch) if model_cfg.arch else arch
    except (ArchError, TypeError) as e:
        raise ConfigError(f"model.arch: {e}") from None


def build_model(
    arch,
    prims=None,
    groups=None,
    *,
    device=None,
    seed: int | None = None,
    lora=None,
    train_dtype: str = "float32",
):
    """A model of ``arch``'s family with the chosen primitives; ``groups``
    (``primitives.parallel.ParallelState``) when it is split over ranks. Initialized from
    ``seed`` (None: drawn from torch's global generator), identically for every layout; with
    ``device="meta"`` nothing is allocated: split it (pipeline stage, sharding) and then
    ``materialize`` it, so a rank only ever holds its share. ``lora``: a ``LoraConfig``
    (adapters, frozen base: models/lora.py), the base dtype following ``train_dtype``."""
    from bumblebee.models.lora import add_lora

    cls = family_of(arch).model
    if device is not None and torch.device(device).type == "meta":
        with torch.device("meta"):
            model = cls(arch, prims, groups)
            return model if lora is None else add_lora(model, lora, train_dtype)
    model = cls(arch, prims, groups)  # built on the CPU, not initialized yet: see CausalLM.__init__
    if lora is not None:
        add_lora(model, lora, train_dtype)
    model.reset_parameters(seed=seed)
    return model if device is None else model.to(device)


@torch.no_grad()
def materialize(
    model,
    device,
    *,
    seed: int | None = None,
    hf_path: str = "",
    dtype=None,
    init_on_device: bool = False,
):
    """Give a model built on the meta device (and possibly split since: a pipeline stage, an
    expert slice, FSDP2 shards) memory on ``device`` for its own share only, then fill it in
    place: from the Hugging Face checkpoint at ``hf_path`` (each rank reads only its slices,
    models/hf.py), else the layout-independent random init of ``seed`` (drawn on ``device``
    with ``init_on_device``, on the CPU otherwise)."""
    if dtype is not None:
        model.to(dtype)
    model.to_empty(device=device)
    for b in model.buffers():
        if b.is_floating_point():
            b.zero_()
    if hf_path:
        from bumblebee.models.hf_read import load_hf_weights

        load_hf_weights(model, hf_path)
        if getattr(model, "lora_info", None) is not None:  # adapters are not in the checkpoint
            from bumblebee.models.lora import is_lora_name

            model.reset_parameters(seed=seed, only=is_lora_name, on_device=init_on_device)
    else:
        model.reset_parameters(seed=seed, on_device=init_on_device)
    return model
