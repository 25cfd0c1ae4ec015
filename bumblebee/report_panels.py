"""The panels of ``bumblebee report`` (report.py): what each one draws from a run's records.

A training run: loss (held-out ``eval_loss`` as dots), gradient norm, tokens/s, peak memory, learning
rate and expert load; an RL run: loss, reward, KL, entropy, gradient norm and clip fraction; with
two or more runs, the difference of each to the first. Each function draws on the axes it is given
(matplotlib is loaded by report.py).
"""

from __future__ import annotations

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
MEMORY_ONCE = "measured at the first step only (CPU; train.track_memory = true measures every step)"


def expert_series(recs: list[dict]) -> tuple[str, dict[str, list]]:
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


def diff_panel(ax, runs, xs_all, labels, colors, key: str, ylabel: str) -> None:
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


def _width(j: int, n: int) -> float:
    return 1.2 + 1.6 * (n - 1 - j) / max(n - 1, 1)  # earlier runs wider: equal curves stay visible


def train_panels(flat, runs, labels, run_dirs, x, colors):
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
        title, series = expert_series(recs)
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
    if any(expert_series(r)[0] == "expert load" for r in runs):
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


def rl_panels(flat, runs, labels, run_dirs, x, colors):
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
