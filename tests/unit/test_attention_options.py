"""Sliding window and per-head sinks (primitives/attention/options.py) in every attention path.

- ``sdpa`` (reference) and ``varlen`` (CPU: per document) on packed rows equal a direct
  transcription of Hugging Face's eager gpt-oss attention (additive mask, sink column
  concatenated, softmax, sink dropped) applied to each document alone: outputs and the
  gradients of q, k, v and the sinks;
- the CP ring's blocks (``needed_steps``, ``forward_block``, ``backward_block``, ``merge_sinks``,
  ``sink_grad``), run for 4 zigzag ranks in one process with the hops replaced by indexing,
  equal the same reference, and the steps a window (or a document boundary) makes useless are
  skipped: counted exactly (6 of 16 for a window shorter than a chunk, none without a window),
  and running them anyway changes nothing;
- ``ring_attention`` itself on 4 ranks as threads (a mailbox for the transport): only the blocks
  some rank's window needs are exchanged, and the result is the reference's.
"""

from __future__ import annotations

import threading

import pytest
import torch

from bumblebee.primitives.attention.options import merge_sinks, sink_grad
from bumblebee.primitives.attention.sdpa import sdpa_masked, sdpa_varlen
from bumblebee.primitives.cp.ring import backward_block, forward_block, needed_steps
from bumblebee.primitives.cp.zigzag import CPShards, zigzag_index
from bumblebee.primitives.packed import doc_layout

B, N, K, D = 2, 4, 2, 8


def hf_eager(q, k, v, window, sinks, scale):
    """One document, HF's eager_attention_forward with its causal / sliding-window mask."""
    T = q.shape[2]
    i = torch.arange(T)
    allowed = i[None, :] <= i[:, None]
    if window:
        allowed &= i[None, :] > i[:, None] - window
    k, v = k.repeat_interleave(N // K, 1), v.repeat_interleave(N // K, 1)
    w = q @ k.transpose(2, 3) * scale + torch.where(allowed, 0.0, float("-inf"))
    if sinks is None:
        return torch.softmax(w, -1) @ v
    logits = torch.cat([w, sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, T, 1)], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    return torch.softmax(logits, -1)[..., :-1] @ v


def reference(q, k, v, lengths, window, sinks, scale):
    outs, s = [], 0
    for n in lengths:
        doc = [x[:, :, s : s + n] for x in (q, k, v)]
        outs.append(hf_eager(*doc, window, sinks, scale))
        s += n
    return torch.cat(outs, dim=2)


def inputs(T, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, T, D, generator=g, dtype=torch.float32) for h in (N, K, K))
    sinks = torch.randn(N, generator=g, dtype=torch.float32)
    return [t.requires_grad_() for t in (q, k, v, sinks)]


def grads(out, tensors, seed=1):
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return torch.autograd.grad(out, tensors, dout, allow_unused=True)


@pytest.mark.parametrize("impl", [sdpa_masked, sdpa_varlen])
@pytest.mark.parametrize("window,with_sinks", [(5, True), (0, True), (5, False)])
def test_packed_window_and_sinks_match_hf_eager(impl, window, with_sinks):
    lengths = [9, 3, 12]
    q, k, v, sinks = inputs(sum(lengths))
    s = sinks if with_sinks else None
    pos = torch.cat([torch.arange(n) for n in lengths])[None].expand(B, -1)
    out = impl(q, k, v, doc_layout(pos), 0.3, window=window, sinks=s)
    ref = reference(q, k, v, lengths, window, s, 0.3)
    assert (out - ref).abs().max().item() < 1e-5
    tensors = [q, k, v] + ([sinks] if with_sinks else [])
    for g, g_ref in zip(grads(out, tensors), grads(ref, tensors)):
        assert (g - g_ref).abs().max().item() < 1e-5


