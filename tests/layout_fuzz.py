"""Seeded layout fuzz of the emulated-CUDA mode (``train.emulate_cuda``) against the plain CPU path.

``case(seed, k)`` draws the k-th case of ``seed``: a model family (all ten, tiny, two decoder layers
or four), a layout (cp 1/2 with the ring or all-gather core and the linear-attention CP carry,
scan or relay; ep 1/2 with every registered MoE communication, chunked with 1-4 chunks; pp 1/2
with every registered schedule; dp 1/2; at most 4 ranks), the dtype, the micro-batches per rank
(1-3) and rows per micro-batch, every registered recompute policy (selective with a drawn module
list), the balance-loss definition, fused paths on or off, the other slots' implementations from
the registry, and the synthetic task's document lengths (16 tokens each up to one document per
row). Draws the launch checks refuse (``preflight``: ``check_run`` and what needs more than the
config) are drawn again, from the same stream: a case is a pure function of (seed, k). Half the
cases (``fuzz.memory=on``) count the first step's live tensors as a CPU run does.

``run_case`` trains the case 2 steps plain and 2 steps emulated inside one spawn of its ranks and
compares each rank's loss and grad norm per step (``TOLERANCE``): fp32 near-exact (the emulation
runs reference kernels that compute what the CPU paths compute, in another order), bf16 within a
bf16 budget. The emulated run checks every collective and point-to-point call (``CheckedComm``).

    python -m tests.layout_fuzz --cases 300            # seed 0, cases 0..299
    python -m tests.layout_fuzz --seed 7 --case 12     # one case (what a failure prints)
    python -m tests.layout_fuzz --cases 50 --start 100 --where model.name=qwen3_5_moe
    python -m tests.layout_fuzz --cases 20 --list      # the cases only, nothing run
    python -m tests.layout_fuzz --cases 8 --pin model.name=qwen3_5_moe --pin parallel.cp=2

A failure prints the one command that reproduces it; the sweep ends with the failures grouped by
kind (the exception and where it was raised, or which figure disagreed)."""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for `import dist_utils`

STEPS = 2
# a rank whose peers died raises after this, so the spawn ends (CPU ranks on a busy machine lag
# each other by seconds, never by minutes)
COLLECTIVE_TIMEOUT_S = 180.0
# keys of the harness among a case's overrides: fuzz.memory=on measures the first step's live
# tensors as a run does (the Trainer's memory tracker), off skips it
HARNESS = "fuzz."
MEMORY_ON = "fuzz.memory=on"
TAIL = 16  # traceback lines a failure prints
BATCH = 24  # consecutive cases run together: one spawn per world size among them
# relative bounds, (loss, grad norm): fp32 is the two paths' rounding (reference kernels in
# another summation order; step 2 after one AdamW update at lr 3e-3); bf16 is bf16 noise
# (7 mantissa bits: ~4e-3 per rounding, through a few layers and one update)
TOLERANCE = {"float32": (2e-5, 2e-4), "bfloat16": (3e-2, 1.5e-1)}

