"""``bumblebee pair``: two runs that differ only in one primitive slot, compared step by step.

A primitive is trusted because it can be swapped for its reference and compared
in one command. ``pair`` loads the config twice (the same file and ``--set``
overrides, plus optional per-side ``--set-a`` / ``--set-b``), sets the slot to
``--a`` on one side and ``--b`` on the other, prints the config diff, and
refuses (exit 2) when anything but the slot and its companion keys differs.
Both runs then use the same seed (so the same initial weights, which are
checked by hash) and the same data stream, in deterministic mode unless
``--nondeterministic``. ``pair_run`` runs them; this module builds and checks
the two configs, holds the tolerance table, prints the table and the verdict.

Compared per step (rows of the table): the loss and the gradient norm of the
step; from a no-grad probe forward on the step's first micro-batch (same
weights as the step, outside the timed and measured region) the per-token
log-probs of the labels and the outputs of a few modules hooked by name; the
step's peak live memory (the trainer's ``MemoryTracker``, most loaded rank) and
step time, with the ratio b/a. After the last step, the weights.

Slot-specific setup is generic over the registry with three small tables:
``COMPANION_KEYS`` (keys that may differ with the slot), ``slot_families`` (a
slot only some model families use: a preset run switches to one), ``SLOT_AXIS`` (a
slot only used when a parallel axis is > 1: it is set to ``--nproc``).

Difference measures: ``max|a-b|`` (the a / b columns of a tensor show
``max|x|``) and the norm-wise ``rel = ||a-b|| / max(||a||, ||b||)`` (L2 over all
elements of all ranks, all parameters for the weights; for scalars
``|a-b| / max(|a|, |b|)``). The norm-wise measure is the one checked: a single
token routed to another expert after a tiny change moves ``max|a-b|`` a lot and
the norm little. ``bits`` says whether the SHA-256 of the two tensors' bytes
agree. A run passes when every compared quantity has
``rel <= TOLERANCES[slot][dtype]``; memory and time are reported, never checked.
Exit codes: 0 pass, 1 a difference above tolerance (or a failed rank), 2 bad input.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
from typing import IO, Any

from bumblebee import registry, safe_write
from bumblebee.config import Config, ConfigError, validate
from bumblebee.config_aliases import canonical_key
from bumblebee.config_parse import parse_override
from bumblebee.runtime.metrics import strict
from bumblebee.runtime.resolve import load_config, validate_run

# Relative tolerance per slot: (float32, bfloat16) runs, applied to every compared quantity
# over a few steps of the tiny models. fp32 budgets cover reassociation (different summation
# order, tiling, fp32 vs fp64 accumulation) as it propagates through a few Adam steps; bf16
# budgets cover bf16 rounding at different places (e.g. a GEMM output rounded before vs after
# a reduction). 0.0 would demand bit-identical results. bf16 differences grow with the steps
# (Adam turns bf16 gradient noise into weight differences of the order of the learning rate):
# pair a few steps (default 3), not a training run.
TOLERANCES: dict[str, tuple[float, float]] = {
    "attention": (1e-4, 5e-2),  # masked SDPA vs per-document SDPA: different kernels/blocking
    "cp_attention": (
        1e-4,
        5e-2,
    ),  # all-gathered masked SDPA vs ring blocks with an online log-sum-exp merge
    "linear_attention": (
        1e-4,
        5e-2,
    ),  # token recurrence vs WY/UT chunks: a triangular solve per chunk
    "router": (1e-5, 2e-2),
    "experts": (1e-4, 5e-2),  # per-expert matmuls vs grouped GEMM
    "moe_comm": (1e-4, 5e-2),  # same expert math; the exchange may reorder rows and sums
    "loss": (1e-4, 5e-2),  # materialized logits vs tiles merged with an online log-sum-exp
    "sharding": (1e-4, 5e-2),  # gradient reductions in a different order / dtype
    "recompute": (1e-6, 1e-3),  # the same ops recomputed: bit-identical in deterministic mode
    "pipeline": (1e-4, 5e-2),  # micro-batch order of the gradient accumulation
}
DEFAULT_TOLERANCE = (1e-4, 5e-2)  # a slot added to the registry without an entry here

# Keys a pair may set differently besides ``primitives.<slot>``: options of one implementation,
# and parallel.ep for moe_comm, whose reference (local) cannot run at ep > 1 -- the runtime keeps
# the loss trace invariant under layout changes, so local at ep = 1 is the baseline of an exchange.
COMPANION_KEYS: dict[str, tuple[str, ...]] = {
    "recompute": ("primitives.recompute_modules",),
    "moe_comm": ("primitives.moe_chunks", "parallel.ep"),
    "pipeline": (
        "primitives.pp_virtual_stages",
        "primitives.pp_layout",
    ),  # interleaved: v stages per rank
}

# Slots used only when a parallel axis is > 1: pairing them sets the axis to --nproc if it is 1.
SLOT_AXIS: dict[str, str] = {"cp_attention": "cp", "pipeline": "pp"}


def slot_families(slot: str) -> list[str]:
    """Families whose tiny preset uses ``slot`` when only some do (``BaseArch.optional_slots``):
    pairing such a slot switches a preset-based run to the first of them."""
    from bumblebee.models import FAMILIES, arch_from_hf_dict

    return [
        f.name
        for f in FAMILIES.values()
        if "tiny" in f.presets
        and slot in arch_from_hf_dict(dict(f.presets["tiny"])).optional_slots()
    ]


def tolerance(slot: str, dtype: str) -> float:
    fp32, bf16 = TOLERANCES.get(slot, DEFAULT_TOLERANCE)
    return fp32 if dtype == "float32" else bf16


def pairable_slots() -> list[str]:
    return [s for s in registry.SLOTS if len(registry.implementations(s)) >= 2]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The pair-specific options (the CLI adds --config and --set)."""
    p.add_argument(
        "--slot", required=True, help="the primitive slot to pair (see `bumblebee primitives`)"
    )
    p.add_argument(
        "--a",
        required=True,
        metavar="IMPL",
        help="implementation of side a (usually the reference)",
    )
    p.add_argument("--b", required=True, metavar="IMPL", help="implementation of side b")
    p.add_argument(
        "--steps", type=int, default=3, metavar="N", help="optimizer steps per side (default 3)"
    )
    p.add_argument(
        "--nproc", type=int, default=1, metavar="N", help="local ranks for both runs (default 1)"
    )
    p.add_argument(
        "--set-a",
        dest="set_a",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a value on side a only (only the slot's own options may differ)",
    )
    p.add_argument(
        "--set-b",
        dest="set_b",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a value on side b only",
    )
    p.add_argument(
        "--hook",
        dest="hooks",
        action="append",
        default=[],
        metavar="MODULE",
        help="module whose output to compare, e.g. model.layers.0 (repeatable; default: "
        "first, middle and last decoder layer and model.norm)",
    )
    p.add_argument(
        "--nondeterministic",
        action="store_true",
        help="keep train.deterministic as configured (default: deterministic on both sides)",
    )
    p.add_argument(
        "--json", metavar="OUT", help="write the config diff, the table and the verdict as JSON"
    )


# ------------------------------------------------------------------------------ the two configs
def _flatten(cfg: Config) -> dict[str, Any]:
    flat = {}
    for section, values in cfg.to_dict().items():
        for key, value in values.items():
            if section == "model" and key == "arch":
                flat.update({f"model.arch.{k}": v for k, v in value.items()})
            else:
                flat[f"{section}.{key}"] = value
    return flat


def config_diff(cfg_a: Config, cfg_b: Config) -> list[tuple[str, Any, Any]]:
    """(key, value in a, value in b) for every key whose values differ ("<unset>" if absent)."""
    fa, fb = _flatten(cfg_a), _flatten(cfg_b)
    keys = sorted(set(fa) | set(fb))
    return [
        (k, fa.get(k, "<unset>"), fb.get(k, "<unset>"))
        for k in keys
        if fa.get(k, "<unset>") != fb.get(k, "<unset>")
    ]


def check_diff(diff: list[tuple[str, Any, Any]], slot: str) -> None:
    allowed = {f"primitives.{slot}", *COMPANION_KEYS.get(slot, ())}
    extra = [k for k, _, _ in diff if k not in allowed]
    if extra:
        raise ConfigError(
            f"the two runs differ in {', '.join(extra)} besides primitives.{slot}; a pair may differ "
            f"only in: {', '.join(sorted(allowed))}"
        )


def _side_overrides(items: list[str], slot: str, flag: str) -> list[str]:
    for item in items:
        keys, _ = parse_override(item)
        if keys == ["primitives", slot]:
            raise ConfigError(f"{flag} {item!r}: choose the implementation with --a / --b")
    return items


def _prepare_slot(cfg: Config, slot: str, nproc: int, notes: list[str]) -> None:
    """What the slot needs to be exercised at all (applied to both sides alike)."""
    users = slot_families(slot)
    family = users[0] if users else None
    if family and cfg.model.name not in users:
        if cfg.model.hf_path:
            raise ConfigError(
                f"slot {slot} is only used by model.name = {family!r}, but model.hf_path is a "
                f"{cfg.model.name} checkpoint; use a {family} checkpoint or preset"
            )
        notes.append(
            f"slot {slot} is only used by {family}: model.name set to {family!r} on both sides"
        )
        cfg.model.name = family
    axis = SLOT_AXIS.get(slot)
    if axis:
        if nproc < 2:
            raise ConfigError(
                f"slot {slot} runs across ranks: pass --nproc N with N >= 2 "
                f"(parallel.{axis} is set to N unless configured)"
            )
        if getattr(cfg.parallel, axis) == 1:
            setattr(cfg.parallel, axis, nproc)
            notes.append(
                f"parallel.{axis} set to {nproc} on both sides (the {slot} slot is unused at {axis} = 1)"
            )


def _coverage_notes(cfg_a: Config, cfg_b: Config, slot: str, nproc: int) -> list[str]:
    """What this configuration leaves unexercised (the pair still runs)."""
    notes = []
    if slot == "sharding" and nproc == 1:
        notes.append(
            "one process: every sharding reduces to a single optimizer (pair fsdp2/zero1 with --nproc 2)"
        )
    if slot == "moe_comm" and cfg_a.parallel.ep == cfg_b.parallel.ep == 1:
        notes.append(
            "parallel.ep = 1: the dispatch runs without communication "
            "(e.g. --nproc 2 --set-b parallel.ep=2 against local, or --set parallel.ep=2)"
        )
    if cfg_a.parallel.pp > 1:
        notes.append(
            "parallel.pp > 1: ranks hold pipeline stages, so no probe forward (no log-prob or hooked rows)"
        )
    return notes


def build_pair(args) -> tuple[Config, Config, list[str]]:
    """The two validated configs and notes about what was adjusted for the slot."""
    # a slot is named as its primitives key, old spellings included; the rest of the run reads args
    slot = args.slot = canonical_key("primitives", args.slot)
    if slot not in registry.SLOTS:
        raise ConfigError(
            f"unknown slot {slot!r}; slots that can be paired: {', '.join(pairable_slots())}"
        )
    impls = registry.implementations(slot)
    if len(impls) < 2:
        have = ", ".join(impls) or "none"
        raise ConfigError(
            f"slot {slot} has {len(impls)} implementation(s) ({have}): nothing to pair; "
            f"slots that can be paired: {', '.join(pairable_slots())}"
        )
    registry.get(slot, args.a)
    registry.get(slot, args.b)
    if args.steps < 1 or args.nproc < 1:
        raise ConfigError(f"--steps and --nproc must be >= 1, got {args.steps} and {args.nproc}")
    notes: list[str] = []
    sides = []
    for impl, extra, flag in ((args.a, args.set_a, "--set-a"), (args.b, args.set_b, "--set-b")):
        cfg = load_config(args.config, args.overrides + _side_overrides(extra, slot, flag))
        setattr(cfg.primitives, slot, impl)
        cfg.train.steps = args.steps
        if not args.nondeterministic:
            cfg.train.deterministic = True
        _prepare_slot(cfg, slot, args.nproc, notes if not sides else [])
        validate(cfg)
        validate_run(cfg)
        sides.append(cfg)
    notes += _coverage_notes(sides[0], sides[1], slot, args.nproc)
    if args.a == args.b:
        notes.append("a and b are the same implementation: a determinism check")
    return sides[0], sides[1], notes


def set_out_dirs(cfg_a: Config, cfg_b: Config, slot: str) -> None:
    """Each side writes its own metrics.jsonl (bookkeeping: not part of the diff)."""
    base = os.path.join(cfg_a.train.out_dir, f"pair-{slot}")
    cfg_a.train.out_dir = os.path.join(base, f"a-{getattr(cfg_a.primitives, slot)}")
    cfg_b.train.out_dir = os.path.join(base, f"b-{getattr(cfg_b.primitives, slot)}")


# ------------------------------------------------------------------------------ the command
def run(args, stream: IO | None = None) -> int:
    """``bumblebee pair``: returns the exit code (0 pass, 1 above tolerance or a rank failed)."""
    from bumblebee.runtime.launch import launcher as launch
    from bumblebee.runtime.pair import run as pair_run
    from bumblebee.runtime.resolve import check_run

    torchrun = launch.started_by_torchrun()
    rank0 = not torchrun or os.environ.get("RANK", "0") == "0"
    if args.json:  # before the runs: a directory or an unwritable place is one line now
        from bumblebee.outputs import check_target

        check_target(args.json, "--json", kind="file")
    out = (stream or sys.stdout) if rank0 else io.StringIO()
    cfg_a, cfg_b, notes = build_pair(args)
    diff = config_diff(cfg_a, cfg_b)
    out.write(f"config diff (a -> b):{' none' if not diff else ''}\n")
    for key, va, vb in diff:
        out.write(f"  {key}: {json.dumps(va)} -> {json.dumps(vb)}\n")
    out.flush()
    check_diff(diff, args.slot)
    for note in notes:
        out.write(f"note: {note}\n")
    out.flush()
    set_out_dirs(cfg_a, cfg_b, args.slot)
    probe = cfg_a.parallel.pp == 1
    if args.hooks and not probe:
        raise ConfigError(
            "--hook needs parallel.pp = 1 (with pipeline stages no rank holds the whole model)"
        )
    hooks = pair_run.hook_names(cfg_a, args.hooks) if probe else []
    job = pair_run.PairJob(
        slot=args.slot,
        a=args.a,
        b=args.b,
        cfg_a=cfg_a,
        cfg_b=cfg_b,
        hooks=hooks,
        probe=probe,
        rtol=tolerance(args.slot, cfg_a.train.dtype),
        diff=diff,
        notes=notes,
        nproc=args.nproc,
    )
    if torchrun:
        launch.init_distributed()
        result = pair_run.execute(job, out)
    else:
        check_run(cfg_a, args.nproc)  # reject impossible layouts before any process starts
        check_run(cfg_b, args.nproc)
        if args.nproc == 1:
            result = pair_run.execute(job, out)
        else:
            result = pair_run.launch(job)
            if result is None:
                return 1
    if args.json and rank0:
        safe_write.write_file(
            args.json,
            json.dumps(strict(result), indent=1, allow_nan=False),  # a diverged side is null
            doing="write the result",
        )
    return 0 if result["passed"] else 1