def ring_emulated(q, k, v, sinks, pos, C, window, run_all=False):
    """Every rank's ring forward and backward in one process: (outputs, dq, dk, dv, dsinks) in
    global token order and the number of (rank, step) block visits skipped."""
    T = q.shape[2]
    layouts = []
    docs = doc_layout(pos)
    for r in range(C):
        idx = zigzag_index(T, C, r)
        layouts.append(CPShards(None, C, r, T, docs.doc_ids("cpu"), idx, docs))
    G = N // K
    local = [lay.index_L for lay in layouts]
    qs = [q.detach()[:, :, i].reshape(B, K, G, -1, D) for i in local]
    ks = [k.detach()[:, :, i] for i in local]
    vs = [v.detach()[:, :, i] for i in local]
    heads = sinks.detach().view(1, K, G, 1)
    outs, lses, skipped = [], [], 0
    for r, lay in enumerate(layouts):
        o = torch.zeros_like(qs[r])
        lse = torch.full(o.shape[:-1], float("-inf"), dtype=o.dtype)
        need = needed_steps(lay, window)
        for step in range(C):
            src = (r - step) % C
            if need[step] or run_all:
                forward_block(qs[r], o, lse, ks[src], vs[src], lay, src, 0.3, window)
            skipped += not need[step]
        o, lse = merge_sinks(o, lse, heads)
        outs.append(o)
        lses.append(lse)
    dout = torch.randn(B, N, T, D, generator=torch.Generator().manual_seed(1), dtype=q.dtype)
    dq, dk, dv = [], [torch.zeros_like(x) for x in ks], [torch.zeros_like(x) for x in vs]
    dsinks = torch.zeros_like(heads)
    for r, lay in enumerate(layouts):
        do = dout[:, :, local[r]].reshape(B, K, G, -1, D)
        delta = (do * outs[r]).sum(-1)
        dq.append(torch.zeros_like(qs[r]))
        for step, need in enumerate(needed_steps(lay, window)):
            src = (r - step) % C
            if need or run_all:
                kv = (ks[src], vs[src], dk[src], dv[src])
                backward_block(qs[r], do, delta, lses[r], dq[r], *kv, lay, src, 0.3, window)
        dsinks += sink_grad(heads, lses[r], delta)
    glob = torch.cat(local)

    def unshard(parts, heads_):
        x = torch.cat([p.reshape(B, heads_, -1, D) for p in parts], dim=2)
        return torch.empty_like(x).index_copy_(2, glob, x)

    return (
        unshard(outs, N), unshard(dq, N), unshard(dk, K), unshard(dv, K), dsinks.reshape(N),
        dout, skipped,
    )  # fmt: skip


# 64 tokens, 4 ranks, chunks of 8 (rank r holds chunks r and 7 - r). A window of 3 reaches only
# the chunk before: rank r needs its own block and ranks r - 1 and r + 1 (ranks 0 and 3 one of
# them), 6 of 16 (rank, step) visits skipped; the document boundary at 40 (chunk 5's start, held
# by rank 2) also makes rank 3's block useless to rank 2: 7. Causal alone on one
# document needs every step.
@pytest.mark.parametrize(
    "window,lengths,skips", [(3, [64], 6), (2, [64], 6), (3, [40, 24], 7), (0, [64], 0)]
)
def test_ring_blocks_window_sinks_and_skipped_steps(window, lengths, skips):
    C, T = 4, sum(lengths)
    q, k, v, sinks = inputs(T, seed=2)
    pos = torch.cat([torch.arange(n) for n in lengths])[None].expand(B, -1)
    o, dq, dk, dv, ds, dout, skipped = ring_emulated(q, k, v, sinks, pos, C, window)
    assert skipped == skips
    ref = reference(q, k, v, lengths, window, sinks, 0.3)
    assert (o - ref).abs().max().item() < 1e-5  # fp32 tiles
    g_ref = torch.autograd.grad(ref, [q, k, v, sinks], dout)
    for g, r in zip((dq, dk, dv, ds), g_ref):
        assert (g - r).abs().max().item() < 1e-5
    if skips:  # the skipped steps, run anyway, add nothing
        again = ring_emulated(q, k, v, sinks, pos, C, window, run_all=True)
        assert all(torch.equal(a, b) for a, b in zip(again[:5], (o, dq, dk, dv, ds)))


@pytest.mark.parametrize("window", [5, 0])
def test_flash_sink_glue_on_the_reference_kernel(window):
    """The CUDA path's glue (flash_sinks.py: kernel LSE, sink merge, flash backward handed the
    merged output and LSE, the sinks' gradient) on the kernels' fp32 reference."""
    from bumblebee.primitives.attention.flash_sinks import flash_varlen_sinks, reference_kernel

    lengths = [9, 3, 12]
    q, k, v, sinks = inputs(sum(lengths), seed=3)
    pos = torch.cat([torch.arange(n) for n in lengths])[None].expand(B, -1)
    out = flash_varlen_sinks(q, k, v, doc_layout(pos), 0.3, sinks, window=window, kern=reference_kernel())  # fmt: skip
    ref = reference(q, k, v, lengths, window, sinks, 0.3)
    assert (out - ref).abs().max().item() < 1e-5
    for g, g_ref in zip(grads(out, [q, k, v, sinks]), grads(ref, [q, k, v, sinks])):
        assert (g - g_ref).abs().max().item() < 1e-5


