"""DeepSeek Sparse Attention's CP fetch (primitives/attention/dsa_cp.py) against the dense masked
reference on the whole row, float64: local zigzag queries, the row's indexer keys all-gathered,
only the selected latent rows fetched from their owners. Packed documents (one spans every shard),
top-k 10 of 48 keys. ``rank_check`` runs on each CP rank (tests/distributed/test_dsa_layouts.py
launches it at cp = 2 with the layout runs); ``compare`` checks every rank's output, the summed
indexer KL, every input's gradient (latents through the reverse all-to-all, indexer keys through
the reduce-scatter), and that each rank fetched fewer latent rows than an all-gather brings.

    PYTHONPATH=.:tests python tests/dsa_fetch_check.py 4      # cp = 4, outside the suite (time)
"""

from __future__ import annotations

import sys

import torch

from bumblebee.primitives.attention import dsa_cp
from bumblebee.primitives.attention.dsa import dsa_reference
from bumblebee.primitives.cp.zigzag import build_cp_shards, shard_sequence

B, S, N, C, R, HI, DI, TOPK = 2, 48, 3, 8, 4, 4, 8, 10
KW = dict(topk=TOPK, scale=0.3, index_scale=DI**-0.5, C=C)
POS = torch.stack([torch.cat([torch.arange(7), torch.arange(41)]), torch.arange(S)])


def full_inputs():
    """q_abs, latents, indexer q, indexer keys, indexer weights over the whole row."""
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    return [r(B, S, N, C + R), r(B, S, C + R), r(B, S, HI, DI), r(B, S, DI), r(B, S, HI)]


def rank_check(rank, world):
    """This rank's (output, summed KL, input gradients, latent rows fetched)."""
    import torch.distributed as dist

    from bumblebee.primitives.cp.allgather import GatherSequence

    layout = build_cp_shards(shard_sequence(POS, world, rank), dist.group.WORLD)
    local = [shard_sequence(x, world, rank).requires_grad_() for x in full_inputs()]
    q_abs, lat, qi, ki, w = local
    ki_g = GatherSequence.apply(ki[:, None], layout)[:, 0]
    seen, real = [], dsa_cp.FetchRows.apply
    dsa_cp.FetchRows.apply = lambda *a: seen.append(len(a[1])) or real(*a)
    try:
        o, kl = dsa_cp.dsa_fetched(q_abs, lat, qi, ki_g, w, layout, block=5, **KW)
    finally:
        dsa_cp.FetchRows.apply = real
    ((o**2).sum() + kl).backward()
    return o.detach(), kl.detach(), [x.grad for x in local], seen[0]


def compare(outs, world):
    full = [x.requires_grad_() for x in full_inputs()]
    doc = torch.zeros_like(POS)
    doc[0, 7:] = 1
    o_ref, kl_ref, sel = dsa_reference(*full, torch.arange(S), doc, doc, dense=False, **KW)
    assert (sel.sum(-1) == TOPK).any() and sel.sum(-1).max() == TOPK  # keys really dropped
    grads = torch.autograd.grad((o_ref**2).sum() + kl_ref, full)
    torch.testing.assert_close(sum(r[1] for r in outs), kl_ref, rtol=1e-10, atol=1e-10)
    for rank, (o, _, g, fetched) in enumerate(outs):
        torch.testing.assert_close(o, shard_sequence(o_ref, world, rank), rtol=1e-10, atol=1e-10)
        for gi, gref in zip(g, grads):
            torch.testing.assert_close(gi, shard_sequence(gref, world, rank), rtol=1e-9, atol=1e-10)
        assert fetched < B * S, (rank, fetched)  # fewer rows than an all-gather's


if __name__ == "__main__":
    from dist_utils import run_distributed

    world = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    outs = run_distributed(rank_check, world)
    compare(outs, world)
    print(f"cp = {world}: fetched core = reference; rows fetched per rank", [o[3] for o in outs])
