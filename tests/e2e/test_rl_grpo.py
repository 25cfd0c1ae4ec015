"""The embedded GRPO run: reward rises over a fixed seed; ``bumblebee rl`` configuration and errors.

The improvement test runs the default task and optimizer settings for 30 GRPO steps
(seed 0, fixed once). Over seeds 0-4 these settings raised the held-out sampled reward
by 0.10-0.25 and the training reward (mean of the first vs last 6 steps) by 0.09-0.13,
so the asserted margins (0.05 and 0.04) are about half the smallest gain seen.
"""

from __future__ import annotations

import io
import json
import math

import pytest
import torch

from bumblebee.cli import main
from bumblebee.rl.cli import load_configs
from bumblebee.rl.run import run


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # what `bumblebee rl` uses: the toy model is too small for more
    yield
    torch.set_num_threads(n)


def test_grpo_reward_improves(tmp_path):
    cfg, rl = load_configs(
        None, [f"train.out_dir={tmp_path}", "rl.steps=30", "rl.eval_problems=64"]
    )
    summary = run(cfg, rl, stream=io.StringIO())
    rewards = summary["rewards"]
    k = 6
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    assert last >= first + 0.04, (first, last, rewards)
    before, after = summary["eval_before"], summary["eval_after"]
    assert after["reward"] >= before["reward"] + 0.05, (before, after)
    assert 0.0 < before["reward"] < 0.9  # the warm-up leaves room: RL is what moves it
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    grpo = [r for r in lines if r["phase"] == "grpo"]
    assert len(grpo) == 30 and {r["phase"] for r in lines} == {"warmup", "grpo", "eval"}
    for key in ("reward", "kl", "entropy", "clip_frac", "grad_norm", "loss", "approx_kl_old"):
        assert all(math.isfinite(r[key]) for r in grpo), key
    assert grpo[-1]["kl"] > 0 and grpo[-1]["entropy"] > 0 and any(r["clip_frac"] > 0 for r in grpo)
    # the sampler and the Engine score the rollouts alike (same weights, KV cache vs packed forward)
    assert max(r["rollout_logprob_err"] for r in grpo) < 1e-4


def test_cli_short_run_with_config_file(tmp_path, capsys):
    f = tmp_path / "rl.toml"
    f.write_text(
        "[train]\nseed = 3\n[model.arch]\nhidden_size = 32\n[rl]\nsteps = 2\nwarmup_steps = 2\n"
        "eval_problems = 4\nprompts_per_step = 4\n"
    )
    out = tmp_path / "out"
    assert (
        main(
            ["rl", "--config", str(f), "--set", f"train.out_dir={out}", "--set", "rl.group_size=3"]
        )
        == 0
    )
    cfg, rl = load_configs(str(f), ["rl.group_size=3"])
    assert (cfg.train.seed, cfg.model.arch["hidden_size"], rl.steps, rl.group_size) == (3, 32, 2, 3)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["phase"] for r in lines] == ["warmup", "warmup", "eval", "grpo", "grpo", "eval"]
    assert "done: mean reward" in capsys.readouterr().out and (out / "config.toml").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--set", "rl.nope=1"], "unknown key rl.nope"),
        (["--set", "rl.steps=many"], "rl.steps expects int"),
        (["--set", "rl.group_size=1"], "rl.group_size must be >= 2"),
        (["--set", "train.lr=-1"], "train.lr must be > 0"),
    ],
)
def test_cli_errors_exit_2_with_one_line(args, message, capsys):
    assert main(["rl", *args]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bumblebee: error: ") and message in lines[0], (
        err
    )


def test_plot(tmp_path, capsys):
    try:
        import matplotlib  # noqa: F401
    except ImportError:  # not a dependency: a clear error before any training
        assert main(["rl", "--plot", str(tmp_path / "r.png")]) == 2
        assert "pip install 'bumblebee[data]'" in capsys.readouterr().err
        return
    from bumblebee.rl.cli import plot_rewards

    (tmp_path / "m.jsonl").write_text(
        "\n".join(
            json.dumps({"phase": "grpo", "step": i, "reward": i / 4, "accuracy": i / 5})
            for i in range(1, 4)
        )
    )
    plot_rewards(str(tmp_path / "m.jsonl"), str(tmp_path / "r.png"))
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"