# each family at a few-layer tiny size; hybrid stacks keep one linear-attention and one full layer
LAYERS_2 = {
    "qwen3_moe": ["model.arch.num_hidden_layers=2"],
    "qwen3_5_moe": [
        "model.arch.num_hidden_layers=2",
        "model.arch.layer_types=['linear_attention', 'full_attention']",
    ],
    "deepseek_v3": ["model.arch.num_hidden_layers=2"],
    "qwen3_next": [
        "model.arch.num_hidden_layers=2",
        "model.arch.layer_types=['linear_attention', 'full_attention']",
    ],
    "glm4_moe": ["model.arch.num_hidden_layers=2"],
    "minimax_m2": ["model.arch.num_hidden_layers=2"],
    "kimi_linear": [
        "model.arch.num_hidden_layers=2",
        "model.arch.layer_types=['linear_attention', 'full_attention']",
        "model.arch.mlp_layer_types=['dense', 'sparse']",
    ],
    "gpt_oss": ["model.arch.num_hidden_layers=2"],
    "deepseek_v32": ["model.arch.num_hidden_layers=2"],
    "glm_moe_dsa": ["model.arch.num_hidden_layers=2"],
}
HYBRID = ("qwen3_5_moe", "qwen3_next", "kimi_linear")  # linear-attention layers (GDN, KDA)
# narrower than the presets (hidden 128): the sweep's cost is the CPU time of the model
NARROW = {
    "qwen3_moe": ["hidden_size=64", "moe_intermediate_size=32"],
    "qwen3_5_moe": [
        "hidden_size=64",
        "moe_intermediate_size=32",
        "shared_expert_intermediate_size=32",
        "linear_key_head_dim=16",
        "linear_value_head_dim=16",
        "head_dim=16",
    ],
    "deepseek_v3": ["hidden_size=64", "intermediate_size=96", "moe_intermediate_size=32"],
    "qwen3_next": [
        "hidden_size=64",
        "moe_intermediate_size=32",
        "shared_expert_intermediate_size=32",
        "linear_key_head_dim=16",
        "linear_value_head_dim=16",
        "head_dim=16",
    ],
    "glm4_moe": ["hidden_size=64", "intermediate_size=96", "moe_intermediate_size=32"],
    "minimax_m2": ["hidden_size=64", "intermediate_size=32"],
    "kimi_linear": [
        "hidden_size=64",
        "intermediate_size=96",
        "moe_intermediate_size=32",
        "linear_head_dim=16",
        "kv_lora_rank=16",
        "qk_nope_head_dim=16",
        "qk_rope_head_dim=8",
        "v_head_dim=16",
    ],
    "gpt_oss": ["hidden_size=64", "intermediate_size=32", "sliding_window=12"],
    "deepseek_v32": ["hidden_size=64", "intermediate_size=96", "moe_intermediate_size=32"],
    "glm_moe_dsa": ["hidden_size=64", "intermediate_size=96", "moe_intermediate_size=32"],
}
COMMON = [
    "train.clip_grad=0",
    "train.lr=3e-3",
    "train.warmup_steps=1",
    "train.eval_every=0",
    "train.log_every=1",
    "data.source='synthetic'",
    "data.ramp_steps=0",
    "primitives.dsa_block=24",
]


@dataclass(frozen=True)
class Case:
    seed: int
    index: int
    world: int
    overrides: tuple[str, ...]
    redraws: int  # draws the launch checks refused before this one
    pins: tuple[str, ...] = ()

    def command(self) -> str:
        pins = "".join(f" --pin {p}" for p in self.pins)
        return f"python -m tests.layout_fuzz --seed {self.seed} --case {self.index}{pins}"

    def value(self, key: str) -> str | None:
        for item in self.overrides:
            k, _, v = item.partition("=")
            if k == key:
                return v.strip("'")
        return None

    def describe(self) -> str:
        """The case in one line: the settings that were drawn, without the fixed ones."""
        drawn = [o for o in self.overrides if not o.startswith("model.arch.")]
        short = [o.replace("primitives.", "").replace("parallel.", "") for o in drawn]
        return f"world {self.world}: " + " ".join(s.replace("train.", "") for s in short)


def _choices(slot: str) -> list[str]:
    from bumblebee import registry

    return list(registry.implementations(slot))