def test_emulated_cuda_dispatch_runs_the_flash_sink_path():
    """Under the emulated-CUDA mode ``varlen`` with sinks takes the CUDA branch (flash kernels with
    the sink merge, their references counted as the kernels) and still equals HF's maths."""
    from bumblebee.primitives import emulation, kernel_choice
    from bumblebee.primitives.attention import flash_sinks

    calls = []
    real = flash_sinks.flash_varlen_sinks

    def spy(*a, **kw):
        calls.append(kw.get("window"))
        return real(*a, **kw)

    lengths = [9, 3, 12]
    q, k, v, sinks = inputs(sum(lengths), seed=4)
    pos = torch.cat([torch.arange(n) for n in lengths])[None].expand(B, -1)
    with emulation.emulate_cuda(check_comm=False), pytest.MonkeyPatch.context() as mp:
        mp.setattr("bumblebee.primitives.attention.sdpa.flash_varlen_sinks", spy)
        assert kernel_choice.select("attention", "varlen", "cuda", torch.bfloat16, sinks=True).fused
        out = sdpa_varlen(q, k, v, doc_layout(pos), 0.3, window=5, sinks=sinks)
    assert calls == [5]
    ref = reference(q, k, v, lengths, 5, sinks, 0.3)
    assert (out - ref).abs().max().item() < 1e-5


class Mailbox:
    """``ring_comm.exchange`` between threads standing for CP ranks: each send is a copy keyed by
    (sender, receiver, n-th message between them); a wait blocks until the matching one arrived."""

    def __init__(self):
        self.cv, self.box, self.count, self.offsets = threading.Condition(), {}, {}, []

    def exchange(self, tensors, layout, offset):
        r, C = layout.rank, layout.size
        dst, src = (r + offset) % C, (r - offset) % C
        bufs = [torch.empty(t.shape, dtype=t.dtype) for t in tensors]
        with self.cv:
            n = self.count.get((r, dst), 0)
            self.count[(r, dst)] = n + 1
            self.box[(r, dst, n)] = [t.detach().clone() for t in tensors]
            self.offsets.append((r, offset))
            m = self.count.get(("in", src, r), 0)
            self.count[("in", src, r)] = m + 1
            self.cv.notify_all()

        def wait():
            with self.cv:
                self.cv.wait_for(lambda: (src, r, m) in self.box)
                for b, t in zip(bufs, self.box.pop((src, r, m))):
                    b.copy_(t)

        return bufs, wait


def test_window_ring_on_four_ranks_exchanges_only_needed_blocks(monkeypatch):
    """``ring_attention`` with a window (3, shorter than the 8-token chunks) and sinks, 4 ranks as
    threads (the transport replaced by a mailbox; over gloo it is tests/distributed/
    test_gpt_oss_layouts.py's CP case): every rank's outputs, dQ / dK / dV and the summed sink
    gradient equal HF's maths on the whole row, and only the neighbours' blocks move: offsets 1
    and 3 forward, the same again plus the gradients sent home (-1, -3) backward, per rank,
    instead of 3 + 4 ring hops. The CP reference (``allgather``'s local attention over the
    gathered row) with the same options equals it too."""
    from bumblebee.primitives.cp import ring
    from bumblebee.primitives.cp.allgather import attend_gathered

    C, W, lengths = 4, 3, [40, 24]
    q, k, v, sinks = inputs(sum(lengths), seed=5)
    T = sum(lengths)
    pos = torch.cat([torch.arange(n) for n in lengths])[None].expand(B, -1)
    ref = reference(q, k, v, lengths, W, sinks, 0.3)
    dout = torch.randn(ref.shape, generator=torch.Generator().manual_seed(6))
    ref_grads = torch.autograd.grad(ref, [q, k, v, sinks], dout)
    mailbox = Mailbox()
    monkeypatch.setattr(ring, "exchange", mailbox.exchange)
    docs, results = doc_layout(pos), {}

    def rank(r):
        idx = zigzag_index(T, C, r)
        layout = CPShards(None, C, r, T, docs.doc_ids("cpu"), idx, docs)
        local = [t.detach()[:, :, idx].requires_grad_() for t in (q, k, v)]
        s = sinks.detach().clone().requires_grad_()
        out = ring.ring_attention(*local, layout, 0.3, window=W, sinks=s)
        gathered = attend_gathered(local[0], k, v, layout, 0.3, window=W, sinks=sinks)
        results[r] = idx, out, torch.autograd.grad(out, local + [s], dout[:, :, idx]), gathered

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(C)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(results) == C
    for idx, out, grads, gathered in results.values():
        assert (out - ref[:, :, idx]).abs().max().item() < 1e-5
        assert (gathered - ref[:, :, idx]).abs().max().item() < 1e-5
        for g, g_ref in zip(grads[:3], ref_grads[:3]):
            assert (g - g_ref[:, :, idx]).abs().max().item() < 1e-5
    dsinks = sum(grads[3] for _, _, grads, _ in results.values())
    assert (dsinks - ref_grads[3]).abs().max().item() < 1e-5
    for r in range(C):
        assert sorted(o for rr, o in mailbox.offsets if rr == r) == [-3, -1, 1, 1, 3, 3]
