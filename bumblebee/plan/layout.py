"""Layouts and primitive choices the planner evaluates (``Layout`` is the runtime's own class,
the primitives a ``PrimitivesConfig``).

Rank order follows Megatron / torchtitan: tp innermost, then cp, then dp, then
pp (``world = tp * cp * dp * pp``). Expert parallelism folds into the ranks of
one pipeline stage (``ep`` divides ``tp * cp * dp``); each expert shard is then
replicated over ``edp = world / (pp * ep)`` expert-data-parallel ranks. An
``ep`` group is contiguous in rank order, so it stays inside one node when
``ep <= gpus_per_node``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import bumblebee.primitives  # noqa: F401  (registers every implementation, its costs and needs)
from bumblebee import registry
from bumblebee.config import ConfigError, PrimitivesConfig
from bumblebee.config_aliases import canonical
from bumblebee.config_parse import parse_override
from bumblebee.plan.spec import ModelSpec
from bumblebee.runtime.resolve import Layout  # noqa: F401  (one meaning of "layout" in bumblebee)

# the recompute policies the planner models (by name: plan/memory.py, perf_layer.py)
RECOMPUTE = ("none", "selective", "full", "offload")


def planned_choices() -> dict[str, tuple[str, ...]]:
    """Slot -> the implementations ``--set`` may fix: every registered loss, sharding and MoE
    exchange that declares its costs (primitives/{loss,sharding,moe}/costs.py), and the above."""

    def costed(slot):
        return tuple(n for n, i in registry.implementations(slot).items() if i.costs is not None)

    return {
        "sharding": costed("sharding"),
        "loss": costed("loss"),
        "recompute": RECOMPUTE,
        "moe_comm": costed("moe_comm"),
    }


def prims_label(prims: PrimitivesConfig) -> str:
    """The planned primitives in one cell: ``fsdp2 linear_ce full chunkedx2``."""
    p = prims
    label = registry.get("moe_comm", p.moe_comm).costs.label
    return f"{p.sharding} {p.loss} {p.recompute} {label(p) if label else p.moe_comm}"


def without_exchange(prims: PrimitivesConfig) -> PrimitivesConfig:
    """``prims`` with the MoE exchange that moves no tokens (what runs at ep = 1): the first
    registered one whose costs say so, when the chosen one exchanges."""
    if not registry.get("moe_comm", prims.moe_comm).costs.exchanges:
        return prims
    name = next(
        n
        for n, i in registry.implementations("moe_comm").items()
        if i.costs and not i.costs.exchanges
    )
    return dataclasses.replace(prims, moe_comm=name)


def prims_json(prims: PrimitivesConfig) -> dict:
    """The slots the planner chooses (``--json``)."""
    return {k: getattr(prims, k) for k in ("sharding", "loss", "recompute", "moe_comm")}


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What is trained (the ``train.*`` fields the planner reads): sequence length, sequences per
    optimizer step, micro-batch, balance-loss mode."""

    seq: int
    global_batch: int
    micro_batch: int = 1
    # train.balance: "auto" / "step" keep every micro-batch in flight at pp = 1
    balance: str = "auto"


# the train.* keys ``--set`` may fix in a plan (what changes memory), and how each is checked
PLANNED_TRAIN = ("balance", "micro_batch")


def split_train_overrides(items: list[str]) -> tuple[list[str], dict]:
    """``--set`` items -> (the primitives.* ones, the train.* fields they fix, checked as the
    config checks them)."""
    from bumblebee.config import Config
    from bumblebee.config_checks import validate

    rest, train = [], {}
    for item in items:
        keys, value = parse_override(item)
        if len(keys) == 2 and keys[0] == "train":
            if keys[1] not in PLANNED_TRAIN:
                raise ConfigError(
                    f"--set {item!r}: the planner takes primitives.KEY=VALUE and train.KEY=VALUE "
                    f"for KEY in {', '.join(PLANNED_TRAIN)}"
                )
            train[keys[1]] = value
        else:
            rest.append(item)
    if train:
        cfg = Config()
        for key, value in train.items():
            setattr(cfg.train, key, value)
        validate(cfg)  # one line per bad value, as `bumblebee train` says it
    return rest, train


