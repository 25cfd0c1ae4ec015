"""Primitive registry: slot -> {implementation name: factory}.

A *slot* is one replaceable capability (the loss, the expert FFN, the MoE
communication, ...). Each slot has exactly one *reference* implementation: the
obviously-correct one every optimized implementation is paired against.
Implementations register themselves at import time with ``@register``; the
config names them (``[primitives] loss = "ce"``) and the model resolves the
name with ``get``. An implementation may also declare facts about itself next to its code
(``costs``: what the planner needs to count its memory and time, plan/memory.py) and its
contract (``needs``: what it requires of the run; ``options``: the ``primitives.*`` keys only it
reads; ``paired``: it runs micro-batches two at a time), which the launch checks and the planner
evaluate without knowing its name (``unmet``). The registry holds factories and such facts only,
never state. It is a leaf:
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


@dataclass(frozen=True, kw_only=True)
class RunFacts:
    """What a contract is evaluated against: the run as far as it is resolved. Without a layout
    (``world`` None) only the needs that read no layout are evaluated (the config's check)."""

    prims: Any  # the run's PrimitivesConfig
    # the model's experts have biases (and a GLU other than SwiGLU); None: no model resolved yet
    moe_bias: bool | None = None
    world: int | None = None  # ranks; None: no layout yet
    ep: int = 1
    pp: int = 1
    cp: int = 1
    micro_batches: int | None = None  # per rank and step; None: not known (the planner's search)
    planning: bool = False  # the planner asks: its preferences (``Need.plan_only``) apply too


@dataclass(frozen=True)
class Need:
    """One requirement of an implementation: it runs where ``ok(facts)`` holds. ``why``
    completes "primitives.<slot> = '<name>' needs ...", formatted with the facts' fields
    (``{world}``, ``{prims.moe_chunks}``, ...). ``layout``: reads the layout, so the launch checks
    it once a world size is known; ``plan_only``: a planning preference (what the planner prices),
    not a refusal at launch."""

    why: str
    ok: Callable[[RunFacts], bool]
    layout: bool = True
    plan_only: bool = False


@dataclass(frozen=True)
class Impl:
    slot: str
    name: str
    factory: Callable[..., Any]
    reference: bool
    summary: str
    costs: Any = None  # the slot's cost facts (loss: primitives/loss/costs.LossCosts) or None
    needs: tuple[Need, ...] = ()
    # primitives.* keys only this implementation reads: set with another one, they are refused
    options: tuple[str, ...] = ()
    # micro-batches run two at a time, each one's exchanges under the other's compute
    # (the step protocol: runtime/step.py run_micro_batches)
    paired: bool = False
    # the kernel it runs where (primitives/kernel_choice.KernelQuery -> Kernel); None: its own
    # PyTorch code everywhere. ``kernel_axes``: what that choice depends on ("fla", "fa3",
    # "sinks"), the rows `bumblebee primitives` prints
    kernel: Callable[[Any], Any] | None = None
    kernel_axes: tuple[str, ...] = ()


_IMPLS: dict[str, dict[str, Impl]] = {slot: {} for slot in SLOTS}


def register(
    slot: str,
    name: str,
    *,
    reference: bool = False,
    summary: str = "",
    costs: Any = None,
    needs: tuple[Need, ...] = (),
    options: tuple[str, ...] = (),
    paired: bool = False,
    kernel: Callable[[Any], Any] | None = None,
    kernel_axes: tuple[str, ...] = (),
):
    """Decorator: register ``factory`` as implementation ``name`` of ``slot``, with the facts it
    declares about itself (see ``Impl``)."""
    assert slot in SLOTS, f"unknown slot {slot!r}"

    def deco(factory):
        impls = _IMPLS[slot]
        assert name not in impls, f"{slot}/{name} registered twice"
        assert not (reference and any(i.reference for i in impls.values())), (
            f"slot {slot} has two references"
        )
        doc = (factory.__doc__ or "").strip().splitlines()
        summary_ = summary or (doc[0] if doc else "")
        impls[name] = Impl(
            slot,
            name,
            factory,
            reference,
            summary_,
            costs,
            tuple(needs),
            tuple(options),
            paired,
            kernel,
            tuple(kernel_axes),
        )
        return factory

    return deco


def unregister(slot: str, name: str) -> None:
    """Remove ``slot``/``name`` (an implementation registered for a test or an experiment)."""
    _IMPLS[slot].pop(name, None)


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


def chosen(prims) -> list[Impl]:
    """The registered implementation each slot of ``prims`` names (slots with none: skipped)."""
    out = []
    for slot in SLOTS:
        impl = _IMPLS[slot].get(getattr(prims, slot, None))
        if impl is not None:
            out.append(impl)
    return out


def unmet(facts: RunFacts, defaults: Any = None) -> list[str]:
    """One line per need of a chosen implementation that ``facts`` does not meet, and per
    option set (differing from ``defaults``, a PrimitivesConfig) that no chosen implementation
    reads. Without a layout (``facts.world`` None) the needs that read one are left for later;
    the planner's preferences count only when it asks."""
    lines, read = [], set()
    for impl in chosen(facts.prims):
        read.update(impl.options)
        for need in impl.needs:
            if (need.layout and facts.world is None) or (need.plan_only and not facts.planning):
                continue
            if not need.ok(facts):
                why = need.why.format(**vars(facts))
                lines.append(f"primitives.{impl.slot} = {impl.name!r} needs {why}")
    if defaults is not None:
        readers: dict[str, list[Impl]] = {}
        for slot in SLOTS:
            for impl in _IMPLS[slot].values():
                for key in impl.options:
                    readers.setdefault(key, []).append(impl)
        for key, impls in readers.items():
            value = getattr(facts.prims, key)
            if key not in read and value != getattr(defaults, key):
                wanted = " or ".join(f"{i.slot} = {i.name!r}" for i in impls)
                got = ", ".join(f"{getattr(facts.prims, i.slot)!r}" for i in impls)
                lines.append(f"primitives.{key} = {value} needs {wanted} (got {got})")
    return lines


def paired(prims) -> bool:
    """A chosen implementation runs micro-batches two at a time (``Impl.paired``)."""
    return any(impl.paired for impl in chosen(prims))


def validate_choices(prims) -> None:
    """Check every ``[primitives]`` choice names a registered implementation.
    Slots with nothing registered yet are checked where they are used."""
    for slot in SLOTS:
        choice = getattr(prims, slot)
        if implementations(slot):
            get(slot, choice)
