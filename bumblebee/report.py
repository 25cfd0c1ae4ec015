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
import json
import os

from bumblebee.config import ConfigError

PANELS = (  # (title, metrics key, scale, y-axis label)
    ("loss", "loss", 1.0, "loss (nats / token)"),
    ("gradient norm", "grad_norm", 1.0, "gradient L2 norm"),
    ("tokens / s", "tokens_per_s", 1.0, "tokens / s"),
    ("peak memory", "peak_mem_bytes", 2.0**-20, "peak memory (MiB)"),
    ("learning rate", "lr", 1.0, "learning rate"),
)
RL_PANELS = (  # (title, key of the records, y-axis label); the warm-up logs loss and grad_norm only
    ("loss (warm-up: token NLL; GRPO: policy loss)", "loss", "loss"),
    ("reward", "reward", "mean reward"),
    ("KL to the reference policy", "kl", "KL (nats / token)"),
    ("entropy", "entropy", "entropy (nats / token)"),
    ("gradient norm", "grad_norm", "gradient L2 norm"),
    ("clip fraction", "clip_frac", "fraction of tokens clipped"),
)
X_AXES = ("step", "tokens")
MEMORY_ONCE = "measured at the first step only (CPU; train.track_memory = true measures every step)"


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
    keys = sorted(
        {
            k
            for r in recs
            for k, v in r.items()  # the scalar load figures (not the per-expert histogram)
            if k.startswith("expert_load_")
            and k != "expert_load_worst_layer"
            and isinstance(v, (int, float))
        }
    )
    if keys:
        return "expert load", {k: [r.get(k) for r in recs] for k in keys}
    return "expert load: balance loss (min at even load)", {
        "aux_loss": [r.get("aux_loss") for r in recs]
    }


def _num(value, scale: float = 1.0) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return value * scale if ok else float("nan")


def _is_rl(recs: list[dict]) -> bool:
    """``bumblebee rl`` records carry a phase (warmup / grpo / eval)."""
    return any("phase" in r for r in recs)


def _token_xs(recs: list[dict], where: str) -> list[float]:
    """Tokens consumed up to and including each step (the running sum of ``tokens``)."""
    total, out = 0, []
    for r in recs:
        if not isinstance(r.get("tokens"), (int, float)):
            raise ConfigError(
                f"{where}: step {r.get('step')} logs no 'tokens' (--x tokens needs a training run)"
            )
        total += r["tokens"]
        out.append(total)
    return out


def _rl_xs(recs: list[dict]) -> tuple[int, list[int]]:
    """Warm-up step s at s, GRPO step s (and the evaluations, after step 0 and the last) at W + s."""
    w = max((r["step"] for r in recs if r.get("phase") == "warmup"), default=0)
    return w, [r["step"] + (w if r.get("phase") != "warmup" else 0) for r in recs]


def _diff_panel(ax, runs, xs_all, labels, colors, key: str, ylabel: str) -> None:
    """``key`` of every later run minus the first run's, at the same (phase, step): identical
    runs draw a flat line at 0 and say ``max |diff| 0``."""
    base = {
        (r.get("phase"), r["step"]): r[key] for r in runs[0] if isinstance(r.get(key), (int, float))
    }
    ax.axhline(0.0, color=colors[0], lw=2.5, label=f"{labels[0]} (reference)")
    for j in range(1, len(runs)):
        pts = [
            (xv, r[key] - base[(r.get("phase"), r["step"])])
            for xv, r in zip(xs_all[j], runs[j])
            if isinstance(r.get(key), (int, float)) and (r.get("phase"), r["step"]) in base
        ]
        worst = max((abs(d) for _, d in pts), default=float("nan"))
        ax.plot(
            [p[0] for p in pts],
            [p[1] for p in pts],
            color=colors[j % len(colors)],
            lw=1.2,
            label=f"{labels[j]} (max |diff| {worst:.3g})",
        )
    ax.set_title(f"{key}: difference to {labels[0]}")
    ax.set_ylabel(f"{ylabel} - {labels[0]}")
    ax.legend(fontsize=7)


def _load_reference_lines(ax, runs: list[list[dict]]) -> None:
    """Even load (max/mean = 1) and the top-k ceiling E/K (every token on the same K experts)."""
    ax.axhline(1.0, color="gray", ls=":", lw=1, label="even load (1)")
    for c in sorted(
        {r["expert_ceiling"] for recs in runs for r in recs if _num(r.get("expert_ceiling")) > 1}
    ):
        ax.axhline(c, color="gray", ls="--", lw=1, label=f"top-k ceiling E/K = {c:g}")
    ax.set_ylabel("load (worst layer; max/mean 1 = even)")