def parse_layout(text: str, gpus: int) -> Layout:
    """``"tp=1 pp=2 ep=8 cp=4"`` (comma or space separated; dp derived if absent)."""
    values: dict[str, int] = {}
    for item in text.replace(",", " ").split():
        key, sep, raw = item.partition("=")
        key = key.strip().lower()
        key = "dp_shard" if key == "dp" else key  # dp: the runtime's dp_shard
        if not sep or key not in ("tp", "pp", "ep", "cp", "dp_shard"):
            raise ConfigError(f'--layout: bad item {item!r}; expected e.g. "tp=1 pp=2 ep=8 cp=4"')
        if key in values:
            raise ConfigError(
                f"--layout: {key} is given twice ({text!r}); give each of tp, pp, ep, cp, dp once"
            )
        try:
            values[key] = int(raw)
        except ValueError:
            raise ConfigError(f"--layout: {key} must be an integer, got {raw!r}") from None
        if values[key] < 1:
            raise ConfigError(f"--layout: {key} must be >= 1, got {values[key]}")
    if not values:
        raise ConfigError('--layout: empty; expected e.g. "tp=1 pp=2 ep=8 cp=4"')
    inner = values.get("tp", 1) * values.get("pp", 1) * values.get("cp", 1)
    if gpus % inner:
        raise ConfigError(f"--layout: tp*pp*cp = {inner} does not divide --gpus {gpus}")
    dp = values.get("dp_shard", gpus // inner)
    if inner * dp != gpus:
        raise ConfigError(f"--layout: tp*pp*cp*dp = {inner * dp} != --gpus {gpus}")
    return Layout(
        tp=values.get("tp", 1),
        pp=values.get("pp", 1),
        ep=values.get("ep", 1),
        cp=values.get("cp", 1),
        dp_shard=dp,
    )


def apply_overrides(prims: PrimitivesConfig, items: list[str]) -> tuple[PrimitivesConfig, set[str]]:
    """``--set primitives.loss=ce`` ... -> (primitives, names of the fixed fields)."""
    changes: dict = {}
    choices = planned_choices()
    for item in items:
        keys, value = parse_override(item)
        if len(keys) != 2 or keys[0] != "primitives":
            raise ConfigError(
                f"--set {item!r}: the planner takes primitives.KEY=VALUE "
                f"(KEY: {', '.join([*choices, 'moe_chunks', 'dsa_block', 'dsa_stage'])})"
            )
        key, value = canonical("primitives", keys[1], value)
        if key in ("moe_chunks", "dsa_block"):  # dsa_block: DSA's query block (its buffers)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"--set {item!r}: {key} must be a positive integer")
        elif key == "dsa_stage":  # DSA's training stage (its block's buffers differ)
            if value not in ("sparse", "dense_warmup"):
                raise ConfigError(f"--set {item!r}: dsa_stage must be sparse or dense_warmup")
        elif key in choices:
            if value not in choices[key]:
                raise ConfigError(f"--set {item!r}: {key} must be one of {', '.join(choices[key])}")
        else:
            raise ConfigError(
                f"--set {item!r}: unknown planner primitive {key!r}; "
                f"valid: {', '.join([*choices, 'moe_chunks', 'dsa_block', 'dsa_stage'])}"
            )
        changes[key] = value
    return dataclasses.replace(prims, **changes), set(changes)


def check(
    spec: ModelSpec, layout: Layout, prims: PrimitivesConfig, work: Workload, gpus: int
) -> str:
    """Why this configuration cannot run at all ('' if it can). Memory is checked elsewhere."""
    lay = layout
    if lay.world != gpus:
        return f"tp*pp*cp*dp = {lay.world} != {gpus} GPUs"
    if (lay.tp * lay.cp * lay.dp_shard) % lay.ep:
        return f"ep={lay.ep} must divide tp*cp*dp = {lay.tp * lay.cp * lay.dp_shard} (the ranks of one stage)"
    if spec.experts % lay.ep:
        return f"ep={lay.ep} must divide num_experts={spec.experts}"
    if lay.pp > spec.layers:
        return f"pp={lay.pp} exceeds {spec.layers} layers"
    heads = [spec.n_heads] + ([spec.gdn_v_heads, spec.gdn_k_heads] if spec.gdn_v_heads else [])
    if any(h % lay.tp for h in heads):
        return f"tp={lay.tp} must divide the head counts {heads}"
    if work.seq % (2 * lay.cp * lay.tp) and (lay.cp > 1 or lay.tp > 1):
        return f"seq {work.seq} must be divisible by 2*cp*tp = {2 * lay.cp * lay.tp} (load-balanced shards)"
    if work.global_batch % (lay.dp_shard * work.micro_batch):
        return f"global batch {work.global_batch} not divisible by dp*micro_batch = {lay.dp_shard * work.micro_batch}"
    # what the chosen implementations declare they need, as the launch checks it, and the
    # planner's own preferences among them (registry.Need.plan_only)
    facts = registry.RunFacts(
        prims=prims,
        moe_bias=spec.moe_bias,
        world=gpus,
        ep=lay.ep,
        pp=lay.pp,
        cp=lay.cp,
        micro_batches=work.global_batch // (lay.dp_shard * work.micro_batch),
        planning=True,
    )
    unmet = registry.unmet(facts)
    return unmet[0] if unmet else ""


def fallback(
    spec: ModelSpec, layout: Layout, prims: PrimitivesConfig, work: Workload
) -> PrimitivesConfig:
    """``prims`` for a comparison the recipe prints: where its MoE exchange's needs are not met
    (``check``), that exchange's declared baseline instead (``MoeCommCosts.baseline``)."""
    base = registry.get("moe_comm", prims.moe_comm).costs.baseline
    if base and check(spec, layout, prims, work, layout.world):
        return dataclasses.replace(prims, moe_comm=base)
    return prims
