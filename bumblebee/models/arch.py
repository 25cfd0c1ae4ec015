"""Architecture hyper-parameters of the model families, keyed by Hugging Face names.

Field names follow the HF ``config.json`` of each family so that a checkpoint's
config maps in and out without a translation table. ``from_hf_dict`` tolerates
the aliases HF itself writes (``num_local_experts``, ``rope_parameters``) and
ignores keys that do not change the computation (token ids, ``use_cache``...).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from bumblebee.models.spec import ATTN, DENSE, MOE, ModelSpec


class BaseArch:
    """What every family's arch dataclass shares (its fields are HF ``config.json`` keys). The
    runtime and the planner ask an arch these questions instead of branching on its family."""

    def with_overrides(self, overrides: dict[str, Any]):
        return replace_fields(self, overrides)

    def num_params(self) -> dict[str, int]:
        """Parameter counts: total, dense and routed-expert parts."""
        return self.to_spec().num_params()

    def optional_slots(self) -> tuple[str, ...]:
        """Registry slots beyond the common ones this arch's layers use (e.g. linear_attention)."""
        return ()

    def context_parallel_error(self, cp: int, seq_len: int) -> str | None:
        """Why ``seq_len`` tokens cannot be split over ``cp`` zigzag ranks (None: they can)."""
        return None

    @classmethod
    def from_fields(cls, d: dict[str, Any]):
        """The arch of ``d``'s keys that are fields (a None value: the default), validated."""
        names = {f.name for f in dataclasses.fields(cls)}
        arch = cls(**{k: v for k, v in d.items() if k in names and v is not None})
        arch.validate()
        return arch

    def spec(self, name: str, family: str, **fields) -> ModelSpec:
        """The ``ModelSpec`` of GQA attention + MoE layers (dense where ``is_moe_layer`` says so)
        read from the names every arch answers; ``fields``: what the family has otherwise."""
        layers = self.num_hidden_layers
        common = dict(
            name=name,
            family=family,
            vocab=self.vocab_size,
            hidden=self.hidden_size,
            mixers=(ATTN,) * layers,
            mlps=tuple(MOE if self.is_moe_layer(i) else DENSE for i in range(layers)),
            n_heads=self.num_attention_heads,
            n_kv_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            attn_gate=False,
            experts=self.num_experts,
            top_k=self.num_experts_per_tok,
            expert_ffn=self.moe_intermediate_size,
            shared_ffn=0,
            dense_ffn=0,
            tied=self.tie_word_embeddings,
        )
        return ModelSpec(**{**common, **fields})


class ArchError(ValueError):
    """An architecture that cannot be built (one line: what and what would be valid)."""


_LIST_ITEMS = {"mlp_only_layers": int, "layer_types": str}  # element type of list-valued fields
_TYPE_NAMES = {
    int: "an integer",
    float: "a number",
    bool: "true or false",
    str: "a string",
    list: "a list",
}


def replace_fields(arch, overrides: dict[str, Any]):
    """``arch`` with ``overrides`` replaced (``model_type`` is fixed), validated; an unknown key
    is an ArchError listing the valid ones."""
    names = {f.name for f in dataclasses.fields(arch)} - {"model_type"}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise ArchError(f"unknown architecture key(s) {unknown}; valid: {', '.join(sorted(names))}")
    new = dataclasses.replace(arch, **overrides)
    new.validate()
    return new


# bounds no model anyone trains comes near (the largest have ~100-200 layers); a config past them
# is a typo or a crafted file, and would otherwise hang in a loop over its layers or fail in the
# allocator long after start
MAX_LAYERS = 10_000
MAX_PARAMETERS = 10**15


def check_size(arch) -> None:
    """The model's depth and a lower bound on its parameter count (the embedding plus one
    hidden x hidden projection per layer) within ``MAX_LAYERS`` / ``MAX_PARAMETERS``."""
    layers = getattr(arch, "num_hidden_layers", 0)
    if layers > MAX_LAYERS:
        raise ArchError(f"num_hidden_layers = {layers} is beyond any model (at most {MAX_LAYERS})")
    hidden, vocab = getattr(arch, "hidden_size", 0), getattr(arch, "vocab_size", 0)
    lower = vocab * hidden + layers * hidden * hidden
    if lower > MAX_PARAMETERS:
        raise ArchError(
            f"vocab_size = {vocab}, hidden_size = {hidden}, num_hidden_layers = {layers}: at least "
            f"{lower:.3g} parameters, beyond any model (at most {MAX_PARAMETERS:.0e})"
        )


