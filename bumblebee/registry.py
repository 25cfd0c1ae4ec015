"""Primitive registry: slot -> {implementation name: factory}.

A *slot* is one replaceable capability (the loss, the expert FFN, the MoE
communication, ...). Each slot has exactly one *reference* implementation: the
obviously-correct one every optimized implementation is paired against.
Implementations register themselves at import time with ``@register``; the
config names them (``[primitives] loss = "ce"``) and the model resolves the
name with ``get``. An implementation may also declare facts about itself next to its code
(``costs``: what the planner needs to count its memory and time, plan/memory.py).
The registry holds factories and such facts only, never state. It is a leaf:
importing ``bumblebee.primitives`` (or any module under it) registers every
implementation, so whoever looks names up has imported them already.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bumblebee.errors import ConfigError

# slot -> one-line description; the order is the order `bumblebee primitives` prints.
SLOTS: dict[str, str] = {
    "attention": "causal attention core over packed documents (q, k, v -> o)",
    "cp_attention": "context-parallel attention across ranks",
    "linear_attention": "Gated DeltaNet linear attention",
    "router": "token -> top-k experts and weights",
    "experts": "expert FFN over tokens grouped by expert",
    "moe_comm": "token dispatch/combine between router and experts",
    "loss": "LM head + cross-entropy",
    "sharding": "parameter / gradient / optimizer-state sharding",
    "recompute": "activation recomputation policy",
    "pipeline": "pipeline-parallel schedule",
}


@dataclass(frozen=True)
class Impl:
    slot: str
    name: str
    factory: Callable[..., Any]
    reference: bool
    summary: str
    costs: Any = None  # the slot's cost facts (loss: primitives/loss/costs.LossCosts) or None


_IMPLS: dict[str, dict[str, Impl]] = {slot: {} for slot in SLOTS}


def register(
    slot: str, name: str, *, reference: bool = False, summary: str = "", costs: Any = None
):
    """Decorator: register ``factory`` as implementation ``name`` of ``slot``."""
    assert slot in SLOTS, f"unknown slot {slot!r}"

    def deco(factory):
        impls = _IMPLS[slot]
        assert name not in impls, f"{slot}/{name} registered twice"
        assert not (reference and any(i.reference for i in impls.values())), (
            f"slot {slot} has two references"
        )
        doc = (factory.__doc__ or "").strip().splitlines()
        summary_ = summary or (doc[0] if doc else "")
        impls[name] = Impl(slot, name, factory, reference, summary_, costs)
        return factory

    return deco


def implementations(slot: str) -> dict[str, Impl]:
    return dict(_IMPLS[slot])


def get(slot: str, name: str) -> Impl:
    impls = implementations(slot)
    if name not in impls:
        valid = ", ".join(impls) or "none implemented yet"
        raise ConfigError(f"unknown {slot} implementation {name!r}; valid: {valid}")
    return impls[name]


def reference(slot: str) -> str | None:
    for impl in implementations(slot).values():
        if impl.reference:
            return impl.name
    return None


def validate_choices(prims) -> None:
    """Check every ``[primitives]`` choice names a registered implementation.
    Slots with nothing registered yet are checked where they are used."""
    for slot in SLOTS:
        choice = getattr(prims, slot)
        if implementations(slot):
            get(slot, choice)
