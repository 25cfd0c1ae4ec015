"""The RL Engine with pipeline parallelism (pp = 2 on 2 gloo ranks, 3 decoder layers: uneven stages)
equals one process on the same batch: log-probs and entropies returned on every rank (rows shorter
than train.seq_len, padded), two PPO/GRPO updates (loss, kl, entropy, clip fraction, grad norm with
the norm summed over stages), the balance loss kept on (each stage's routers get their share), and
the weight stream (every stage's tensors broadcast from the rank holding them, same names and values
on both ranks). The router is ``sigmoid_bias``: each stage moves its routers' biases by the global
expert load of the update's micro-batches, equal to the single process's (in the weight stream)."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed

from bumblebee import load_config
from bumblebee.rl.batch import pack_sequences
from bumblebee.rl.engine import Engine
from bumblebee.rl.losses import PolicyLoss

BASE = [
    "model.arch.num_hidden_layers=3",
    "model.arch.hidden_size=32",
    "model.arch.head_dim=8",
    "model.arch.num_experts=4",
    "model.arch.moe_intermediate_size=32",
    "primitives.attention=sdpa",
    "train.global_batch=4",
    "train.micro_batch=1",
    "train.seq_len=32",
    "primitives.router=sigmoid_bias",
]
LOSS = PolicyLoss(kl_coef=0.05, entropy_coef=0.01, agg="seq-mean-token-mean")


def batch(seq_len: int):
    g = torch.Generator().manual_seed(9)
    tokens = [
        torch.randint(0, 256, (int(torch.randint(3, 14, (1,), generator=g)),), generator=g).tolist()
        for _ in range(9)
    ]
    b = pack_sequences(
        tokens,
        [[i >= 2 for i in range(len(t))] for t in tokens],
        seq_len,
        advantages=torch.randn(9, generator=g).tolist(),
    )
    return b.replace(ref_logprobs=-torch.rand(b.input_ids.shape, generator=g) * 6)


def trace(e: Engine):
    lp = e.compute_logprobs(batch(26), entropy=True)  # rows shorter than train.seq_len: padded
    b = batch(
        32
    )  # the updates on full rows, an even count (no padding row or column: with the balance
    assert b.rows % 2 == 0  # loss on, padding tokens would be routed and count in it)
    steps = []
    for _ in range(2):
        m = e.train_step(b.replace(old_logprobs=e.compute_logprobs(b).logprobs), LOSS, lr=1e-2)
        steps.append(
            {k: m[k] for k in ("loss", "grad_norm", "kl", "entropy", "clip_frac", "tokens")}
        )
    weights = [
        (n, t.clone())
        for bucket in e.weight_buckets(bucket_bytes=8 << 10, dtype=torch.float32)
        for n, t in bucket
    ]
    return lp.logprobs, lp.entropy, steps, weights


def _ranks(rank, world, out_dir):
    return trace(Engine(load_config(None, BASE + ["parallel.pp=2", f"train.out_dir={out_dir}"])))


def test_pipeline_engine_matches_one_process(tmp_path):
    ref = trace(Engine(load_config(None, BASE + [f"train.out_dir={tmp_path}"])))
    for lp, ent, steps, weights in run_distributed(_ranks, 2, str(tmp_path), timeout=300):
        assert torch.allclose(lp, ref[0], atol=1e-5) and torch.allclose(ent, ref[1], atol=1e-5)
        for m, r in zip(steps, ref[2]):
            for k, v in r.items():
                assert m[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k
        assert sorted(n for n, _ in weights) == sorted(n for n, _ in ref[3])
        want = dict(ref[3])
        biases = [n for n in want if n.endswith("e_score_correction_bias")]
        assert len(biases) == 3 and any(
            want[n].abs().sum() > 0 for n in biases
        )  # moved (+-rate per step)
        for n, t in weights:
            if n in biases:
                assert torch.equal(t, want[n]), n
            else:
                # two Adam steps at lr 1e-2 amplify the layouts' different summation orders by an amount
                # that depends on the CPU's kernels (up to 1.4e-5 seen on an AMD EPYC, below 1e-5 on others)
                assert ((t - want[n]).norm() / want[n].norm()).item() < 1e-4, n
