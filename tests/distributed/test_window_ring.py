"""The CP ring with a sliding window and sinks on 4 gloo ranks (zigzag shards, chunks of 8
tokens, window 3, two documents): outputs, dQ / dK / dV of every rank's shard and the summed
sink gradient equal the one-process reference (``sdpa``) on the whole row, and only the steps
some rank needs move data: offsets 1 and 3 (the neighbours' blocks), 2 exchanges forward and
4 backward (blocks fetched again, gradients sent home), instead of 3 + 4 ring hops. The CP
reference (``allgather``) with the same options equals the same reference."""

import torch
import torch.distributed as dist
from dist_utils import run_distributed

B, N, K, D, T, C, W = 2, 4, 2, 8, 64, 4, 3
LENGTHS = [40, 24]


def _inputs():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, h, T, D, generator=g) for h in (N, K, K))
    return q, k, v, torch.randn(N, generator=g), torch.randn(B, N, T, D, generator=g)


def _rank(rank, world):
    from bumblebee.primitives.attention.sdpa import sdpa_masked
    from bumblebee.primitives.cp import ring
    from bumblebee.primitives.cp.allgather import allgather_attention
    from bumblebee.primitives.cp.layout import build_cp_layout, zigzag_index
    from bumblebee.primitives.packed import doc_layout

    offsets = []
    real = ring.exchange

    def counted(tensors, layout, offset):
        offsets.append(offset)
        return real(tensors, layout, offset)

    ring.exchange = counted
    q, k, v, sinks, dout = _inputs()
    pos = torch.cat([torch.arange(n) for n in LENGTHS])[None].expand(B, -1)
    full = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    ref = sdpa_masked(*full[:3], doc_layout(pos), 0.3, window=W, sinks=full[3])
    ref_grads = torch.autograd.grad(ref, full, dout)
    idx = zigzag_index(T, C, rank)
    local = [t[:, :, idx].clone().requires_grad_() for t in (q, k, v)]
    s = sinks.clone().requires_grad_()
    layout = build_cp_layout(pos[:, idx].contiguous(), dist.group.WORLD)
    errs = []
    for impl in (ring.ring_attention, allgather_attention):
        out = impl(*local, layout, 0.3, window=W, sinks=s)
        grads = torch.autograd.grad(out, local + [s], dout[:, :, idx])
        dist.all_reduce(grads[3])
        errs.append((out - ref[:, :, idx]).abs().max().item())
        errs += [(g - r[:, :, idx]).abs().max().item() for g, r in zip(grads[:3], ref_grads[:3])]
        errs.append((grads[3] - ref_grads[3]).abs().max().item())
    return errs, offsets


def test_window_ring_matches_reference_and_skips_steps():
    for errs, offsets in run_distributed(_rank, C):
        assert max(errs) < 1e-5, errs
        assert offsets == [1, 3, 1, -1, 3, -3], offsets
