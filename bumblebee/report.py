"""Pictures of runs: ``bumblebee report RUN_DIR [RUN_DIR ...] -o report.png``, and the one place
that loads matplotlib (``bumblebee plan --plot`` and ``bumblebee rl --plot`` draw through it too).

A report reads each run's ``metrics.jsonl`` and draws one panel per quantity, every
run overlaid in its own colour, each axis labelled, over optimizer steps or (``--x
tokens``) tokens consumed. A training run: loss (held-out ``eval_loss`` as dots where
logged), gradient norm, tokens/s, peak memory (with a note when it was measured at
the first step only, as on CPU without ``train.track_memory``), learning rate, and
expert load (``expert_load_*`` keys where a run logs them, with reference lines at
even load, 1, and at the top-k ceiling E/K; else the router's balance loss, whose
minimum is reached at even load). An RL run (``bumblebee rl``: records with a
``phase``): loss, reward (held-out evaluations as dots), KL to the reference, entropy,
gradient norm and clip fraction, the supervised warm-up shaded and drawn dotted
before the GRPO steps. With two or more runs one more panel draws the difference of
each run to the first (loss; RL: reward) at the same step, so identical runs show a
flat line at 0 rather than two curves drawn over each other.

matplotlib is an optional dependency (the ``[data]`` extra); without it every
plotting command fails up front with one line naming the extra.
"""

from __future__ import annotations

import argparse
import io
import json
import os

from bumblebee import safe_write
from bumblebee.config import ConfigError
from bumblebee.report_panels import diff_panel, rl_panels, train_panels

X_AXES = ("step", "tokens")


