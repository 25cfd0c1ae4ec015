"""MLA's latent ring (``cp_attention = "ring"``: the normalized kv latent + roped rope key travel, every rank
re-expands each block with ``kv_b_proj``) equals single-process MLA at cp = 2 and cp = 4 on packed
documents that cross zigzag chunk borders: the output and every gradient (input, q LoRA path,
kv_a_proj, kv_a_layernorm, kv_b_proj, o_proj), with and without q LoRA, v narrower than the qk head.
The block kernels agree (``ring.py``'s fp32 tiles vs ``ring_flash.py``'s varlen steps through the
reference kernel, v zero-padded there), and keeping every hop's expansion for backward
(``save_expanded``, the measured alternative) gives the same gradients as re-expanding. Only
latents cross the ring: the P2P bytes per hop are C + R values per token."""

import torch
import torch.distributed as dist
from dist_utils import run_distributed

from bumblebee.primitives.attention.mla import MultiHeadLatentAttention
from bumblebee.primitives.attention.sdpa import sdpa_masked
from bumblebee.primitives.cp.ring import ring_attention
from bumblebee.primitives.cp.ring_flash import reference_block_kernel
from bumblebee.primitives.cp.ring_latent import latent_ring_attention
from bumblebee.primitives.cp.zigzag import build_cp_shards, shard_sequence
from bumblebee.primitives.packed import doc_layout
from bumblebee.primitives.recompute import NoRecompute
from bumblebee.primitives.rope import rope_cos_sin

T, H, N, C, DN, R, DV = 48, 32, 4, 12, 8, 4, 6
DOCS = [[5, 20, 7, 16], [47, 1]]  # per row; documents cross chunk borders at cp = 2 and 4


def positions():
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in DOCS])


def mla(q_lora, attend, cp_latents=""):
    torch.manual_seed(0)
    m = MultiHeadLatentAttention(
        H,
        N,
        q_lora_rank=q_lora,
        kv_lora_rank=C,
        qk_nope_head_dim=DN,
        qk_rope_head_dim=R,
        v_head_dim=DV,
        eps=1e-6,
        scale=0.3,
        rope_interleave=True,
        attend=attend,
        recompute=NoRecompute(),
        cp_latents=cp_latents,
    )
    with torch.no_grad():  # norms away from 1, so their gradients are checked too
        for p in m.parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape) * 0.3)
    return m


def inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randn(len(DOCS), T, H, generator=g), torch.randn(len(DOCS), T, H, generator=g)


def run(m, x, g, pos, layout):
    cos, sin = rope_cos_sin(pos, R, 10000.0, torch.float32)
    x = x.clone().requires_grad_()
    o = m(x, cos, sin, layout)
    (o * g).sum().backward()
    return o.detach(), x.grad, {n: p.grad for n, p in m.named_parameters()}


def _ranks(rank, world):
    x, g = inputs()
    pos = positions()
    shard = lambda t: shard_sequence(t, world, rank)  # noqa: E731
    layout = build_cp_shards(shard(pos), dist.group.WORLD)
    sent = []
    real_p2p = dist.P2POp

    def counting(op, tensor, peer, group=None, tag=0):  # bytes handed to isend by the ring
        if op is dist.isend:
            sent.append(tensor.numel() * tensor.element_size())
        return real_p2p(op, tensor, peer, group, tag)

    out = {}
    for q_lora in (0, 10):
        dist.P2POp = counting
        try:
            o, dx, grads = run(
                mla(q_lora, ring_attention, "ring"), shard(x), shard(g), shard(pos), layout
            )
        finally:
            dist.P2POp = real_p2p
        for (
            p
        ) in grads.values():  # the ranks' weight gradients sum, as the CP gradient reduction does
            dist.all_reduce(p)
        out[q_lora] = (o, dx, grads)
    # kernels and save-vs-recompute on the function itself
    gen = torch.Generator().manual_seed(2)
    q, lat, do = (
        torch.randn(2, N, T, DN + R, generator=gen),
        torch.randn(2, T, C + R, generator=gen),
        torch.randn(2, N, T, DV, generator=gen),
    )
    w = torch.randn(N * (DN + DV), C, generator=gen) * 0.3
    variants = {}
    for name, kw in (
        ("tiles", {}),
        ("flash", {"kernel": reference_block_kernel()}),
        ("kept", {"save_expanded": True}),
    ):
        xs = [
            t.clone().requires_grad_()
            for t in (shard(q.transpose(1, 2)).transpose(1, 2), shard(lat), w)
        ]
        o = latent_ring_attention(*xs, layout, 0.3, DV, **kw)
        o.backward(shard(do.transpose(1, 2)).transpose(1, 2))
        variants[name] = [o.detach()] + [t.grad for t in xs]
    return out, sent, variants


def check_ranks(world):
    x, g = inputs()
    pos = positions()
    results = run_distributed(_ranks, world)
    for q_lora in (0, 10):
        ref_o, ref_dx, ref_grads = run(mla(q_lora, sdpa_masked), x, g, pos, doc_layout(pos))
        for rank, (out, _, _) in enumerate(results):
            o, dx, grads = out[q_lora]
            for what, a, b in (
                ("output", o, shard_sequence(ref_o, world, rank)),
                ("input grad", dx, shard_sequence(ref_dx, world, rank)),
            ):
                err = ((a - b).norm() / b.norm()).item()
                assert err < 1e-5, (
                    f"cp={world} q_lora={q_lora} rank {rank} {what}: relative error {err:.1e}"
                )
            assert grads.keys() == ref_grads.keys()
            for name, ref in ref_grads.items():
                err = ((grads[name] - ref).norm() / ref.norm()).item()
                assert err < 1e-5, (
                    f"cp={world} q_lora={q_lora} rank {rank} {name}: relative error {err:.1e}"
                )
    for rank, (_, sent, variants) in enumerate(results):
        # forward: (cp - 1) latent hops; backward: (cp - 1) hops of latent + fp32 accumulator, one home
        B, L = len(DOCS), T // world
        per_call = [B * L * (C + R) * 4] * (world - 1) * 2 + [B * L * (C + R) * 4] * world
        assert sorted(sent) == sorted(per_call * 2), (world, rank, sent)
        for name in ("flash", "kept"):
            for what, a, b in zip(("o", "dq", "dlat", "dw"), variants[name], variants["tiles"]):
                err = ((a - b).norm() / b.norm()).item()
                assert err < 1e-5, (
                    f"cp={world} rank {rank} {name} vs tiles {what}: relative error {err:.1e}"
                )


def test_latent_ring_matches_single_process_cp2():
    check_ranks(2)


def test_latent_ring_matches_single_process_cp4():
    check_ranks(4)