def figure(run_dirs: list[str], labels: list[str] | None = None, x: str = "step"):
    """The report's matplotlib figure: training runs (PANELS, expert load) or RL runs
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
    draw = _rl_panels if all(rl) else _train_panels
    xs_all, xlabel = draw(flat, runs, labels, run_dirs, x, colors)
    if diff:
        _diff_panel(
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


def _width(j: int, n: int) -> float:
    return 1.2 + 1.6 * (n - 1 - j) / max(n - 1, 1)  # earlier runs wider: equal curves stay visible


def _train_panels(flat, runs, labels, run_dirs, x, colors):
    xs_all = [
        [r["step"] for r in recs] if x == "step" else _token_xs(recs, d)
        for recs, d in zip(runs, run_dirs)
    ]
    once = []
    for j, (recs, label, xs) in enumerate(zip(runs, labels, xs_all)):
        c, lw = colors[j % len(colors)], _width(j, len(runs))
        for ax, (title, key, scale, ylabel) in zip(flat, PANELS):
            ax.plot(xs, [_num(r.get(key), scale) for r in recs], color=c, lw=lw, label=label)
            ax.set_title(title)
            ax.set_ylabel(ylabel)
        ev = [(xv, r["eval_loss"]) for xv, r in zip(xs, recs) if "eval_loss" in r]
        if ev:
            flat[0].plot(
                [e[0] for e in ev],
                [e[1] for e in ev],
                "o--",
                color=c,
                ms=4,
                lw=0.8,
                label=f"{label} (held-out)",
            )
        title, series = _expert_series(recs)
        for k, (name, ys) in enumerate(series.items()):
            flat[5].plot(
                xs,
                [_num(y) for y in ys],
                color=c,
                ls=("-", "--", ":")[k % 3],
                lw=1.2,
                label=f"{label} {name}" if len(series) > 1 else label,
            )
        flat[5].set_title(title)
        if any(
            r.get("peak_mem_measured") is False for r in recs
        ):  # CPU: the first step's peak, repeated
            once.append(label)
    if any(_expert_series(r)[0] == "expert load" for r in runs):
        _load_reference_lines(flat[5], runs)
        flat[5].legend(fontsize=7)
    else:
        flat[5].set_ylabel("balance loss")
    if once:
        flat[3].set_title("peak memory (measured once)")
        flat[3].text(
            0.02,
            0.02,
            ", ".join(once) + ": " + MEMORY_ONCE,
            transform=flat[3].transAxes,
            fontsize=7,
            va="bottom",
            wrap=True,
        )
    flat[0].legend(fontsize=8)
    return xs_all, "step" if x == "step" else "tokens consumed"


def _rl_panels(flat, runs, labels, run_dirs, x, colors):
    xs_all = []
    for j, (recs, label) in enumerate(zip(runs, labels)):
        c, lw = colors[j % len(colors)], _width(j, len(runs))
        w, xs = _rl_xs(recs)
        xs_all.append(xs)
        for phase, style, name in (("warmup", ":", "warm-up"), ("grpo", "-", "GRPO")):
            pts = [(xv, r) for xv, r in zip(xs, recs) if r.get("phase") == phase]
            for ax, (_, key, _) in zip(flat, RL_PANELS):
                if pts and any(key in r for _, r in pts):
                    ax.plot(
                        [p[0] for p in pts],
                        [_num(r.get(key)) for _, r in pts],
                        color=c,
                        ls=style,
                        lw=lw,
                        label=f"{label} {name}",
                    )
        ev = [
            (xv, r["reward"])
            for xv, r in zip(xs, recs)
            if r.get("phase") == "eval" and "reward" in r
        ]
        if ev:
            flat[1].plot(
                [e[0] for e in ev],
                [e[1] for e in ev],
                "o",
                color=c,
                ms=6,
                label=f"{label} held-out",
            )
        for ax in flat[:6]:
            if w:
                ax.axvspan(
                    0.5,
                    w + 0.5,
                    color=c,
                    alpha=0.06,
                    label="warm-up (supervised)" if j == 0 else None,
                )
                ax.axvline(w + 0.5, color=c, lw=0.8, ls="--")
    for ax, (title, _, ylabel) in zip(flat, RL_PANELS):
        ax.set_title(title)
        ax.set_ylabel(ylabel)
    flat[0].legend(fontsize=7)
    flat[1].legend(fontsize=7)
    return xs_all, "step (warm-up, then GRPO)"


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
