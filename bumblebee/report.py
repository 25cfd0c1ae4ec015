"""Pictures of runs: ``bumblebee report RUN_DIR [RUN_DIR ...] -o report.png``, and the one place
that loads matplotlib (``bumblebee plan --plot`` and ``bumblebee rl --plot`` draw through it too).

A report reads each run's ``metrics.jsonl`` and draws, over steps, one panel per
quantity with every run overlaid in its own colour and a shared legend: loss
(held-out ``eval_loss`` as dots where logged), gradient norm, tokens/s, peak
memory, learning rate, and expert load (``expert_load_*`` keys where a run logs
them, else the router's balance loss, whose minimum is reached at even load).
Comparing a pair, a resume or two layouts is then one glance.

matplotlib is an optional dependency (the ``[data]`` extra); without it every
plotting command fails up front with one line naming the extra.
"""

from __future__ import annotations

import argparse
import json
import os

from bumblebee.config import ConfigError

PANELS = (  # (title, metrics key, scale)
    ("loss", "loss", 1.0),
    ("gradient norm", "grad_norm", 1.0),
    ("tokens / s", "tokens_per_s", 1.0),
    ("peak memory (MiB)", "peak_mem_bytes", 2.0 ** -20),
    ("learning rate", "lr", 1.0),
)


def pyplot():
    """matplotlib.pyplot on the non-interactive Agg backend, or one line naming the extra."""
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("plotting needs the optional package 'matplotlib': pip install 'bumblebee[data]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: str) -> None:
    """Write a figure as PNG (its directory is created) and free it."""
    plt = pyplot()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def read_metrics(run_dir: str) -> list[dict]:
    """The records of a run directory's metrics.jsonl (a torn last line from a crash is ignored)."""
    path = run_dir if run_dir.endswith(".jsonl") else os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ConfigError(f"{run_dir}: no metrics.jsonl (not a run directory)")
    out = []
    with open(path) as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines):
                break
            raise ConfigError(f"{path}:{i}: not valid JSON") from None
    if not out:
        raise ConfigError(f"{path}: no steps logged")
    return out


def _labels(run_dirs: list[str]) -> list[str]:
    """Short distinct names: the last path component, or the last two if those collide."""
    names = [os.path.basename(os.path.normpath(d)) for d in run_dirs]
    if len(set(names)) < len(names):
        names = [os.path.join(*os.path.normpath(d).split(os.sep)[-2:]) for d in run_dirs]
    return names


def _expert_series(recs: list[dict]) -> tuple[str, dict[str, list]]:
    keys = sorted({k for r in recs for k, v in r.items()  # the scalar load figures (not the per-expert histogram)
                   if k.startswith("expert_load_") and k != "expert_load_worst_layer" and isinstance(v, (int, float))})
    if keys:
        return "expert load", {k: [r.get(k) for r in recs] for k in keys}
    return "expert load: balance loss (min at even load)", {"aux_loss": [r.get("aux_loss") for r in recs]}


def plot_runs(run_dirs: list[str], out_png: str, labels: list[str] | None = None) -> None:
    """Every panel of PANELS plus expert load, runs overlaid, one legend."""
    plt = pyplot()
    runs = [read_metrics(d) for d in run_dirs]
    labels = labels or _labels(run_dirs)
    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for j, (recs, label) in enumerate(zip(runs, labels)):
        c = colors[j % len(colors)]
        lw = 1.2 + 1.6 * (len(runs) - 1 - j) / max(len(runs) - 1, 1)  # earlier runs wider: equal curves stay visible
        steps = [r["step"] for r in recs]
        for ax, (title, key, scale) in zip(axes.flat, PANELS):
            ys = [r[key] * scale if isinstance(r.get(key), (int, float)) else float("nan") for r in recs]
            ax.plot(steps, ys, color=c, lw=lw, label=label)
            ax.set_title(title)
        ev = [r for r in recs if "eval_loss" in r]
        if ev:
            axes.flat[0].plot([r["step"] for r in ev], [r["eval_loss"] for r in ev], "o--", color=c, ms=4,
                              lw=0.8, label=f"{label} (held-out)")
        title, series = _expert_series(recs)
        for k, (name, ys) in enumerate(series.items()):
            axes.flat[5].plot(steps, [y if y is not None else float("nan") for y in ys], color=c,
                              ls=("-", "--", ":")[k % 3], lw=1.2, label=f"{label} {name}" if len(series) > 1 else label)
        axes.flat[5].set_title(title)
    for ax in axes.flat:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    if any(len(_expert_series(r)[1]) > 1 for r in runs):
        axes.flat[5].legend(fontsize=7)
    fig.suptitle("bumblebee report: " + ", ".join(labels))
    save(fig, out_png)


def plot_rewards(metrics_path: str, out_png: str) -> None:
    """``bumblebee rl --plot``: mean reward of the sampled rollouts per GRPO step (raw and a
    10-step moving average), and the held-out evaluation reward after warm-up and at the end."""
    plt = pyplot()
    recs = read_metrics(metrics_path)
    grpo = [r for r in recs if r.get("phase") == "grpo"]
    steps, reward = [r["step"] for r in grpo], [r["reward"] for r in grpo]
    avg = [sum(reward[max(0, i - 9):i + 1]) / len(reward[max(0, i - 9):i + 1]) for i in range(len(reward))]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, reward, color="tab:blue", alpha=0.35, lw=1, label="mean reward per step")
    ax.plot(steps, avg, color="tab:blue", lw=2, label="10-step moving average")
    evals = [r for r in recs if r.get("phase") == "eval"]
    if evals:
        ax.plot([r["step"] for r in evals], [r["reward"] for r in evals], "o", color="tab:red",
                label="held-out reward (before / after)")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("reward")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title("bumblebee rl: GRPO on the built-in task")
    save(fig, out_png)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (each with a metrics.jsonl)")
    p.add_argument("-o", "--out", default="report.png", metavar="OUT.png", help="output PNG (default report.png)")
    p.add_argument("--label", action="append", default=None, metavar="NAME",
                   help="legend name of each run, in order (default: the directory names)")


def run(args) -> int:
    from bumblebee.report_inputs import check_inputs

    check_inputs(args.runs, args.out)  # one line per broken input or output, before any plotting
    if args.label is not None and len(args.label) != len(args.runs):
        raise ConfigError(f"--label given {len(args.label)} times for {len(args.runs)} runs")
    plot_runs(args.runs, args.out, args.label)
    print(f"bumblebee: wrote {args.out} ({len(args.runs)} run{'s' if len(args.runs) > 1 else ''})")
    return 0
