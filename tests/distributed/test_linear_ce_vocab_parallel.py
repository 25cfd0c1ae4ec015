"""Vocab-parallel ``linear_ce`` on 2 gloo ranks equals the unsharded computation.

Each rank holds a contiguous row slice of the LM-head weight (uneven slices:
V = 101 splits 51 / 50, V = 1 leaves rank 1 an empty slice); labels are global ids, so a label's logit lives on one
rank only. The sharded per-token loss, reduced losses and entropy must equal the
unsharded ``ce`` reference on every rank, ``dhidden`` must be the full gradient
(all-reduced) and ``dweight`` the reference gradient's rows of the local slice.
All ranks share one spawn (one process-group setup) to keep the test fast.

Legend: T tokens, H hidden, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from dist_utils import run_distributed

CASES = [  # (T, V, reduction, temperature, with_entropy, all_ignored)
    (37, 101, "none", 1.0, True, False),
    (37, 101, "mean", 0.7, True, False),
    (1, 64, "sum", 1.0, False, False),
    (9, 33, "mean", 1.0, True, True),
    (5, 1, "none", 1.0, True, False),  # rank 1 holds an empty slice
]


def _case(rank, world, T, V, reduction, temperature, with_entropy, all_ignored):
    from bumblebee.primitives.loss import cross_entropy, linear_cross_entropy

    g = torch.Generator().manual_seed(T * 1000 + V)  # same inputs on every rank
    hidden_TH = torch.randn(T, 24, generator=g) * 2.0
    weight_VH = torch.randn(V, 24, generator=g) * 0.5
    labels_T = torch.randint(0, V, (T,), generator=g)
    labels_T[::4] = -100
    if all_ignored:
        labels_T[:] = -100
    coef_T = torch.linspace(-1.0, 2.0, T)
    bounds = [0, (V + world - 1) // world, V]  # rank r holds rows bounds[r]:bounds[r+1]
    lo, hi = bounds[rank], bounds[rank + 1]

    def step(fn, w_VH, **kw):
        h = hidden_TH.clone().requires_grad_()
        w = w_VH.clone().requires_grad_()
        out = fn(
            h,
            w,
            labels_T,
            reduction=reduction,
            temperature=temperature,
            with_entropy=with_entropy,
            **kw,
        )
        loss, ent_T = out if with_entropy else (out, torch.zeros(T))
        total = (loss * coef_T).sum() if reduction == "none" else loss
        (
            total + 0.1 * (ent_T * coef_T.flip(0)).sum()
        ).backward() if with_entropy else total.backward()
        return loss.detach(), ent_T.detach(), h.grad, w.grad

    ref = step(cross_entropy, weight_VH)
    got = step(
        linear_cross_entropy,
        weight_VH[lo:hi],
        vocab_group=dist.group.WORLD,
        token_tile=8,
        vocab_tile=16,
    )
    errs = {}
    for name, a, b in zip(("loss", "entropy", "grad_hidden", "grad_weight"), got, ref):
        b = b[lo:hi] if name == "grad_weight" else b
        denom = b.double().norm().item()
        errs[name] = (
            (a.double() - b.double()).norm().item() / denom
            if denom > 0
            else a.double().norm().item()
        )
    return errs


def _all_cases(rank, world):
    return [_case(rank, world, *case) for case in CASES]


def test_vocab_parallel_equals_unsharded():
    results = run_distributed(_all_cases, 2, timeout=120)
    for rank, per_case in enumerate(results):
        for case, errs in zip(CASES, per_case):
            for name, err in errs.items():
                assert err <= 1e-5, (rank, case, name, err)
