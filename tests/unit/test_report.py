"""``bumblebee report`` (bumblebee/report.py): the figure's panels, labels and reference
lines, read off the matplotlib objects, on hand-written metrics.jsonl fixtures."""

import json

import pytest

pytest.importorskip("matplotlib")

from bumblebee.config import ConfigError  # noqa: E402
from bumblebee.report import figure, plot_runs  # noqa: E402


def _write(path, recs):
    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return str(path)


def _train(path, losses, measured_once=True):
    return _write(
        path,
        [
            {
                "step": s,
                "loss": x,
                "aux_loss": 0.1,
                "grad_norm": 1.0,
                "lr": 1e-3,
                "tokens": 256,
                "tokens_per_s": 100.0,
                "peak_mem_bytes": 2**20,
                "peak_mem_measured": s == 1 or not measured_once,
                "expert_load_max_over_mean": 1.5,
                "expert_load_cv": 0.2,
                "expert_load_worst_layer": 0,
                "expert_ceiling": 4.0,
            }
            for s, x in enumerate(losses, 1)
        ],
    )


def _rl(path, warmup=3, steps=4):
    recs = [
        {"phase": "warmup", "step": s, "loss": 2.0 - 0.1 * s, "grad_norm": 1.0}
        for s in range(1, warmup + 1)
    ]
    recs.append({"phase": "eval", "step": 0, "reward": 0.2, "greedy_accuracy": 0.1})
    recs += [
        {
            "phase": "grpo",
            "step": s,
            "reward": 0.1 * s,
            "kl": 0.01 * s,
            "entropy": 1.0 - 0.1 * s,
            "clip_frac": 0.05,
            "loss": -0.01,
            "grad_norm": 0.5,
            "lr": 3e-4,
        }
        for s in range(1, steps + 1)
    ]
    recs.append({"phase": "eval", "step": steps, "reward": 0.6, "greedy_accuracy": 0.5})
    return _write(path, recs)


def _ax(fig, title_part):
    (ax,) = [a for a in fig.axes if title_part in a.get_title()]
    return ax


def _lines(ax, label_part):
    return [ln for ln in ax.get_lines() if label_part in ln.get_label()]


def test_training_report_labels_reference_lines_and_memory_note(tmp_path):
    fig = figure([_train(tmp_path / "a", [3.0, 2.5, 2.0])])
    for ax in fig.axes:
        if ax.get_visible() and ax.axison:
            assert ax.get_xlabel() == "step" and ax.get_ylabel(), ax.get_title()
    assert _ax(fig, "loss").get_ylabel() == "loss (nats / token)"
    load = _ax(fig, "expert load")
    (even,) = _lines(load, "even load")
    (ceiling,) = _lines(load, "E/K = 4")
    assert list(even.get_ydata()) == [1.0, 1.0] and list(ceiling.get_ydata()) == [4.0, 4.0]
    mem = _ax(fig, "peak memory")
    assert "measured once" in mem.get_title()
    assert any("first step only" in t.get_text() for t in mem.texts)
    assert len(fig.axes) == 6  # one run: no difference panel


def test_memory_measured_every_step_has_no_note(tmp_path):
    fig = figure([_train(tmp_path / "a", [3.0, 2.5], measured_once=False)])
    mem = _ax(fig, "peak memory")
    assert mem.get_title() == "peak memory" and not mem.texts


def test_tokens_x_axis(tmp_path):
    fig = figure([_train(tmp_path / "a", [3.0, 2.5, 2.0])], x="tokens")
    ax = _ax(fig, "gradient norm")
    assert ax.get_xlabel() == "tokens consumed"
    assert list(ax.get_lines()[0].get_xdata()) == [256, 512, 768]
    rl = _rl(tmp_path / "rl")
    with pytest.raises(ConfigError, match="--x tokens"):
        figure([rl], x="tokens")
    with pytest.raises(ConfigError, match="--x must be"):
        figure([rl], x="time")


def test_difference_panel_shows_identical_runs_as_zero(tmp_path):
    a = _train(tmp_path / "a", [3.0, 2.5, 2.0])
    b = _train(tmp_path / "b", [3.0, 2.5, 2.0])
    c = _train(tmp_path / "c", [3.0, 2.75, 2.0])
    fig = figure([a, b, c])
    diff = _ax(fig, "difference to a")
    assert diff.get_ylabel() == "loss - a" and diff.get_xlabel() == "step"
    (same,) = _lines(diff, "b (max |diff| 0)")
    assert list(same.get_ydata()) == [0.0, 0.0, 0.0]
    (other,) = _lines(diff, "c (max |diff| 0.25)")
    assert list(other.get_ydata()) == [0.0, 0.25, 0.0]


def test_rl_report_reward_kl_entropy_and_warmup(tmp_path):
    fig = figure([_rl(tmp_path / "rl", warmup=3, steps=4)])
    for title in ("reward", "KL", "entropy", "clip fraction"):
        ax = _ax(fig, title)
        assert ax.get_xlabel() == "step (warm-up, then GRPO)" and ax.get_ylabel()
    (grpo,) = _lines(_ax(fig, "KL"), "GRPO")
    assert list(grpo.get_xdata()) == [4, 5, 6, 7]  # after the 3 warm-up steps
    assert list(grpo.get_ydata()) == pytest.approx([0.01, 0.02, 0.03, 0.04])
    loss = _ax(fig, "loss")
    (warm,) = _lines(loss, "warm-up")
    assert list(warm.get_xdata()) == [1, 2, 3] and warm.get_linestyle() == ":"
    assert _lines(loss, "GRPO")[0].get_linestyle() == "-"
    (held,) = _lines(_ax(fig, "reward"), "held-out")
    assert list(held.get_xdata()) == [3, 7] and list(held.get_ydata()) == [0.2, 0.6]
    assert any(p.get_label() == "warm-up (supervised)" for p in loss.patches)  # the shaded warm-up


def test_rl_runs_compare_reward_and_do_not_mix_with_training(tmp_path, tmp_path_factory):
    a, b = _rl(tmp_path / "a"), _rl(tmp_path / "b")
    diff = _ax(figure([a, b]), "difference to a")
    assert diff.get_title().startswith("reward")
    assert (
        list(_lines(diff, "b (max |diff| 0)")[0].get_ydata()) == [0.0] * 6
    )  # 4 GRPO steps, 2 evaluations
    with pytest.raises(ConfigError, match="cannot overlay RL runs"):
        figure([a, _train(tmp_path / "t", [1.0])])


def test_cli_x_option_writes_png(tmp_path):
    from bumblebee.cli import main

    out = tmp_path / "r.png"
    assert (
        main(["report", _train(tmp_path / "a", [3.0, 2.0]), "--x", "tokens", "-o", str(out)]) == 0
    )
    assert out.stat().st_size > 0
    plot_runs([_rl(tmp_path / "rl")], str(tmp_path / "rl.png"))
    assert (tmp_path / "rl.png").stat().st_size > 0
