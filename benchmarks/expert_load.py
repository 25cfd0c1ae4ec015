"""Expert load on the default task: no balancing vs the balance loss vs aux-loss-free ``sigmoid_bias``.

Runs the embedded default training run (the ``tiny`` Qwen3-MoE preset on the synthetic
retrieval task) once per variant, same seed and data, shortened by ``--steps`` /
``--seq-len``, and prints per variant the step-wise ``expert_load_max_over_mean`` (the worst
layer's busiest expert over the mean load, 1.0 = even) and ``expert_load_cv`` averaged over the
last quarter of the steps, the last-quarter loss, and the final per-layer max/mean. Variants
(each a list of ``--set`` overrides on top of the default config):

- ``none``: softmax router, ``router_aux_loss_coef = 0`` (no balancing at all);
- ``aux``: softmax router with the default balance loss (coefficient 0.001, ``global_batch``);
- ``aux_x10``: the same with coefficient 0.01;
- ``sigmoid``: ``sigmoid_bias`` router, coefficient 0, bias rate 0 (no balancing: the
  score function alone);
- ``sigmoid_bias``: ``sigmoid_bias`` with the default bias rate 0.001, coefficient 0;
- ``sigmoid_bias_x10``: bias rate 0.01.

Prints figures; never passes or fails.

    python benchmarks/expert_load.py --steps 100 --seq-len 512
"""

from __future__ import annotations

import argparse
import io
import json
import os
import tempfile

import torch

from bumblebee import load_config
from bumblebee.runtime.trainer import Trainer

VARIANTS = {
    "none": ["model.arch.router_aux_loss_coef=0.0"],
    "aux": [],
    "aux_x10": ["model.arch.router_aux_loss_coef=0.01"],
    "sigmoid": [
        "primitives.router=sigmoid_bias",
        "model.arch.router_aux_loss_coef=0.0",
        "moe.bias_update_rate=0.0",
    ],
    "sigmoid_bias": ["primitives.router=sigmoid_bias", "model.arch.router_aux_loss_coef=0.0"],
    "sigmoid_bias_x10": [
        "primitives.router=sigmoid_bias",
        "model.arch.router_aux_loss_coef=0.0",
        "moe.bias_update_rate=0.01",
    ],
}


def run(name: str, overrides: list[str], args, root: str) -> dict:
    cfg = load_config(
        None,
        [
            f"train.steps={args.steps}",
            f"train.seq_len={args.seq_len}",
            "train.eval_every=0",
            f"data.max_doc_len={args.seq_len}",
            f"train.out_dir={os.path.join(root, name)}",
            f"moe.load_histogram_every={args.steps}",
            *overrides,
            *args.set,
        ],
    )
    trainer = Trainer(cfg, stream=io.StringIO())
    trainer.run()
    recs = [json.loads(line) for line in open(os.path.join(cfg.train.out_dir, "metrics.jsonl"))]
    tail = recs[-max(1, len(recs) // 4) :]
    last = torch.tensor(recs[-1]["expert_load"], dtype=torch.float32)
    return {
        "max_over_mean": sum(r["expert_load_max_over_mean"] for r in tail) / len(tail),
        "cv": sum(r["expert_load_cv"] for r in tail) / len(tail),
        "loss": sum(r["loss"] for r in tail) / len(tail),
        "final_per_layer": (last.max(1).values / last.mean(1)).tolist(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument(
        "--set", action="append", default=[], help="extra section.key=value for every variant"
    )
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as root:
        print(
            f"default task, tiny preset, {args.steps} steps at seq_len {args.seq_len}; figures averaged over the "
            f"last quarter of the steps"
        )
        print(
            f"{'variant':18s} {'load max/mean':>13s} {'load cv':>8s} {'loss':>7s}  final max/mean per layer"
        )
        for name in args.variants.split(","):
            r = run(name, VARIANTS[name], args, root)
            layers = " ".join(f"{x:.2f}" for x in r["final_per_layer"])
            print(
                f"{name:18s} {r['max_over_mean']:13.3f} {r['cv']:8.3f} {r['loss']:7.3f}  {layers}",
                flush=True,
            )


if __name__ == "__main__":
    main()
