"""``bumblebee plan``: argument parsing and the run function.

``add_arguments(parser)`` and ``run(args) -> int`` are what the top-level CLI
wires in; ``main`` (and ``python -m bumblebee.plan``) runs the planner alone.
Bad input raises ``ConfigError`` (one line, exit code 2 through ``main``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys

import bumblebee.outputs as outputs
from bumblebee.config import ConfigError, PrimitivesConfig
from bumblebee.console import Progress, SetOverride
from bumblebee.plan import report
from bumblebee.plan.chunks import ChunkChoice, choose, run_skew
from bumblebee.plan.cp_rules import check_cp_rules
from bumblebee.plan.cp_rules import text as cp_rules_text
from bumblebee.plan.hardware import GPUS, MEMORY_MARGIN, get_gpu
from bumblebee.plan.kernels import assumptions, kernels_note
from bumblebee.plan.layout import (
    Workload,
    apply_overrides,
    check,
    parse_layout,
    prims_label,
    split_train_overrides,
    without_exchange,
)
from bumblebee.plan.memory import local_tokens, moe_costs
from bumblebee.plan.recipe import Recommendation, evaluate, recipe, recipe_primitives, search
from bumblebee.plan.runnable import emit_toml, run_config, runtime_problem
from bumblebee.plan.spec import GDN, load_spec, preset_names
from bumblebee.report import image_format


def add_arguments(p: argparse.ArgumentParser) -> None:
    presets = [n for n in preset_names() if not n.endswith("/tiny")]
    tiny = [n for n in preset_names() if n.endswith("/tiny")]
    p.add_argument(
        "--model",
        required=True,
        help=f"a preset: {', '.join(presets)}; a family's test-size model as FAMILY/tiny "
        f"({', '.join(tiny)}); or a Hugging Face config.json / model directory",
    )
    p.add_argument("--gpus", type=int, required=True, help="number of GPUs")
    p.add_argument("--gpu", default="h100", help=f"GPU type: {', '.join(GPUS)} (default h100)")
    p.add_argument("--seq", type=int, required=True, help="sequence length in tokens")
    p.add_argument(
        "--global-batch",
        type=int,
        default=None,
        help="sequences per optimizer step (default: one per GPU)",
    )
    p.add_argument(
        "--layout", default=None, help='evaluate exactly one layout, e.g. "tp=1 pp=2 ep=8 cp=4"'
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action=SetOverride,
        metavar="primitives.KEY=VALUE",
        help="fix a primitive (sharding, loss, recompute, moe_comm, moe_chunks) or train.balance / "
        "train.micro_batch; repeatable",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="also run the real model code for one rank under FakeTensorMode and report its peak",
    )
    p.add_argument(
        "--skew",
        type=float,
        default=1.0,
        metavar="F",
        help="routing skew: the busiest EP rank's experts receive F x their balanced share "
        "(default 1: balanced); the plan's memory and time and the dry run's routing follow it, "
        "and with moe_comm chunked the chunk count and weights are chosen for it",
    )
    p.add_argument(
        "--from-run",
        metavar="DIR",
        help="a training run's out_dir: per-layer routing skew from its expert-load histograms "
        "(moe.load_histogram_every), used as --skew (the worst layer) and to choose chunk "
        "weights per MoE layer",
    )
    p.add_argument(
        "--doc-len",
        type=int,
        default=0,
        metavar="N",
        help="--dry-run documents: back-to-back documents of N tokens (a packed corpus of short "
        "documents; the synthetic task starts at 16); default 0: one per sequence",
    )
    p.add_argument(
        "--explain",
        action="store_true",
        help="print every term of every stage's peak memory with its formula and numbers "
        "(the recommended layout, or the one given by --layout)",
    )
    p.add_argument(
        "--plot",
        default=None,
        metavar="OUT.png",
        help="draw memory and throughput of the top candidates",
    )
    p.add_argument("--top", type=int, default=10, help="alternatives to list (default 10)")
    p.add_argument(
        "--include-unimplemented",
        action="store_true",
        help="also rank layouts the runtime cannot run yet (e.g. tp > 1), marked as such; "
        "never recommended",
    )
    p.add_argument(
        "--emit-config",
        type=int,
        default=None,
        metavar="N",
        help="print candidate N as a `bumblebee train --config` TOML (0: the recommendation, "
        "1..: the ranked alternatives as listed) and exit",
    )


def _one_layout(args, spec, gpu, work, base: PrimitivesConfig, fixed: set[str]) -> Recommendation:
    lay = parse_layout(args.layout, args.gpus)
    prims = base
    if lay.ep == 1 and "moe_comm" not in fixed:
        prims = without_exchange(prims)
    why = check(spec, lay, prims, work, args.gpus)
    if why:
        raise ConfigError(f"--layout {args.layout!r}: {why}")
    cand = evaluate(spec, lay, prims, work, gpu, skew=args.skew)
    return Recommendation(
        cand,
        {
            "layout": f"{lay.short()} (given by --layout)",
            "primitives": f"{prims_label(prims)}"
            + (" (recipe defaults + --set)" if fixed else " (recipe defaults)"),
        },
    )


def _choose_chunks(args, spec, gpu, work, rec: Recommendation) -> ChunkChoice | None:
    """Under routing skew (``--skew`` or ``--from-run``) and chunked EP: the recommendation
    re-evaluated with the chunk weights chosen for it (plan/chunks.py)."""
    c = rec.candidate
    if args.from_run:
        skews = run_skew(args.from_run, spec, c.layout.ep)
        c = evaluate(spec, c.layout, c.prims, work, gpu, skew=max(skews))
    else:
        skews = [args.skew] if args.skew > 1 else None
    rec.candidate = c
    if skews is None or moe_costs(c.prims).overlap != "chunks" or c.layout.ep == 1:
        return None
    choice = choose(spec, c.layout, c.prims.recompute, c.prims.moe_chunks, work, gpu, skews)
    w = choice.config_weights()
    k = c.prims.moe_chunks if isinstance(w[0], list) else len(w)
    prims = dataclasses.replace(c.prims, moe_chunk_weights=w, moe_chunks=k)
    rec.candidate = evaluate(spec, c.layout, prims, work, gpu, skew=max(skews))
    return choice


def _header(args, n: int | None) -> str:
    which = "" if n is None else f" (candidate {n})"
    return (
        f"# written by bumblebee plan --model {args.model} --gpus {args.gpus} --gpu {args.gpu} --seq {args.seq}"
        + (f" --global-batch {args.global_batch}" if args.global_batch else "")
        + which
    )


def run(args: argparse.Namespace) -> int:
    # before any work (the dry run takes minutes on a real model); NaN passes every comparison
    if not (math.isfinite(args.skew) and args.skew >= 1.0):
        raise ConfigError(
            f"--skew must be a finite number >= 1 (1: balanced routing), got {args.skew}"
        )
    if args.from_run and args.skew != 1.0:
        raise ConfigError("--from-run reads the skew from the run's histograms: drop --skew")
    if args.gpus < 1:
        raise ConfigError(f"--gpus must be >= 1, got {args.gpus}")
    if args.seq < 1:
        raise ConfigError(f"--seq must be >= 1, got {args.seq}")
    if args.top < 1:
        raise ConfigError(f"--top must be >= 1, got {args.top}")
    if args.plot:  # the path, matplotlib and the format, before the search
        outputs.check_target(args.plot, "--plot", kind="file")
        image_format(args.plot)
    spec, hf = load_spec(args.model)
    gpu = get_gpu(args.gpu)
    batch = args.global_batch if args.global_batch is not None else args.gpus
    if batch < 1:
        raise ConfigError(f"--global-batch must be >= 1, got {batch}")
    prim_items, train = split_train_overrides(args.overrides)
    work = Workload(seq=args.seq, global_batch=batch, **train)
    base, fixed = apply_overrides(recipe_primitives(), prim_items)
    notes: list[str] = []
    counts = None
    if args.layout:
        rec = _one_layout(args, spec, gpu, work, base, fixed)
        cands = [rec.candidate]
        problem = runtime_problem(
            run_config(args.model, spec.family, rec.candidate, work), args.gpus
        )
        if problem:
            notes.append(f"not runnable yet: {problem}")
    else:
        if args.gpus > 4096:
            raise ConfigError(f"--gpus {args.gpus}: the search covers up to 4096 GPUs")
        rec = recipe(spec, args.gpus, gpu, work, base, fixed, skew=args.skew)
        with Progress(f"plan {spec.name} on {args.gpus} GPUs: layouts evaluated") as progress:
            cands = search(
                spec, args.gpus, gpu, work, base, fixed, progress=progress, skew=args.skew
            )
        # rank only what the runtime accepts (its own resolver); the rest only on request, marked
        problems = {}
        with Progress(
            f"plan {spec.name}: candidates checked against the runtime", total=len(cands)
        ) as progress:
            for c in cands:
                problems[id(c)] = runtime_problem(
                    run_config(args.model, spec.family, c, work), args.gpus
                )
                progress.update()
        runnable = [c for c in cands if not problems[id(c)]]
        if args.include_unimplemented:
            for c in cands:
                if problems[id(c)]:
                    c.reason = f"not runnable yet: {problems[id(c)]}" + (
                        f"; {c.reason}" if c.reason else ""
                    )
            notes.append(
                f"{len(cands) - len(runnable)} layout(s) the runtime cannot run yet are listed, marked "
                f"'not runnable yet', and never recommended"
            )
        cands = [c for c in cands if args.include_unimplemented or not problems[id(c)]]
        if not cands:
            raise ConfigError(
                f"no valid layout of {spec.name} on {args.gpus} GPUs with seq {args.seq} and global "
                f"batch {batch} (--gpus must allow tp*pp*cp*dp splits that divide the heads, experts "
                f"and the batch)"
            )
        best = next((c for c in runnable if c.feasible), None)
        if not rec.candidate.feasible and best is not None:
            notes.append(
                f"the recipe's defaults do not fit ({rec.candidate.reason}); recommending the fastest "
                f"feasible layout instead"
            )
            rec = Recommendation(
                best,
                {
                    "layout": f"{best.layout.short()} (fastest feasible in the search)",
                    "primitives": prims_label(best.prims),
                },
            )
        elif best is None:
            static = spec.num_params()["total"] * 18 / (gpu.hbm_gb * (1 - MEMORY_MARGIN) * 1e9)
            notes.append(
                f"nothing fits on {args.gpus} x {gpu.name}: the static state alone (18 B/param) needs "
                f">= {math.ceil(static)} GPUs; add GPUs, use a larger GPU or a shorter --seq"
                + (
                    ", or set train.offload_optimizer = true (fsdp2 keeps the sharded parameters, "
                    "gradients and optimizer state in host memory: slower steps; not modelled here)"
                    if static > args.gpus
                    else ""
                )
            )
        elif best.tokens_per_s > rec.candidate.tokens_per_s * 1.03:
            gain = best.tokens_per_s / rec.candidate.tokens_per_s - 1
            notes.append(
                f"the search beats the recipe: {best.layout.short()} | {prims_label(best.prims)} is predicted "
                f"{gain:+.0%} tokens/s ({best.memory.total / 1e9:.1f} GB/GPU)"
            )
        else:
            notes.append("the search finds nothing more than 3% faster than the recipe")
        counts = (sum(c.feasible for c in cands), sum(not c.feasible for c in cands))
        cands = [c for c in cands if c.feasible][: args.top] + [c for c in cands if not c.feasible][
            : args.top
        ]
    chunks = _choose_chunks(args, spec, gpu, work, rec)
    if chunks is not None:
        notes.append(chunks.text())
    notes.append(
        "assumed, decided by the runtime at start: bf16 compute, fp32 master weights; on CPU the "
        "pure-PyTorch paths run"
    )
    notes.append(
        kernels_note(
            rec.candidate.layout.cp,
            GDN in spec.mixers,
            spec.family,
            spec,
            tokens=local_tokens(work, rec.candidate.layout),
        )
    )
    pure = assumptions(rec.candidate.layout.cp, GDN in spec.mixers, spec)["pure_pytorch_here"]
    if pure and rec.candidate.perf:
        notes.append(
            f"TFLOPs assume the fused kernels; on CUDA with this environment's packages "
            f"{', '.join(pure)} would run pure PyTorch (lower throughput, not modelled); on CPU every "
            f"slot is pure PyTorch"
        )
    if args.emit_config is not None:
        shown = [rec.candidate] + [c for c in cands if c is not rec.candidate]
        if not 0 <= args.emit_config < len(shown):
            raise ConfigError(
                f"--emit-config {args.emit_config}: choose 0 (the recommendation) .. {len(shown) - 1}"
            )
        print(
            emit_toml(
                run_config(args.model, spec.family, shown[args.emit_config], work),
                _header(args, args.emit_config),
            ),
            end="",
        )
        return 0
    dry = None
    if args.dry_run:
        from bumblebee.plan.dryrun import dry_run

        if args.skew < 1.0:
            raise ConfigError(f"--skew must be >= 1 (1: balanced routing), got {args.skew}")
        if args.doc_len < 0:
            raise ConfigError(
                f"--doc-len must be >= 0 (0: one document per sequence), got {args.doc_len}"
            )
        dry = dry_run(spec, hf, rec.candidate, work, skew=args.skew, doc_len=args.doc_len)
    if args.plot:
        from bumblebee.report import check_plot_target

        check_plot_target(args.plot, "--plot")
        shown = [rec.candidate] + [c for c in cands if c.feasible and c is not rec.candidate]
        report.plot(args.plot, shown)
        notes.append(f"plot written to {args.plot}")
    rules = check_cp_rules(spec, rec.candidate, work, gpu) if args.explain else None
    if rules is not None and not args.json:
        print(report.explain(rec.candidate) + "\n")
        print(cp_rules_text(rules) + "\n")
    if args.json:
        out = report.to_json(rec, cands)
        for entry, cand in zip([out["recommended"]] + out["candidates"], [rec.candidate] + cands):
            cfg = run_config(
                args.model, spec.family, cand, work
            )  # what `bumblebee train --config` takes
            entry["config"] = emit_toml(cfg, _header(args, None))
            entry["runtime_problem"] = runtime_problem(cfg, args.gpus)
            entry["assumptions"] = assumptions(cand.layout.cp, GDN in spec.mixers, spec)
        if dry is not None:
            out["dry_run"] = dry.as_json()
        if chunks is not None:
            out["chunks"] = {
                "skew": chunks.skews,
                "moe_chunk_weights": chunks.config_weights(),
                "exposed_even_s": chunks.exposed_even_s,
                "exposed_s": chunks.exposed_s,
                "moe_s": chunks.moe_s,
            }
        if rules is not None:
            out["cp_rules"] = [r.as_json() for r in rules]
        print(json.dumps(out, indent=1))
    else:
        print(
            report.text(
                spec,
                args.gpus,
                gpu,
                work,
                rec,
                cands,
                args.top,
                notes,
                counts,
                title="evaluated" if args.layout else "recommended",
            )
        )
        if dry is not None:  # a table, after the report it checks
            print("\n" + dry.table())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bumblebee plan", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
