"""Printing, JSON and plotting of a plan (no model arithmetic here).

The text report is what a user reads before renting GPUs: the recommendation
with a reason per choice, its memory breakdown, a ranked table of feasible
alternatives and the infeasible ones with why. ``--json`` emits the schema of
issue 8: ``{"recommended": C, "candidates": [C, ...]}``. ``--plot`` draws memory
bars and predicted throughput for the top candidates (matplotlib is optional; bumblebee/report.py loads it).
"""

from __future__ import annotations

from bumblebee.config import ConfigError
from bumblebee.plan.hardware import GB, GPU
from bumblebee.plan.layout import Workload, prims_label
from bumblebee.plan.recipe import Candidate, Recommendation
from bumblebee.plan.spec import ModelSpec
from bumblebee.report import pyplot, save

BREAKDOWN = (
    ("parameters", "param"),
    ("gradients", "grad"),
    ("optimizer", "optim"),
    ("saved_inputs", "saved"),
    ("live_layer", "live"),
    ("moe_buffers", "moe"),
    ("loss", "loss"),
    ("allgather", "ag"),
    ("workspace", "ws"),
    ("optim_temp", "otmp"),
    ("overhead", "ovh"),
)


def to_json(rec: Recommendation | None, cands: list[Candidate]) -> dict:
    return {
        "recommended": rec.candidate.as_json() if rec else None,
        "candidates": [c.as_json() for c in cands],
    }


def _row(i: int | str, c: Candidate) -> str:
    mem = c.memory.as_gb() if c.memory else {}
    parts = " ".join(f"{mem.get(k, 0):5.1f}" for k, _ in BREAKDOWN)
    perf = (
        f"{c.perf.tflops_per_gpu:6.1f} {c.perf.tokens_per_s_per_gpu:8.0f}"
        if c.perf
        else f"{'-':>6} {'-':>8}"
    )
    mark = "  [not runnable yet]" if c.reason.startswith("not runnable yet") else ""
    return (
        f"{i!s:>3} {c.layout.short():<32} {prims_label(c.prims):<33} {mem.get('total', 0):6.1f} "
        f"{parts} {perf}{mark}"
    )


def _stage_header() -> str:
    return f"{'stage':>5} {'layers':>7} {'moment':>9} {'GB':>6} " + " ".join(
        f"{short:>5}" for _, short in BREAKDOWN
    )


def _stage_row(st) -> str:
    p = st.peak
    mem = p.as_gb()
    layers = f"{st.layers.start}-{st.layers.stop - 1}" if len(st.layers) else "-"
    return f"{st.stage:>5} {layers:>7} {p.moment:>9} {mem['total']:6.1f} " + " ".join(
        f"{mem[k]:5.1f}" for k, _ in BREAKDOWN
    )


def explain(c: Candidate) -> str:
    """Every term of every stage's peak moment with its formula and numbers (``--explain``)."""
    lines = [
        f"memory of {c.layout.short()} | {prims_label(c.prims)}: per stage, the peak moment and each term's formula"
    ]
    for st in c.stages:
        p = st.peak
        moments = ", ".join(f"{k} {m.total / GB:.2f}" for k, m in st.moments.items())
        lines += [
            "",
            f"stage {st.stage} (layers {st.layers.start}-{st.layers.stop - 1}): peak {p.total / GB:.2f} GB "
            f"at the {p.moment} moment (moments: {moments} GB)",
        ]
        for k, _ in BREAKDOWN:
            v = getattr(p, k)
            if v or k in p.why:
                lines.append(f"  {k:<13} {v / GB:7.2f} GB  {p.why.get(k, '')}")
    return "\n".join(lines)


def _header() -> str:
    parts = " ".join(f"{short:>5}" for _, short in BREAKDOWN)
    return (
        f"{'#':>3} {'layout':<32} {'sharding loss recompute moe_comm':<33} {'GB':>6} {parts} "
        f"{'TFLOPs':>6} {'tok/s':>8}"
    )