def pyplot():
    """matplotlib.pyplot on the non-interactive Agg backend, or one line naming the extra."""
    try:
        import matplotlib
    except ImportError:
        raise ConfigError(
            "plotting needs the optional package 'matplotlib': pip install 'bumblebee[data]'"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def image_format(path: str) -> str:
    """The image format ``path``'s suffix names (png without one), or one line naming those
    matplotlib writes: a command checks its output name before it works, not after."""
    pyplot()
    from matplotlib.backend_bases import FigureCanvasBase

    fmt = os.path.splitext(path)[1][1:].lower() or "png"
    formats = FigureCanvasBase.get_supported_filetypes()
    if fmt not in formats:
        raise ConfigError(
            f"{path}: .{fmt} is not an image format matplotlib writes; use one of "
            + ", ".join(f".{f}" for f in sorted(formats))
        )
    return fmt


def check_plot_target(path: str, what: str) -> None:
    """Before the work whose figure it holds: ``path`` names an image format matplotlib writes
    and can be written as a file (outputs.check_target); one line naming ``what`` otherwise."""
    from bumblebee.outputs import check_target

    image_format(path)
    check_target(path, what, kind="file")


def save(fig, path: str) -> None:
    """Write a figure as an image in the format its suffix names (PNG without one; its
    directory is created) and free it; drawn in memory, then written by ``safe_write``."""
    plt = pyplot()
    try:
        fmt = image_format(path)
        fig.tight_layout()
        image = io.BytesIO()
        fig.savefig(image, format=fmt, dpi=120)
        safe_write.make_dirs(os.path.dirname(os.path.abspath(path)))
        safe_write.write_file(path, image.getvalue(), doing="write the image", durable=False)
    finally:
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


def _is_rl(recs: list[dict]) -> bool:
    """``bumblebee rl`` records carry a phase (warmup / grpo / eval)."""
    return any("phase" in r for r in recs)


def figure(run_dirs: list[str], labels: list[str] | None = None, x: str = "step"):
    """The report's matplotlib figure: training runs (report_panels.PANELS, expert load) or RL runs
    (RL_PANELS), overlaid; with two or more runs a panel of the difference to the first."""
    plt = pyplot()
    if x not in X_AXES:
        raise ConfigError(f"--x must be one of {', '.join(X_AXES)}, got {x!r}")
    runs = [read_metrics(d) for d in run_dirs]
    labels = labels or _labels(run_dirs)
    rl = [_is_rl(r) for r in runs]
    if any(rl) and not all(rl):
        raise ConfigError(
            "cannot overlay RL runs ("
            + ", ".join(lab for lab, k in zip(labels, rl) if k)
            + ") with training runs ("
            + ", ".join(lab for lab, k in zip(labels, rl) if not k)
            + ")"
        )
    if all(rl) and x == "tokens":
        raise ConfigError("--x tokens: an RL run's metrics log no token counts; use --x step")
    diff = len(runs) > 1
    fig, axes = plt.subplots(2, 4 if diff else 3, figsize=(17 if diff else 13, 7))
    flat = list(axes.flat)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    draw = rl_panels if all(rl) else train_panels
    xs_all, xlabel = draw(flat, runs, labels, run_dirs, x, colors)
    if diff:
        diff_panel(
            flat[6],
            runs,
            xs_all,
            labels,
            colors,
            *(("reward", "mean reward") if all(rl) else ("loss", "loss")),
        )
        flat[7].axis("off")
    for ax in flat[: 7 if diff else 6]:
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    fig.suptitle(
        ("bumblebee report (RL): " if all(rl) else "bumblebee report: ") + ", ".join(labels)
    )
    return fig


def plot_runs(
    run_dirs: list[str], out_png: str, labels: list[str] | None = None, x: str = "step"
) -> None:
    """``bumblebee report``: ``figure`` written as a PNG."""
    save(figure(run_dirs, labels, x), out_png)


def plot_rewards(metrics_path: str, out_png: str) -> None:
    """``bumblebee rl --plot``: mean reward of the sampled rollouts per GRPO step (raw and a
    10-step moving average), and the held-out evaluation reward after warm-up and at the end."""
    plt = pyplot()
    recs = read_metrics(metrics_path)
    grpo = [r for r in recs if r.get("phase") == "grpo"]
    steps, reward = [r["step"] for r in grpo], [r["reward"] for r in grpo]
    avg = [
        sum(reward[max(0, i - 9) : i + 1]) / len(reward[max(0, i - 9) : i + 1])
        for i in range(len(reward))
    ]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, reward, color="tab:blue", alpha=0.35, lw=1, label="mean reward per step")
    ax.plot(steps, avg, color="tab:blue", lw=2, label="10-step moving average")
    evals = [r for r in recs if r.get("phase") == "eval"]
    if evals:
        ax.plot(
            [r["step"] for r in evals],
            [r["reward"] for r in evals],
            "o",
            color="tab:red",
            label="held-out reward (before / after)",
        )
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("reward")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title("bumblebee rl: GRPO on the built-in task")
    save(fig, out_png)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "runs", nargs="+", metavar="RUN_DIR", help="run directories (each with a metrics.jsonl)"
    )
    p.add_argument(
        "-o",
        "--out",
        default="report.png",
        metavar="OUT.png",
        help="output PNG (default report.png)",
    )
    p.add_argument(
        "--label",
        action="append",
        default=None,
        metavar="NAME",
        help="legend name of each run, in order (default: the directory names)",
    )
    p.add_argument(
        "--x",
        choices=X_AXES,
        default="step",
        help="x-axis: optimizer step (default) or tokens consumed (training runs)",
    )


def run(args) -> int:
    from bumblebee.report_inputs import check_inputs

    check_inputs(args.runs, args.out)  # one line per broken input or output, before any plotting
    if args.label is not None and len(args.label) != len(args.runs):
        raise ConfigError(f"--label given {len(args.label)} times for {len(args.runs)} runs")
    plot_runs(args.runs, args.out, args.label, args.x)
    print(f"bumblebee: wrote {args.out} ({len(args.runs)} run{'s' if len(args.runs) > 1 else ''})")
    return 0