def _draw(rng: random.Random, pins: dict[str, str]) -> tuple[int, list[str]]:
    """One raw draw (not yet checked): the world size and the overrides. ``pins``: key -> value
    taken instead of the draw (the stream draws it all the same, so the other keys are those of
    the unpinned case)."""
    from bumblebee.models import FAMILIES
    from bumblebee.primitives.recompute import MODULE_NAMES

    def pick(key: str, options: list):
        drawn = rng.choice(options)
        if key not in pins:
            return drawn
        return next((o for o in options if str(o) == pins[key]), type(drawn)(pins[key]))

    family = pick("model.name", sorted(FAMILIES))
    layers = pick("layers", [2, 2, 2, 4])
    # the preset's width only when pinned (``--pin width=preset``): drawing it would cost a sweep
    # its speed
    narrow = NARROW[family] if pins.get("width", "narrow") == "narrow" else []
    arch = (LAYERS_2[family] if layers == 2 else []) + narrow
    cp, ep, pp, dp = (pick(f"parallel.{k}", [1, 2]) for k in ("cp", "ep", "pp", "dp_shard"))
    if cp * pp * dp > 4:  # the machine's budget: at most 4 ranks
        if "parallel.cp" not in pins:
            cp = 1
        elif "parallel.dp_shard" not in pins:
            dp = 1
        else:
            pp = 1
    world = cp * pp * dp
    micro_batch = pick("train.micro_batch", [1, 1, 2])
    per_rank = pick("micro_batches", [1, 2, 3])  # micro-batches per rank and step
    seq = pick("train.seq_len", [64, 128, 256] if micro_batch == 1 else [64, 128])
    lo = pick("data.min_doc_len", [16, 16, 32, seq // 2, seq])  # 16 tokens ... one per row
    hi = pick("data.max_doc_len", [d for d in (lo, 2 * lo, seq) if lo <= d <= seq])
    out = [f"model.name={family}", *(f"model.arch.{a}" for a in arch)]
    out += [f"parallel.cp={cp}", f"parallel.ep={ep}", f"parallel.pp={pp}"]
    out += [f"parallel.dp_shard={dp}", f"train.seq_len={seq}", f"train.micro_batch={micro_batch}"]
    out += [f"train.global_batch={dp * micro_batch * per_rank}"]
    out += [f"train.dtype={pick('train.dtype', ['float32', 'bfloat16'])}"]
    out += [f"data.min_doc_len={lo}", f"data.max_doc_len={hi}"]
    out += [f"primitives.sharding={pick('primitives.sharding', _choices('sharding'))}"]
    if cp > 1:
        out += [
            f"primitives.cp_attention={pick('primitives.cp_attention', _choices('cp_attention'))}"
        ]
        if family in HYBRID:  # the GDN / KDA state across the CP ranks
            carry = pick("primitives.linear_attention_cp", ["scan", "relay"])
            out += [f"primitives.linear_attention_cp={carry}"]
    comms = [c for c in _choices("moe_comm") if c != "local"] if ep > 1 else ["local"]
    comm = pick("primitives.moe_comm", comms)
    out += [f"primitives.moe_comm={comm}"]
    if comm == "chunked":
        out += [f"primitives.moe_chunks={pick('primitives.moe_chunks', [1, 2, 3, 4])}"]
    if pp > 1:
        schedule = pick("primitives.pipeline", _choices("pipeline"))
        out += [f"primitives.pipeline={schedule}"]
        if schedule == "interleaved_1f1b":
            out += ["primitives.pp_virtual_stages=2"]
    recompute = pick("primitives.recompute", _choices("recompute"))
    out += [f"primitives.recompute={recompute}"]
    if recompute == "selective":
        modules = rng.sample(MODULE_NAMES, rng.randint(1, 3))
        out += [f"primitives.recompute_modules={modules}"]
    balances = ["auto", "step", "micro_batch_global", "micro_batch", "hf"]
    out += [f"train.balance={pick('train.balance', balances)}"]
    out += [f"primitives.fused={pick('primitives.fused', ['auto', 'off'])}"]
    # the other slots: mostly the defaults (what a run takes), now and then another registered one
    for slot in ("attention", "experts", "loss"):
        if rng.random() < 0.25:
            out += [f"primitives.{slot}={rng.choice(_choices(slot))}"]
    return world, out


def accepted(world: int, overrides: list[str], out_dir: str) -> bool:
    """What a launch would accept (``preflight``: the config's values, the layout at ``world``
    ranks, the pipeline, recompute modules, the synthetic task's limits)."""
    from bumblebee.config import ConfigError
    from bumblebee.runtime.launch.preflight import preflight
    from bumblebee.runtime.resolve import load_config

    try:
        cfg = load_config(None, overrides + COMMON + [f"train.out_dir={out_dir}"])
        preflight(cfg, world)
    except (ConfigError, ValueError):
        return False
    return True


def case(seed: int, index: int, pins: tuple[str, ...] = ()) -> Case:
    """The ``index``-th case of ``seed`` (its own random stream: independent of the others);
    ``pins``: ``KEY=VALUE`` settings taken instead of drawn (``_draw``)."""
    rng = random.Random(f"layout_fuzz/{seed}/{index}")
    pinned = dict(p.split("=", 1) for p in pins)
    probe = os.path.join(tempfile.gettempdir(), "layout_fuzz_probe")
    for redraws in range(10_000):
        world, overrides = _draw(rng, pinned)
        if accepted(world, overrides, probe):
            # the harness's own key, from a stream of its own (the config draws stay as they were)
            on = random.Random(f"layout_fuzz/{seed}/{index}/memory").random() < 0.5
            memory = pinned.get("memory", "on" if on else "off")
            overrides.append(f"{HARNESS}memory={memory}")
            return Case(seed, index, world, tuple(overrides), redraws, tuple(pins))
    raise RuntimeError(f"no accepted draw for seed {seed} case {index}")


def _train(overrides: list[str], out_dir: str, memory: bool) -> list[tuple[float, float]]:
    import io

    from bumblebee.runtime.resolve import load_config
    from bumblebee.runtime.trainer import Trainer

    cfg = load_config(None, overrides + [f"train.out_dir={out_dir}", f"train.steps={STEPS}"])
    trainer = Trainer(cfg, stream=io.StringIO())
    if not memory:
        # no live-tensor count on the first step (what a CPU run does): a dispatch mode around
        # every op, about 5x the step, and a path of its own (ops under a mode run their bodies
        # with autocast excluded), so half the cases take it
        trainer._peak = 0
    return [(r["loss"], r["grad_norm"]) for r in (trainer.train_step() for _ in range(STEPS))]


def _one(rank: int, overrides: list[str], out_dir: str) -> dict:
    """Plain then emulated on this rank; an exception is kept as its traceback."""
    memory = MEMORY_ON in overrides
    overrides = [o for o in overrides if not o.startswith(HARNESS)]
    out = {}
    for mode, extra in (("plain", []), ("emulated", ["train.emulate_cuda=true"])):
        try:
            out[mode] = _train(overrides + COMMON + extra, f"{out_dir}/{mode}/{rank}", memory)
        except Exception:
            out[mode] = traceback.format_exc()
            break
    return out


def _batch_ranks(rank: int, world: int, batch: list[tuple[int, list[str]]], out_root: str) -> None:
    """Each case of ``batch`` in turn on this rank (one process start for all of them), its
    result written to ``out_root/<k>/rank<r>.json`` at once; after a case the ranks compare notes
    through the rendezvous store and all stop after one that failed anywhere (a rank whose
    peers died waits out the collective timeout first), so the driver respawns for the rest."""
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
        timeout=datetime.timedelta(seconds=3600),
    )  # fmt: skip
    for k, overrides in batch:
        out = _one(rank, overrides, f"{out_root}/{k}")
        with open(f"{out_root}/{k}/rank{rank}.json", "w") as f:
            json.dump(out, f)
        failed = any(isinstance(v, str) for v in out.values())
        store.set(f"case{k}/rank{rank}", "fail" if failed else "ok")
        keys = [f"case{k}/rank{r}" for r in range(world)]
        store.wait(keys)
        if any(store.get(key) != b"ok" for key in keys):
            return


@dataclass
class Outcome:
    case: Case
    ok: bool
    kind: str  # "" when ok; else what failed, grouped over a sweep
    detail: str
    seconds: float


WRAPPERS = ("/primitives/comm_check.py", "/perf/memory.py")


def _crash_kind(mode: str, tb: str) -> str:
    """``<mode> crash: <exception type> at <file>:<function>`` (the innermost bumblebee frame)."""
    lines = tb.strip().splitlines()
    last = lines[-1].split(":")[0] if lines else "?"
    where = "?"
    for line in lines:
        s = line.strip()
        # the checked collectives and the memory tracker wrap every call and op: their caller
        if s.startswith('File "') and "/bumblebee/" in s and not any(w in s for w in WRAPPERS):
            path = s.split('"')[1]
            func = s.rsplit(" in ", 1)[-1]
            where = f"{path.split('/bumblebee/', 1)[1]}:{func}"
    return f"{mode} crash: {last} at {where}"


def compare(case_: Case, per_rank: list[dict]) -> tuple[str, str]:
    """(kind, detail) of the first disagreement, ("", "") when every rank agrees. A rank that
    raised is reported before the others (whose error is then only that it left)."""
    loss_tol, gnorm_tol = TOLERANCE[case_.value("train.dtype")]
    crashes = [
        (rank, mode, out[mode])
        for rank, out in enumerate(per_rank)
        for mode in ("plain", "emulated")
        if isinstance(out.get(mode), str)
    ]
    if crashes:
        # the root cause: not a peer's timeout or connection error
        secondary = ("Timeout", "timed out", "Connection", "connection", "closed")
        crashes.sort(key=lambda c: any(w in c[2].strip().splitlines()[-1] for w in secondary))
        rank, mode, tb = crashes[0]
        return _crash_kind(mode, tb), f"rank {rank} {mode}:\n{tb}"
    for rank, out in enumerate(per_rank):
        for step, ((l0, g0), (l1, g1)) in enumerate(zip(out["plain"], out["emulated"])):
            for what, a, b, tol in (("loss", l0, l1, loss_tol), ("grad norm", g0, g1, gnorm_tol)):
                if not abs(b - a) <= tol * abs(a):
                    rel = abs(b - a) / max(abs(a), 1e-30)
                    detail = f"rank {rank} step {step + 1}: {what} emulated {b!r} vs plain {a!r}"
                    return f"{what} mismatch", f"{detail} (relative {rel:.2e} > {tol:g})"
    return "", ""


def _results(case_: Case, out_root: str) -> list[dict] | None:
    """Every rank's result of ``case_``, None while any is missing."""
    per_rank = []
    for rank in range(case_.world):
        path = f"{out_root}/{case_.index}/rank{rank}.json"
        if not os.path.exists(path):
            return None
        with open(path) as f:
            per_rank.append(json.load(f))
    return per_rank


def run_cases(
    cases: list[Case], out_root: str, timeout: float = 600.0, report=None
) -> list[Outcome]:
    """Every case (all of one world size), in as few spawns as the failures allow: a spawn runs
    the cases in turn and stops after a failed one; the next spawn starts after it. ``timeout``:
    seconds per case. ``report(outcome)`` is called as each one is known."""
    from dist_utils import run_distributed

    assert len({c.world for c in cases}) <= 1, "one world size per call"
    outcomes, todo = [], list(cases)
    while todo:
        start = time.perf_counter()
        for c in todo:
            os.makedirs(f"{out_root}/{c.index}", exist_ok=True)
        error = ""
        try:
            run_distributed(
                _batch_ranks, todo[0].world, [(c.index, list(c.overrides)) for c in todo],
                out_root, timeout=timeout * len(todo), collective_timeout=COLLECTIVE_TIMEOUT_S,
            )  # fmt: skip
        except Exception as e:  # a rank died or hung (run_distributed's report)
            error = str(e) or type(e).__name__
        settled = []
        for c in todo:
            per_rank = _results(c, out_root)
            if per_rank is not None:
                kind, detail = compare(c, per_rank)
            else:  # the case the spawn was in when it failed (or, defensively, one never run)
                last = (error.strip().splitlines() or ["no result and no error"])[-1]
                kind, detail = f"ranks failed: {last[:160]}", error or "a rank wrote no result"
            settled.append((c, kind, detail))
            if kind:
                break  # the ranks stopped after it
        seconds = (time.perf_counter() - start) / len(settled)  # the spawn's time, shared
        for c, kind, detail in settled:
            outcomes.append(Outcome(c, not kind, kind, detail, seconds))
            if report:
                report(outcomes[-1])
        todo = todo[len(settled) :]
    return outcomes


def run_case(case_: Case, out_dir: str, timeout: float = 600.0) -> Outcome:
    return run_cases([case_], out_dir, timeout)[0]


def _matches(case_: Case, where: list[str]) -> bool:
    return all(case_.value(k) == v for k, _, v in (w.partition("=") for w in where))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.layout_fuzz", description=__doc__)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cases", type=int, default=1, help="how many cases (from --start)")
    parser.add_argument("--start", type=int, default=0, help="index of the first case")
    parser.add_argument("--case", type=int, help="run this one case only")
    parser.add_argument(
        "--where", action="append", default=[], help="KEY=VALUE: only cases drawn with it"
    )
    parser.add_argument(
        "--pin", action="append", default=[], help="KEY=VALUE: take it instead of drawing it"
    )
    parser.add_argument("--list", action="store_true", help="print the cases, run nothing")
    parser.add_argument("--out", default="", help="directory for the runs (default: a temp dir)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per case")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    indices = (
        [args.case] if args.case is not None else list(range(args.start, args.start + args.cases))
    )
    out_root = args.out or tempfile.mkdtemp(prefix="layout_fuzz_")
    print(f"layout fuzz: seed {args.seed}, cases {indices[0]}..{indices[-1]}", flush=True)
    if args.list:
        for c in (case(args.seed, k, tuple(args.pin)) for k in indices):
            if _matches(c, args.where):
                print(f"case {c.index}: {c.describe()}", flush=True)
        return 0
    failures: dict[str, list[Outcome]] = {}
    t0 = time.perf_counter()

    def report(o: Outcome) -> None:
        status = "ok" if o.ok else f"FAIL ({o.kind})"
        print(f"case {o.case.index}: {status} {o.seconds:.0f}s  {o.case.describe()}", flush=True)
        if not o.ok:
            failures.setdefault(o.kind, []).append(o)
            # the traceback's last frames: where it was raised and why
            tail = "\n".join(o.detail.strip().splitlines()[-TAIL:])
            print(f"  reproduce: {o.case.command()}\n  " + tail.replace("\n", "\n  "), flush=True)

    outcomes = []
    # windows of consecutive cases, each window's cases one spawn per world size (as far as no
    # case fails): every world size is reached early in a long sweep
    for w in range(0, len(indices), BATCH):
        cases = [case(args.seed, k, tuple(args.pin)) for k in indices[w : w + BATCH]]
        cases = [c for c in cases if _matches(c, args.where)]
        for world in sorted({c.world for c in cases}):
            group = [c for c in cases if c.world == world]
            outcomes += run_cases(group, out_root, args.timeout, report)
    ran, passed = len(outcomes), sum(o.ok for o in outcomes)
    minutes = (time.perf_counter() - t0) / 60
    rate = ran / minutes if minutes else 0.0
    print(f"\n{ran} cases, {passed} passed, {ran - passed} failed ({rate:.2f} cases/min)")
    for kind, outs in failures.items():
        print(f"  {len(outs)} x {kind}: " + ", ".join(o.case.command() for o in outs))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