def text(
    spec: ModelSpec,
    gpus: int,
    gpu: GPU,
    work: Workload,
    rec: Recommendation | None,
    cands: list[Candidate],
    top: int = 10,
    notes: list[str] | None = None,
    counts: tuple[int, int] | None = None,
    title: str = "recommended",
) -> str:
    """``counts``: (feasible, infeasible) totals when ``cands`` is a shortlist; ``title``
    names the headline configuration ("evaluated" for --layout)."""
    n = spec.num_params()
    lines = [
        f"model {spec.name}: {n['total'] / 1e9:.1f}B parameters ({n['expert'] / 1e9:.1f}B in routed experts), "
        f"{spec.layers} layers; {gpus} x {gpu.name} ({gpu.hbm_gb:.0f} GB); seq {work.seq}, "
        f"global batch {work.global_batch} sequences"
    ]
    if rec:
        c = rec.candidate
        status = "fits" if c.feasible else "DOES NOT FIT"
        lines += ["", f"{title} ({status}): {c.layout.short()} | {prims_label(c.prims)}"]
        for key, why in rec.reasons.items():
            lines.append(f"  {key:<10} {why}")
        if c.memory:
            mem = c.memory.as_gb()
            where = f"stage {c.memory.stage}, " if len(c.stages) > 1 else ""
            lines.append(
                "  memory     "
                + f"{mem['total']:.1f} GB/GPU at its peak ({where}{c.memory.moment}) = "
                + " + ".join(f"{k} {mem[k]:.1f}" for k, _ in BREAKDOWN if mem[k] > 0.005)
            )
            if len(c.stages) > 1:
                lines += ["  stages     peak per pipeline stage (GB):", "    " + _stage_header()]
                lines += ["    " + _stage_row(st) for st in c.stages]
        if c.perf:
            lines.append(
                f"  predicted  {c.perf.tflops_per_gpu:.1f} TFLOPs/GPU, {c.perf.tokens_per_s_per_gpu:.0f} "
                f"tokens/s/GPU, step {c.perf.step_s:.1f} s"
            )
        lines += [f"  note       {note}" for note in rec.notes + (notes or [])]
    feasible = [c for c in cands if c.feasible]
    infeasible = [c for c in cands if not c.feasible]
    n_ok, n_bad = counts or (len(feasible), len(infeasible))
    if feasible:
        lines += [
            "",
            f"feasible alternatives ({n_ok}, ranked by predicted throughput; memory in GB/GPU on the "
            f"stage that needs most):",
            _header(),
        ]
        lines += [_row(i + 1, c) for i, c in enumerate(feasible[:top])]
    if infeasible:
        lines += ["", f"infeasible ({n_bad}; nearest to fitting shown):"]
        lines += [
            f"  {c.layout.short():<26} {prims_label(c.prims):<33} {c.reason}"
            for c in infeasible[:top]
        ]
    return "\n".join(lines)


def plot(path: str, cands: list[Candidate], top: int = 8) -> None:
    """Stacked memory bars per candidate with predicted TFLOPs/GPU on a second axis."""
    plt = pyplot()
    shown = [c for c in cands if c.memory][:top]
    if not shown:
        raise ConfigError("--plot: no candidate to draw")
    labels = [f"{c.layout.short()}\n{prims_label(c.prims)}" for c in shown]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(shown)), 5.5))
    bottom = [0.0] * len(shown)
    for key, short in BREAKDOWN:
        vals = [getattr(c.memory, key) / GB for c in shown]
        ax.bar(range(len(shown)), vals, bottom=bottom, label=short)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("memory per GPU (GB)")
    ax.set_xticks(range(len(shown)), labels, fontsize=6, rotation=30, ha="right")
    ax.legend(fontsize=7, loc="upper left")
    ax2 = ax.twinx()
    ax2.plot(
        range(len(shown)),
        [c.perf.tflops_per_gpu if c.perf else 0 for c in shown],
        "ko-",
        label="TFLOPs/GPU",
    )
    ax2.set_ylabel("predicted TFLOPs/GPU")
    ax2.set_ylim(bottom=0)
    save(fig, path)