def check_field_types(arch) -> None:
    """Every field holds a value of its annotated type (an int is taken for a float), so a
    string, a float size or a string for a bool names its key instead of failing deep inside."""
    for f in dataclasses.fields(arch):
        value, kind = (
            getattr(arch, f.name),
            {"int": int, "float": float, "bool": bool, "str": str, "list": list}.get(
                str(f.type), None
            ),
        )
        ok = (
            kind is None
            or (kind is float and isinstance(value, (int, float)) and not isinstance(value, bool))
            or (isinstance(value, kind) and not (kind is int and isinstance(value, bool)))
        )
        if not ok:
            raise ArchError(f"{f.name} must be {_TYPE_NAMES[kind]}, got {value!r}")
        if kind is int and not -(2**63) < value < 2**63:
            raise ArchError(f"{f.name} = {value} is beyond a 64-bit integer (|value| < 2^63)")
        if kind is float:
            if not math.isfinite(value):
                raise ArchError(f"{f.name} must be a finite number, got {value}")
            setattr(arch, f.name, float(value))
        item = _LIST_ITEMS.get(f.name)
        if item and not all(isinstance(v, item) and not isinstance(v, bool) for v in value):
            raise ArchError(
                f"{f.name} must be a list of {'integers' if item is int else 'strings'}, got {value!r}"
            )
    check_size(arch)


def check_norm_and_rope(eps: float, theta: float) -> None:
    """Values no model trains with, refused before any rank starts. ``rms_norm_eps`` is a
    stabilizer (1e-6 / 1e-5 in every Qwen and DeepSeek config): above 1e-2 it swamps the mean
    square of small activations and the norm stops normalizing. ``rope_theta`` is the base of the
    rotary frequencies theta^(-2i/d): at <= 1 they no longer fall from dimension to dimension."""
    if not 0 < eps <= 1e-2:
        raise ArchError(f"rms_norm_eps must be in (0, 0.01] (typically 1e-6), got {eps}")
    if not theta > 1:
        raise ArchError(f"rope_theta must be > 1 (typically 1e4 to 1e7), got {theta}")


def check_positive(arch, *names: str) -> None:
    for name in names:
        if getattr(arch, name) <= 0:
            raise ArchError(f"{name} must be positive, got {getattr(arch, name)}")


def check_divisible(arch, name: str, by: str) -> None:
    """Field ``name`` splits evenly into ``by`` groups (query heads over kv heads, experts over
    expert groups...)."""
    if getattr(arch, name) % getattr(arch, by):
        raise ArchError(
            f"{name} ({getattr(arch, name)}) must be divisible by {by} ({getattr(arch, by)})"
        )


def check_partial_rotary(arch) -> None:
    """The rotated dims (``head_dim x partial_rotary_factor``) are a positive even number."""
    if not 0 < arch.partial_rotary_factor <= 1 or arch.rotary_dim <= 0 or arch.rotary_dim % 2:
        raise ArchError(
            f"head_dim * partial_rotary_factor must be a positive even number, got "
            f"{arch.head_dim} * {arch.partial_rotary_factor}"
        )


def check_silu(arch) -> None:
    if arch.hidden_act != "silu":
        raise ArchError(f"hidden_act {arch.hidden_act!r} is not supported; valid: silu")


def hf_rope(d: dict[str, Any], default: dict | None = None, theta: float | None = None) -> dict:
    """HF config ``d``'s RoPE dict, a copy: ``rope_parameters``, else the older ``rope_scaling``
    (its ``type`` read as ``rope_type``), else ``default`` or {}; ``rope_type`` absent or None is
    ``default``; with ``theta``, ``rope_theta`` falls back to ``d``'s top-level key, then it."""
    rope = d.get("rope_parameters") or d.get("rope_scaling")
    rope = dict(default or {}) if rope is None else dict(rope)
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    if rope.get("rope_type") is None:
        rope["rope_type"] = "default"
    if theta is not None:
        rope.setdefault("rope_theta", d.get("rope_theta", theta))
    return rope


def check_rope_type(rope: dict, allowed: tuple[str, ...]) -> None:
    """The RoPE kind is one the family implements (``allowed``); YaRN names the context length
    its frequencies were stretched from."""
    kind = rope.get("rope_type", "default")
    if kind not in allowed:
        raise ArchError(f"rope_type {kind!r} is not supported; valid: {', '.join(allowed)}")
    if kind == "yarn" and not rope.get("original_max_position_embeddings"):
        raise ArchError("yarn rope_parameters need original_max_position_embeddings")


def flatten_rope(d: dict[str, Any], allowed: tuple[str, ...] = ("default",)) -> None:
    """For a family whose arch keeps RoPE as flat fields: HF's RoPE dict in ``d`` (checked
    against ``allowed``) sets ``rope_theta`` and ``partial_rotary_factor`` in ``d``; a top-level
    key stays only where the RoPE dict has none (older configs)."""
    rope = hf_rope(d)
    check_rope_type(rope, allowed)
    # The RoPE dict wins: it is what transformers' models read, and some transformers releases
    # (5.17) also save the config class's default as a stale top-level key beside it.
    for key in ("rope_theta", "partial_rotary_factor"):
        if key in rope:
            d[key] = rope[key]


def rope_theta_of(rope: dict, default: float) -> float:
    """``rope_theta`` of a RoPE dict (``default`` when absent): a finite number."""
    theta = rope.get("rope_theta", default)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not math.isfinite(theta):
        raise ArchError(f"rope_parameters.rope_theta must be a finite number, got {theta!r}")
    return float(theta)
